"""Helpers of the managed-job tests (test_daemon_hpo.py, test_chaos.py); not a test module.

A real Optuna study on SQLite (or Optuna's JournalStorage on a file) in the test's temp
dir, a gpuwatchd config running ``examples/hpo/worker.py`` as a managed job (written as
JSON, which YAML reads as it is), and read-only looks at the daemon's journal and the study.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
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
    opened as Optuna's docs open a JournalStorage file, any other URL as it is."""
    import optuna

    if url.startswith("journal://"):
        backend = optuna.storages.journal.JournalFileBackend(url.removeprefix("journal://"))
        return optuna.storages.JournalStorage(backend)
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
