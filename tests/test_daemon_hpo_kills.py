"""Worker deaths that are not the trial's own crash, and the one ``max_retries``: a real
``gpuwatchd run --config`` supervising the example Optuna worker
(``examples/hpo/worker.py``: PyTorch CPU trials, Optuna on SQLite)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import RunningDaemon
from hpo_env import (
    CRASHES,
    TWO_EQUAL_GPUS,
    make_study,
    managed_workers,
    restart_study_policy,
    trials,
    worker_command,
    write_config,
)

pytestmark = pytest.mark.slow


def _journal(daemon: RunningDaemon) -> list[dict[str, Any]]:
    result = daemon.ctl("--json", "events", "-n", "1000")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _done(daemon: RunningDaemon, job: str) -> bool:
    """Every worker of ``job`` has ended (its study reached the target)."""
    return all(w["state"] == "stopped" for w in managed_workers(daemon.status(), job))


def test_a_worker_sigkilled_from_outside_is_journaled_and_its_trial_retried(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    url = make_study(tmp_path, "kill")
    command = worker_command(
        url, "kill", "--target", "6", "--steps", "40", "--step-time", "0.05", "--head-min", "10"
    )
    job = {
        "command": command,
        "cwd": str(tmp_path),
        "workers": 2,
        "gpus": "auto",
        "optuna": {"storage": url, "study": "kill", "max_retries": 2},
        "restart": {"backoff": "0.2s"},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    policies = tmp_path / "policies.yaml"
    policies.write_text(restart_study_policy(2))
    daemon = run_daemon(
        script=TWO_EQUAL_GPUS, args=["--config", str(config), "--policies", str(policies)]
    )
    victim = daemon.wait_until(
        lambda: next(
            (w for w in managed_workers(daemon.status(), "hpo") if w["trial_number"] is not None),
            None,
        ),
        timeout_s=60,
        what="a worker in a trial",
    )
    running = {
        t.number
        for t in trials(url, "kill")
        if t.state.name == "RUNNING"
        and t.user_attrs.get("gpuwatchd:worker_id") == victim["worker_id"]
    }
    assert running == {victim["trial_number"]}, "jobs shows the trial the worker runs"
    os.kill(victim["pid"], signal.SIGKILL)
    daemon.wait_until(lambda: _done(daemon, "hpo"), timeout_s=180, what="the study to finish")

    # The death is a journal event (a job_crashed finding), shown by `gpuwatchctl events`.
    found = [
        e
        for e in _journal(daemon)
        if e["kind"] == "finding_started" and f"pid {victim['pid']} crashed" in e["message"]
    ]
    assert len(found) == 1 and found[0]["detector"] == "job_crashed"
    # Its trial was failed and retried (not the trial's fault), and the log says so.
    by_number = {t.number: t for t in trials(url, "kill")}
    killed = by_number[victim["trial_number"]]
    assert killed.state.name == "FAIL"
    assert killed.user_attrs["gpuwatchd:failed_reason"] == "killed"
    (retry,) = [
        t for t in by_number.values() if t.user_attrs.get("gpuwatchd:parent") == killed.number
    ]
    assert retry.user_attrs["gpuwatchd:retry_reason"] == "killed"
    assert retry.state.name == "COMPLETE"
    recovered = [
        e
        for e in daemon.events()
        if e["event"] == "crashed worker's trial recovered" and e["pid"] == victim["pid"]
    ]
    assert [e["outcome"] for e in recovered] == ["requeued"]
    assert not [e for e in daemon.events() if e.get("outcome") == "retries_exhausted"]
    (slot,) = [
        w for w in managed_workers(daemon.status(), "hpo") if w["worker"] == victim["worker"]
    ]
    assert slot["restarts"] == 1
    assert daemon.stop() == 0


def test_the_jobs_max_retries_caps_a_policys_restart_study(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """A trial that crashes every time (``head`` 9 < 10 classes: a device-side assert)
    with ``optuna.max_retries: 1`` and a policy's ``restart_study: {max_retries: 3}``:
    the job's setting wins (docs/managed-jobs.md, "Retries")."""
    import optuna

    url = make_study(tmp_path, "cap")
    study = optuna.load_study(study_name="cap", storage=url)
    study.enqueue_trial({"lr": 0.0123456, "hidden": 16, "head": 9})
    command = worker_command(
        url, "cap", "--target", "4", "--steps", "5", "--step-time", "0", "--faults", str(CRASHES)
    )
    job = {
        "command": command,
        "cwd": str(tmp_path),
        "workers": 1,
        "gpus": [0],
        "optuna": {"storage": url, "study": "cap", "max_retries": 1},
        "restart": {"backoff": "0.1s", "crash_loop": 10},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    policies = tmp_path / "policies.yaml"
    policies.write_text(restart_study_policy(3))
    daemon = run_daemon(
        script=TWO_EQUAL_GPUS, args=["--config", str(config), "--policies", str(policies)]
    )
    daemon.wait_until(lambda: _done(daemon, "hpo"), timeout_s=180, what="the study to finish")
    chain = [t for t in trials(url, "cap") if t.params.get("lr") == 0.0123456]
    assert [t.state.name for t in chain] == ["FAIL", "FAIL"]  # the trial and 1 retry
    assert chain[1].user_attrs["gpuwatchd:retry"] == 1
    assert daemon.stop() == 0
