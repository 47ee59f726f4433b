"""Helpers of the managed-job tests (test_daemon_hpo.py, test_chaos.py, test_chaos_kill.py and
the chaos variant of test_systemd_service.py); not a test module.

A real Optuna study on SQLite (or Optuna's JournalStorage on a file) in the test's temp
dir, a gpuwatchd config running ``examples/hpo/worker.py`` as a managed job (written as
JSON, which YAML reads as it is), and read-only looks at the daemon's journal and the study.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from conftest import REPO

WORKER = REPO / "examples" / "hpo" / "worker.py"
CRASHES = REPO / "tests" / "data" / "crashes"

TWO_EQUAL_GPUS: dict[str, Any] = {
    "devices": [
        {
            "uuid": f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-0000-0000-000000000000",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_bytes": 80 * 2**30,
            "series": {"utilization.gpu": [90.0], "memory.used": [2 * 2**30]},
        }
        for i in range(2)
    ]
}
"""Two idle-memory GPUs: ``gpus: auto`` spreads workers over both."""


LOG_CRASHES = """\
policies:
  - name: crashes-logged
    when:
      job_crashed: {kind: any}
    do:
      - log: {}
"""
"""A policy file that only logs every managed worker crash (a job_crashed finding each)."""


def restart_study_policy(max_retries: int = 2) -> str:
    """A policy file whose ``crashed-trials-restart`` re-enqueues the trial of a worker
    that died of a CUDA assert or OOM, at most ``max_retries`` times."""
    return (
        "policies:\n"
        "  - name: crashed-trials-restart\n"
        "    when:\n"
        "      job_crashed: {kind: [cuda_assert, cuda_oom]}\n"
        "    do:\n"
        f"      - restart_study: {{max_retries: {max_retries}}}\n"
    )


def optuna_storage(url: str) -> Any:
    """What a client passes to Optuna for the storage ``url``: a ``journal://PATH`` spec
    opened as Optuna's docs open a JournalStorage file; a SQLite URL as an RDBStorage that
    waits up to 30 s for the database's lock; any other URL as it is."""
    import optuna

    if url.startswith("journal://"):
        backend = optuna.storages.journal.JournalFileBackend(url.removeprefix("journal://"))
        return optuna.storages.JournalStorage(backend)
    if url.startswith("sqlite:"):
        # The test reads while workers and the daemon write: wait for SQLite's lock up to
        # 30 s, as Optuna's docs advise for concurrent SQLite (sqlite3's default 5 s was
        # exceeded once in a clean-clone CI's systemd kill-chaos run, seed 1, load ~3).
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 30}})
    return url


def make_study(
    directory: Path, name: str, storage: Literal["sqlite", "journal"] = "sqlite"
) -> str:
    """Create an empty Optuna study in ``directory/<name>.db`` (SQLite) or
    ``directory/<name>.log`` (a JournalStorage file); return its storage URL (spec)."""
    import optuna

    if storage == "journal":
        url = f"journal://{directory / (name + '.log')}"
    else:
        url = f"sqlite:///{directory / (name + '.db')}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(storage=optuna_storage(url), study_name=name, direction="minimize")
    return url


def worker_command(url: str, study: str, *args: str) -> list[str]:
    """The managed job's argv: the example worker on ``study`` with extra ``args``."""
    return [sys.executable, str(WORKER), "--storage", url, "--study", study, *args]


def python_on_path() -> dict[str, str]:
    """A job's ``env`` under which ``python`` on ``PATH`` is this test run's interpreter
    (the virtual environment's ``bin/`` first), as a user whose environment is activated
    writes ``command: [python, worker.py, ...]``."""
    bin_dir = str(Path(sys.executable).parent)
    return {"PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", os.defpath)])}


def write_config(path: Path, jobs: dict[str, dict[str, Any]], **settings: Any) -> Path:
    """Write a gpuwatchd config with ``jobs`` (JSON is YAML) to ``path``."""
    path.write_text(json.dumps({**settings, "jobs": jobs}, indent=1))
    return path


def one_assert_job(
    directory: Path, job: str = "hpo", storage: Literal["sqlite", "journal"] = "sqlite"
) -> tuple[str, Path]:
    """A managed Optuna job of one worker on a fresh study in ``directory`` (on
    ``storage``) whose worker dies once of a CUDA device-side assert (tests/data/crashes),
    then finishes 3 trials.

    Returns (the study's storage URL, the written config ``directory/gpuwatchd.json``)."""
    url = make_study(directory, job, storage)
    command = worker_command(
        url,
        job,
        "--target", "3",
        "--steps", "8",
        "--step-time", "0.01",
        "--faults", str(CRASHES),
        "--head-min", "10",
        "--fault-once", f"{directory / 'assert.once'}:assert",
    )  # fmt: skip
    config = write_config(
        directory / "gpuwatchd.json",
        {
            job: {
                "command": ["python", *command[1:]],
                "env": python_on_path(),
                "cwd": str(directory),
                "workers": 1,
                "optuna": {"storage": url, "study": job, "max_retries": 2},
                "restart": {"backoff": "0.3s", "max_backoff": "1s"},
            }
        },
    )
    return url, config


def trials(url: str, study: str) -> list[Any]:
    """Every trial of the study (Optuna ``FrozenTrial`` objects), by number."""
    import optuna

    loaded = optuna.load_study(study_name=study, storage=optuna_storage(url))
    return sorted(loaded.get_trials(deepcopy=False), key=lambda t: t.number)


def states(url: str, study: str) -> dict[str, int]:
    """Trial counts by Optuna state name."""
    counts: dict[str, int] = {}
    for trial in trials(url, study):
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    return counts


def decisions(state_dir: Path) -> list[dict[str, Any]]:
    """The journal's decisions (read-only), oldest first, params and findings decoded."""
    db = sqlite3.connect(f"file:{state_dir / 'journal.sqlite3'}?mode=ro", uri=True, timeout=5)
    try:
        rows = db.execute(
            "SELECT id, timestamp_s, policy, action, params, job, dry_run, findings, outcome, "
            "detail FROM decisions ORDER BY id"
        ).fetchall()
    finally:
        db.close()
    keys = ("id", "timestamp_s", "policy", "action", "params", "job", "dry_run", "findings")
    out = []
    for row in rows:
        entry = dict(zip(keys, row[:8], strict=True))
        entry["params"] = json.loads(entry["params"])
        entry["findings"] = json.loads(entry["findings"])
        entry["outcome"], entry["detail"] = row[8], row[9]
        out.append(entry)
    return out


def wait_until_stopped(daemon: Any, job: str, timeout_s: float = 120) -> None:
    """Wait until every worker of ``job`` is ``stopped`` (the study finished), as
    ``daemon.status()`` (a :class:`conftest.RunningDaemon`) shows them."""
    daemon.wait_until(
        lambda: all(w["state"] == "stopped" for w in managed_workers(daemon.status(), job)),
        timeout_s=timeout_s,
        what=f"every worker of {job} to stop (the study to finish)",
    )


def managed_workers(status: dict[str, Any], job: str) -> list[dict[str, Any]]:
    """The ``managed`` workers of ``job`` in a ``status --json`` reply."""
    for entry in status.get("managed", []):
        if entry["job"] == job:
            return list(entry["workers"])
    raise AssertionError(f"no managed job {job!r} in {status.get('managed')}")


# -- the kill-chaos tests (test_chaos_kill.py, test_systemd_service.py) ----------------------

CHAOS_WORKER = REPO / "tests" / "chaos_worker.py"
DEFAULT_CHAOS_SEED = 1


def chaos_seeds() -> list[int]:
    """The seeds of the kill-chaos tests: ``$GPUWATCHD_CHAOS_SEED`` as ``7``, ``1-10`` or
    ``1,4,9`` (one test per seed, in that order), default :data:`DEFAULT_CHAOS_SEED`."""
    spec = os.environ.get("GPUWATCHD_CHAOS_SEED", "").strip() or str(DEFAULT_CHAOS_SEED)
    seeds: list[int] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        seeds.extend(range(int(first), int(last or first) + 1))
    return seeds


def _chaos_seed_given() -> bool:
    """``$GPUWATCHD_CHAOS_SEED`` set: ``make test-long`` or a replay of a failure."""
    return bool(os.environ.get("GPUWATCHD_CHAOS_SEED", "").strip())


@dataclass(frozen=True)
class ChaosSize:
    """The size of a kill-chaos study: ``target`` COMPLETE trials; the trial paused in the
    ask/hook window drawn from ``pause`` (first, last trial number), the COMPLETE count at
    which the second kill lands drawn from ``kill`` (first, last)."""

    target: int
    pause: tuple[int, int]
    kill: tuple[int, int]

    def plan(self, seed: int) -> tuple[int, int]:
        """``(the trial number to pause, the COMPLETE count of the second kill)`` drawn
        from ``seed``: the same run for the same seed and size."""
        rng = random.Random(seed)
        return rng.randint(*self.pause), rng.randint(*self.kill)


def chaos_size(full: ChaosSize, small: ChaosSize) -> ChaosSize:
    """``full`` with ``$GPUWATCHD_CHAOS_SEED`` set (``make test-long``, a replay), else
    ``small`` (``make test``: seed 1 only), whose kill points are scaled to it so that
    both kills still happen, the first inside the ask/hook window."""
    return full if _chaos_seed_given() else small


def chaos_replay(seed: int, tests: str) -> str:
    """The command that runs ``tests`` again with ``seed`` at the size this run has."""
    given = f"GPUWATCHD_CHAOS_SEED={seed} " if _chaos_seed_given() else ""
    return f"{given}.venv/bin/python -m pytest -q {tests}"


def retry_parent(trial: Any) -> int | None:
    """The failed trial that ``trial`` retries: Optuna's ``retry_history`` (its last
    entry, as ``RetryFailedTrialCallback`` writes it) or gpuwatchd's ``gpuwatchd:parent``."""
    history = trial.system_attrs.get("retry_history") or []
    parent = history[-1] if history else trial.user_attrs.get("gpuwatchd:parent")
    return parent if isinstance(parent, int) else None


def retry_lineage(all_trials: list[Any]) -> tuple[dict[int, list[int]], dict[int, int]]:
    """``(failed trial -> the trials that retry it, trial -> the retries above it in its
    chain (0: an original trial))``, by :func:`retry_parent`."""
    by_number = {t.number: t for t in all_trials}
    children: dict[int, list[int]] = {}
    depth: dict[int, int] = {}
    for t in all_trials:
        parent = retry_parent(t)
        if parent is not None:
            children.setdefault(parent, []).append(t.number)
        n, seen = 0, {t.number}
        while parent is not None and parent in by_number and parent not in seen:
            n, seen = n + 1, seen | {parent}
            parent = retry_parent(by_number[parent])
        depth[t.number] = n
    return children, depth


def study_problems(all_trials: list[Any], target: int, max_retries: int) -> list[str]:
    """What a user of an unattended study finds wrong in it, one line each (empty: none):
    fewer than ``target`` COMPLETE trials, a trial left RUNNING or WAITING, a failure
    retried more than once, a chain of more than ``max_retries`` retries."""
    counts = Counter(t.state.name for t in all_trials)
    problems = []
    if counts["COMPLETE"] < target:
        problems.append(f"{counts['COMPLETE']} COMPLETE trials, the target is {target}")
    for state in ("RUNNING", "WAITING"):
        left = [t for t in all_trials if t.state.name == state]
        if left:
            problems.append(
                f"{len(left)} trial(s) left {state}: "
                + ", ".join(
                    f"#{t.number} (worker {t.user_attrs.get('gpuwatchd:worker_id', 'untagged')})"
                    for t in left
                )
            )
    children, depth = retry_lineage(all_trials)
    twice = {p: c for p, c in children.items() if len(c) > 1}
    if twice:
        problems.append(f"failures retried more than once (failed trial: its retries): {twice}")
    deep = {n: d for n, d in depth.items() if d > max_retries}
    if deep:
        problems.append(f"retry chains beyond max_retries={max_retries}: {deep}")
    return problems


def unretried_failures(all_trials: list[Any], max_retries: int) -> list[int]:
    """FAIL trials that nothing retried although their chain had room (not a failure of
    the chaos tests: e.g. a worker SIGKILLed from outside is taken for ``host_oom``, which
    their ``restart_study`` policy does not cover; said in their failure messages)."""
    children, depth = retry_lineage(all_trials)
    return [
        t.number
        for t in all_trials
        if t.state.name == "FAIL" and t.number not in children and depth[t.number] < max_retries
    ]


def describe_workers(workers: list[dict[str, Any]]) -> str:
    """One line per worker slot of a ``status --json`` reply: state, held, restarts, the
    last crash and the note, as ``gpuwatchctl jobs`` shows them."""
    return "\n".join(
        f"  worker {w['worker']}: {w['state']}"
        + (f" (held: {w['held']})" if w.get("held") else "")
        + f", pid {w['pid']}, {w['restarts']} restarts"
        + (f", last crash {w['last_crash_kind']}: {w['last_crash_reason']}"
           if w.get("last_crash_kind") else "")
        + (f", note: {w['note']}" if w.get("note") else "")
        for w in workers
    )  # fmt: skip


STORY: tuple[str, ...] = (
    "worker crashed",
    "worker ended while gpuwatchd was down",
    "worker exited",
    "worker failed",
    "worker adopted",
    "worker end handled",
    "worker.held",
    "worker.exit_presumed_clean",
    "restart budget exhausted",
    "stale trial sweep",
)
"""The daemon's log events that tell how a managed job's workers ended and what became
of their trials (for a failure message)."""


def brief_log(text: str, lines: int = 25, events: tuple[str, ...] | None = None) -> str:
    """The last ``lines`` JSON log lines of a daemon (its log file or ``journalctl -o
    cat``), only those whose event starts with one of ``events`` if given, as ``time
    event key=value ...``, without the level, logger and long paths."""
    out = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        stamp = str(entry.pop("timestamp", ""))[11:19]
        event = str(entry.pop("event", "?"))
        if events is not None and not event.startswith(events):
            continue
        for key in ("level", "logger", "path", "socket", "storage", "policies"):
            entry.pop(key, None)
        fields = " ".join(f"{k}={v}" for k, v in entry.items())
        out.append(f"  {stamp} {event} {fields}"[:300])
    return "\n".join(out[-lines:])


def settle(
    counts: Callable[[], Counter[str]],
    workers: Callable[[], list[dict[str, Any]] | None],
    target: int,
    *,
    until: float,
    stall_s: float,
    daemon_gone: Callable[[], str | None] = lambda: None,
    quiet_s: float = 12.0,
) -> str:
    """Wait until the study has ``target`` COMPLETE trials, none RUNNING or WAITING, and
    every worker has ended (``stopped``/``failed``), and that has held for ``quiet_s``
    (longer than the daemon's orphan sweep interval: a retry a policy enqueues just after
    the last worker ended is failed by the next sweep; the end state is what a user finds
    when they look): return ``"done"``. Give up earlier,
    saying why, when no worker runs and the study stays unchanged for ``stall_s`` (the
    stall a user finds), when ``time.monotonic()`` passes ``until`` (a bound on waiting),
    or when ``daemon_gone()`` says why the daemon is no more. ``workers()`` returns the
    job's workers of ``status --json``, None while the daemon does not answer."""
    last: tuple[Any, ...] = ()
    changed = time.monotonic()
    clean_since: float | None = None
    while True:
        now_counts = counts()
        slots = workers()
        live = [w["worker"] for w in slots or [] if w["state"] not in ("stopped", "failed")]
        idle = slots is not None and not live
        left = now_counts["RUNNING"] or now_counts["WAITING"]
        now = time.monotonic()
        if now_counts["COMPLETE"] >= target and idle and not left:
            clean_since = now if clean_since is None else clean_since
            if now - clean_since >= quiet_s:
                return "done"
        else:
            clean_since = None
        snapshot = tuple(sorted(now_counts.items()))
        if snapshot != last or not idle:
            last, changed = snapshot, now
        if now - changed > stall_s:
            return f"stalled: no worker running and the study unchanged for {stall_s:.0f} s"
        if now > until:
            return "the deadline passed"
        gone = daemon_gone()
        if gone:
            return gone
        time.sleep(0.5)


def chaos_report(
    *,
    header: str,
    kills: list[str],
    verdict: str,
    all_trials: list[Any],
    target: int,
    max_retries: int,
    workers: list[dict[str, Any]] | None,
    log: str,
) -> str:
    """A kill-chaos test's failure message: ``header`` (the seed and how to replay it), the
    kills, why waiting ended, the study's counts and problems, each worker slot, how the
    workers ended and the daemon's last lines (``log``: its JSON log lines, all daemons)."""
    return "\n".join([
        header,
        f"kills: {kills}",
        *([f"waiting ended: {verdict}"] if verdict else []),
        f"study: {dict(Counter(t.state.name for t in all_trials))} "
        f"({len(all_trials)} trials, target {target} COMPLETE)",
        *(f"  {p}" for p in study_problems(all_trials, target, max_retries)),
        f"  FAIL, not retried (not checked): {unretried_failures(all_trials, max_retries)}",
        "workers:",
        describe_workers(workers) if workers is not None else "  (the daemon does not answer)",
        "how the workers ended (the last 40 such log lines):",
        brief_log(log, 40, STORY),
        "the daemon's last log lines:",
        brief_log(log),
    ])  # fmt: skip
