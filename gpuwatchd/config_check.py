"""``gpuwatchd check-config FILE``: the mistakes in a config that can be seen without a run.

Beyond what :func:`gpuwatchd.config.parse_config` refuses (syntax, unknown keys, bad
values: each bad setting and each bad job, with file:line), each managed job is checked
against the machine: its ``cwd``, its command's program on ``PATH``, a Python script and
the modules it imports in the interpreter that will run it, and the directory of its
SQLite database or Optuna journal file; a ``restart_study`` ``max_retries`` that differs
from the job's ``optuna.max_retries`` is a warning (the smaller applies).
Specification: docs/cli.md, "gpuwatchd check-config".
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gpuwatchd.config import JobConfig, Settings, config_errors, parse_config
from gpuwatchd.errors import ConfigError, PolicyError
from gpuwatchd.jobs.storage import parse_storage
from gpuwatchd.yamlsrc import LocatedDict, load_located

__all__ = ["Mistake", "check_config", "run_check"]

_SCRIPT_MAX_BYTES: Final = 4 * 2**20
"""A Python script larger than this is not parsed for its imports."""
_FIND_SPEC: Final = (
    "import importlib.util, sys\n"
    "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))\n"
)


@dataclass(frozen=True, slots=True)
class Mistake:
    """One mistake: ``path:line: message`` (``line`` 1-based). A ``warning`` is said but
    does not fail the check (exit status 0)."""

    path: str
    line: int
    message: str
    warning: bool = False

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"

    def to_dict(self) -> dict[str, str | int]:
        """``{"path", "line", "message"}`` (``check-config --json``)."""
        return {"path": self.path, "line": self.line, "message": self.message}


def check_config(path: str, policies: Sequence[str] = ()) -> tuple[Settings | None, list[Mistake]]:
    """Check the config file ``path`` (and the ``restart_study`` actions of ``policies``,
    else of the config's ``policies:``). Returns the settings (``None`` when the file
    cannot be parsed: then each bad setting and job is a mistake, and the jobs that parse
    are still checked) and every mistake found, in file order. Never raises for a bad
    file: an unreadable one, or one that is not YAML, is one mistake.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return None, [Mistake(path, 1, f"cannot read config file: {exc}")]
    settings: Settings | None
    errors: list[ConfigError] = []
    try:
        settings = parse_config(text, path)
        jobs = list(settings.jobs)
    except ConfigError:  # every bad setting and job, then the good jobs' checks
        settings = None
        jobs, errors = config_errors(text, path)
    mistakes = [Mistake(e.path or path, e.line or 1, e.message) for e in errors]
    if errors and not jobs:
        return None, mistakes
    doc = load_located(text, path, error=ConfigError)
    jobs_doc = doc.get("jobs") if isinstance(doc, LocatedDict) else None
    for job in jobs:
        spec = jobs_doc.get(job.name) if isinstance(jobs_doc, LocatedDict) else None
        lines = spec if isinstance(spec, LocatedDict) else LocatedDict(path)
        mistakes += _check_job(path, job, lines)
    if settings is not None:
        mistakes += _check_retries(path, settings, jobs_doc, policies or settings.policies)
    return settings, sorted(mistakes, key=lambda m: (m.path, m.line))


def run_check(path: str, policies: Sequence[str] = (), json_mode: bool = False) -> int:
    """``gpuwatchd check-config``: print each mistake (``error: FILE:LINE: ...``) and
    each warning (``warning: FILE:LINE: ...``) on stderr; return 1 when there is a
    mistake, else print ``FILE: OK (N jobs: ...)`` and return 0. With ``json_mode`` one
    JSON object on stdout instead: ``{"path", "ok", "jobs": [names], "mistakes": [{"path",
    "line", "message"}], "warnings": [same]}``."""
    settings, found = check_config(path, policies)
    mistakes = [m for m in found if not m.warning]
    ok = not mistakes and settings is not None
    if json_mode:
        report = {
            "path": path,
            "ok": ok,
            "jobs": [j.name for j in settings.jobs] if settings is not None else [],
            "mistakes": [m.to_dict() for m in mistakes],
            "warnings": [m.to_dict() for m in found if m.warning],
        }
        print(json.dumps(report, sort_keys=True))
        return 0 if ok else 1
    for mistake in found:
        print(f"{'warning' if mistake.warning else 'error'}: {mistake}", file=sys.stderr)
    if not ok or settings is None:
        return 1
    jobs = ", ".join(j.name for j in settings.jobs) or "no managed jobs"
    print(f"{path}: OK ({len(settings.jobs)} jobs: {jobs})")
    return 0


def _check_job(path: str, job: JobConfig, spec: LocatedDict) -> list[Mistake]:
    out: list[Mistake] = []

    def add(key: str, message: str) -> None:
        out.append(Mistake(path, spec.key_line(key), f"job {job.name!r}: {message}"))

    cwd = job.cwd
    if cwd is not None and not os.path.isdir(cwd):
        add("cwd", f"cwd {cwd} is not a directory")
        return out  # what the command names is relative to it: nothing more to check
    env = {**os.environ, **job.env}
    program = job.command[0]
    if "/" in program:
        where = os.path.join(cwd or os.getcwd(), program)
        found = where if os.access(where, os.X_OK) and os.path.isfile(where) else None
        if found is None:
            add("command", f"command[0] {program} is not an executable file")
    else:
        found = shutil.which(program, path=env.get("PATH", os.defpath))
        if found is None:
            add("command", f"command[0] {program!r} is not found on PATH ({env.get('PATH', '')})")
    if found is not None and Path(program).name.startswith("python"):
        out += _check_python(path, job, spec, found, cwd, env)
    if job.optuna is not None:
        storage = parse_storage(job.optuna.storage)  # parse_config accepted it
        file = storage.local_file
        if file is not None and not os.path.isdir(os.path.dirname(file)):
            optuna = spec.get("optuna")
            line = optuna.key_line("storage") if isinstance(optuna, LocatedDict) else 0
            out.append(
                Mistake(
                    path,
                    line or spec.key_line("optuna"),
                    f"job {job.name!r}: optuna.storage: the {storage.label} file's directory "
                    f"{os.path.dirname(file)} does not exist",
                )
            )
    return out


def _check_python(
    path: str, job: JobConfig, spec: LocatedDict, python: str, cwd: str | None, env: dict[str, str]
) -> list[Mistake]:
    """``python SCRIPT ...``: the script exists and its imports resolve in ``python``."""
    args = job.command[1:]
    script = next((a for a in args if not a.startswith("-")), None)
    if script is None or not script.endswith(".py") or any(a in ("-c", "-m") for a in args):
        return []
    where = Path(cwd or os.getcwd(), script)
    line = spec.key_line("command")
    if not where.is_file():
        return [Mistake(path, line, f"job {job.name!r}: {python} can't open file {where}")]
    try:
        source = where.read_bytes()[:_SCRIPT_MAX_BYTES]
        tree = ast.parse(source, filename=str(where))
    except (OSError, SyntaxError, ValueError):
        return []
    modules: set[str] = set()
    for node in tree.body:  # the script's top-level imports (what runs first)
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    local = {p.stem for p in where.parent.iterdir() if p.suffix == ".py" or p.is_dir()}
    wanted = sorted(m for m in modules - local - set(sys.builtin_module_names) if m != "__future__")
    if not wanted:
        return []
    from gpuwatchd.jobs.launch import probe

    status, text = probe([python, "-c", _FIND_SPEC, *wanted], env=env, cwd=cwd)
    if status != 0:
        return []  # the interpreter cannot even run a check: the worker will say more
    missing = text.split()
    if not missing:
        return []
    return [
        Mistake(
            path,
            line,
            f"job {job.name!r}: {python} (command[0] {job.command[0]!r}) cannot import "
            f"{', '.join(missing)}, which {script} imports (ModuleNotFoundError at start); "
            "give the interpreter of the environment that has them",
        )
    ]


def _check_retries(
    path: str, settings: Settings, jobs_doc: object, policy_paths: Sequence[str]
) -> list[Mistake]:
    """A warning for each ``restart_study`` whose ``max_retries`` differs from a job's
    ``optuna.max_retries`` (the smaller applies: not a mistake, maybe not what was meant);
    an unreadable policy file is a mistake."""
    managed = [j for j in settings.jobs if j.optuna is not None]
    if not managed or not policy_paths:
        return []
    from gpuwatchd.policy import action_names
    from gpuwatchd.policyfiles import load_policies

    name = action_names.RESTART_STUDY
    try:
        policies = load_policies(list(policy_paths))
    except PolicyError as exc:
        return [Mistake(exc.path or path, exc.line or 1, f"policies: {exc.message}")]
    out: list[Mistake] = []
    for policy in policies.policies:
        for action in policy.actions:
            if action.action != name or "max_retries" not in action.params:
                continue
            value = action.params["max_retries"]
            for job in managed:
                assert job.optuna is not None
                if value == job.optuna.max_retries:
                    continue
                spec = jobs_doc.get(job.name) if isinstance(jobs_doc, LocatedDict) else None
                optuna = spec.get("optuna") if isinstance(spec, LocatedDict) else None
                line = optuna.key_line("max_retries") if isinstance(optuna, LocatedDict) else 1
                effective = min(value, job.optuna.max_retries)
                out.append(
                    Mistake(
                        path,
                        line,
                        f"job {job.name!r}: optuna.max_retries is {job.optuna.max_retries} "
                        f"but policy {policy.name!r} ({action.source}) has {name} "
                        f"max_retries {value}: {effective} applies (the smaller; "
                        "docs/managed-jobs.md, Retries); make them equal to silence this",
                        warning=True,
                    )
                )
    return out
