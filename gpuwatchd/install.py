"""``gpuwatchd install-unit``: install (or remove) the systemd unit, sysusers and tmpfiles files.

The files ship inside the package (``gpuwatchd/unitfiles/``, from the repository's
``systemd/``); ``ExecStart=`` is rewritten to the entry point of the installation that runs
this command (a venv under /opt, pipx, or the system). Specification: docs/systemd.md.
This command-line tool (not the daemon) runs systemd's own tools, hence its own
``subprocess`` import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuwatchd.errors import GpuwatchError

__all__ = ["InstallPlan", "entry_point", "install", "plan", "uninstall", "unit_text"]

UNIT_NAME = "gpuwatchd.service"
_PACKAGED = ("gpuwatchd.service", "gpuwatchd.sysusers", "gpuwatchd.tmpfiles")
_SHIPPED_EXEC_START = "ExecStart=/usr/bin/gpuwatchd run"


def unit_files_dir() -> Path:
    """``gpuwatchd/unitfiles/`` in an installed wheel, else the checkout's ``systemd/``."""
    package = Path(__file__).resolve().parent
    installed = package / "unitfiles"
    return installed if (installed / UNIT_NAME).is_file() else package.parent / "systemd"


def entry_point(executable: str | None = None) -> list[str]:
    """The argv that runs ``gpuwatchd`` of this installation.

    The ``gpuwatchd`` script in the scripts directory of the running interpreter's scheme
    (``/usr/local/bin`` for a system ``pip install``, ``<venv>/bin`` for a venv or pipx),
    else the one beside ``executable`` (default :data:`sys.executable`, unresolved: a
    venv's ``bin/python`` must stay the venv's), else ``[executable, "-m", "gpuwatchd"]``.
    """
    python = executable or sys.executable
    candidates = [Path(python).parent / "gpuwatchd"]
    if executable is None:
        candidates.insert(0, Path(sysconfig.get_path("scripts")) / "gpuwatchd")
    for script in candidates:
        if script.is_file() and os.access(script, os.X_OK):
            return [str(script)]
    return [python, "-m", "gpuwatchd"]


def _quote(arg: str) -> str:
    """One ExecStart= word (systemd.syntax(7) quoting); paths with spaces stay one word."""
    if arg and not any(c in arg for c in ' \t"\'\\$%;'):
        return arg
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("$", "$$").replace("%", "%%")
    return f'"{escaped}"'


def unit_text(exec_start: Sequence[str]) -> str:
    """The packaged gpuwatchd.service with ``ExecStart=`` set to ``exec_start`` + ``run``.

    Raises :class:`GpuwatchError` when the packaged unit lacks the ExecStart= line.
    """
    text = (unit_files_dir() / UNIT_NAME).read_text(encoding="utf-8")
    if _SHIPPED_EXEC_START not in text:
        raise GpuwatchError(f"the packaged {UNIT_NAME} has no {_SHIPPED_EXEC_START!r} line")
    line = "ExecStart=" + " ".join(_quote(a) for a in [*exec_start, "run"])
    return text.replace(_SHIPPED_EXEC_START, line, 1)


@dataclass(frozen=True)
class InstallPlan:
    """Where each file goes (under ``root``) and what it holds."""

    files: dict[Path, str]
    root: Path


def plan(root: Path = Path("/"), exec_start: Sequence[str] | None = None) -> InstallPlan:
    """The files install-unit writes: unit, sysusers.d and tmpfiles.d entries."""
    src = unit_files_dir()
    etc = root / "etc"
    files = {
        etc / "systemd" / "system" / UNIT_NAME: unit_text(exec_start or entry_point()),
        etc / "sysusers.d" / "gpuwatchd.conf": (src / "gpuwatchd.sysusers").read_text("utf-8"),
        etc / "tmpfiles.d" / "gpuwatchd.conf": (src / "gpuwatchd.tmpfiles").read_text("utf-8"),
    }
    return InstallPlan(files, root)


Runner = Callable[[Sequence[str]], None]


def run_tool(argv: Sequence[str]) -> None:
    """Run one of systemd's tools (argv, never a shell); raise GpuwatchError on failure."""
    if shutil.which(argv[0]) is None:
        raise GpuwatchError(f"{argv[0]} not found: is systemd installed?")
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip()
        raise GpuwatchError(f"{' '.join(argv)} exited {result.returncode}: {detail}")


def install(p: InstallPlan, activate: bool = True, runner: Runner = run_tool) -> list[str]:
    """Write the files (0644; parent directories 0755 as needed), then with ``activate``
    run systemd-sysusers, systemd-tmpfiles --create and systemctl daemon-reload.

    Returns what was done, one line each. Raises :class:`OSError` when a file cannot be
    written, :class:`GpuwatchError` when a tool fails.
    """
    done = []
    for path, text in p.files.items():
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o644)
        tmp.replace(path)
        done.append(f"wrote {path}")
    if activate:
        etc = p.root / "etc"
        steps = [
            ["systemd-sysusers", str(etc / "sysusers.d" / "gpuwatchd.conf")],
            ["systemd-tmpfiles", "--create", str(etc / "tmpfiles.d" / "gpuwatchd.conf")],
            ["systemctl", "daemon-reload"],
        ]
        for argv in steps:
            runner(argv)
            done.append("ran " + " ".join(argv))
    return done


def uninstall(p: InstallPlan, activate: bool = True, runner: Runner = run_tool) -> list[str]:
    """Stop and disable the unit (with ``activate``), remove the files, daemon-reload.

    Kept, as packages keep them: the groups, /var/lib/gpuwatchd, /etc/gpuwatchd and the
    administrator's drop-ins (gpuwatchd.service.d/).
    """
    done = []
    if activate:
        try:
            runner(["systemctl", "disable", "--now", UNIT_NAME])
            done.append(f"ran systemctl disable --now {UNIT_NAME}")
        except GpuwatchError as exc:
            done.append(f"not disabled ({exc})")
    for path in p.files:
        if path.exists():
            path.unlink()
            done.append(f"removed {path}")
    if activate:
        runner(["systemctl", "daemon-reload"])
        done.append("ran systemctl daemon-reload")
    return done
