"""A managed job's lifecycle across daemon restarts and operator commands: a real
``gpuwatchd run --config`` on the fake NVML supervising the example Optuna worker
(``examples/hpo/worker.py``: PyTorch CPU trials, Optuna on SQLite)."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, RunningDaemon, restart_on_same_state
from hpo_env import (
    LOG_CRASHES,
    TWO_EQUAL_GPUS,
    make_study,
    managed_workers,
    python_on_path,
    states,
    trials,
    worker_command,
    write_config,
)

pytestmark = pytest.mark.slow


def _journal(daemon: RunningDaemon) -> list[dict[str, Any]]:
    """``gpuwatchctl events --json -n 1000``: the journal's events."""
    result = daemon.ctl("--json", "events", "-n", "1000")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _started(daemon: RunningDaemon) -> list[int]:
    return [e["pid"] for e in daemon.events() if e["event"] == "worker started"]


def test_a_finished_study_is_not_run_again_after_a_daemon_restart_until_job_start(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    url = make_study(tmp_path, "done")
    # --head-min 10: out of the poisoned corner (a random head 9 crashes a worker)
    command = worker_command(
        url, "done", "--target", "4", "--steps", "5", "--step-time", "0", "--head-min", "10"
    )
    job = {"command": command, "cwd": str(tmp_path), "workers": 2, "gpus": "auto"}
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    first = run_daemon(script=TWO_EQUAL_GPUS, args=["--config", str(config)], name="first")
    first.wait_until(
        lambda: all(w["state"] == "stopped" for w in managed_workers(first.status(), "hpo")),
        timeout_s=120,
        what="both workers to finish the study",
    )
    finished = sum(states(url, "done").values())
    assert first.stop() == 0

    second = restart_on_same_state(
        run_daemon, first, ["--config", str(config)], script=TWO_EQUAL_GPUS
    )
    assert _started(second) == [], "a finished slot was relaunched by the next daemon"
    workers = managed_workers(second.status(), "hpo")
    held = [(w["state"], w["held"], w["pid"]) for w in workers]
    assert held == [("stopped", "finished", None)] * 2

    # An operator starts the job again (admin op): both slots run, find the study done.
    result = second.ctl("job", "start", "hpo")
    assert result.returncode == 0, result.stderr
    assert "2 started" in result.stdout
    second.wait_until(lambda: len(_started(second)) == 2, what="two workers started")
    second.wait_until(
        lambda: all(w["held"] == "finished" for w in managed_workers(second.status(), "hpo")),
        timeout_s=120,
        what="both workers to finish again",
    )
    assert sum(states(url, "done").values()) == finished  # the study was already done
    assert second.ctl("job", "start", "nope").returncode != 0
    assert second.stop() == 0


def test_a_worker_failing_at_start_on_its_environment_is_one_crash_and_not_restarted(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """``python train.py`` in a directory without ``train.py`` (a wrong ``cwd``): the
    crash says ``environment`` with CPython's line, once; the slot is failed, not looped
    through its restart budget."""
    workdir = tmp_path / "job"
    workdir.mkdir()
    job = {
        "command": ["python", "train.py", "--storage", "sqlite:///study.db"],
        "cwd": str(workdir),
        "workers": 1,
        "gpus": [0],
        "restart": {"backoff": "0.1s", "budget": 5},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"train": job})
    policies = tmp_path / "policies.yaml"
    policies.write_text(LOG_CRASHES)
    daemon = run_daemon(
        script=TWO_EQUAL_GPUS, args=["--config", str(config), "--policies", str(policies)]
    )
    (worker,) = daemon.wait_until(
        lambda: [w for w in managed_workers(daemon.status(), "train") if w["state"] == "failed"],
        what="the worker to fail",
    )
    assert worker["last_crash_kind"] == "environment"
    assert "can't open file" in worker["last_crash_reason"]
    assert "environment failure at start" in worker["note"]
    assert worker["restarts"] == 0
    # One finding for the one crash, journaled and shown by `gpuwatchctl events`.
    daemon.wait_until(
        lambda: [e for e in _journal(daemon) if e["kind"] == "finding_started"],
        what="the job_crashed finding",
    )
    crashed = [e for e in daemon.events() if e["event"] == "worker crashed"]
    assert len(crashed) == 1 and crashed[0]["kind"] == "environment"
    assert "can't open file" in crashed[0]["evidence"]
    findings = [e for e in _journal(daemon) if e["kind"] == "finding_started"]
    assert [f["detector"] for f in findings] == ["job_crashed"]
    assert _started(daemon) and len(_started(daemon)) == 1
    assert daemon.stop() == 0


def test_the_daemon_creates_the_study_before_the_workers_load_it(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """No pre-created study: three workers written as Optuna's examples with
    ``optuna.load_study`` and the storage on the command line (tests/optuna_worker.py)
    find the study the daemon created (``direction`` from the config)."""
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    command = [
        sys.executable,
        str(REPO / "tests" / "optuna_worker.py"),
        url,
        "fresh",
        "--trials",
        "2",
    ]
    job = {
        "command": command,
        "cwd": str(tmp_path),
        "workers": 3,
        "gpus": "auto",
        "optuna": {"storage": url, "study": "fresh", "direction": "maximize"},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"fresh": job})
    daemon = run_daemon(script=TWO_EQUAL_GPUS, args=["--config", str(config)])
    daemon.wait_until(
        lambda: all(w["held"] == "finished" for w in managed_workers(daemon.status(), "fresh")),
        timeout_s=120,
        what="three workers to finish",
    )
    assert states(url, "fresh") == {"COMPLETE": 6}
    assert not [e for e in daemon.events() if e["event"] == "worker crashed"]
    (ready,) = [e for e in daemon.events() if e["event"] == "study.ready"]
    assert ready["outcome"] == "created"
    import optuna

    study = optuna.load_study(study_name="fresh", storage=url)
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    assert daemon.stop() == 0


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_a_clean_exit_whose_detach_reached_no_daemon_is_not_a_crash(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """The daemon SIGKILLed while a worker runs; the worker finishes the study and exits
    with status 0 while no daemon listens (its hook's ``detach`` reaches no one); the
    daemon is started again. Its exit status cannot be read, but this launch printed no
    crash and its last trial is COMPLETE: a clean exit, held finished, no crash finding,
    nothing re-enqueued. Failed before the fix (``worker ended while gpuwatchd was
    down``, a ``job_crashed`` finding for a clean exit)."""
    url = make_study(tmp_path, "quiet")
    command = worker_command(
        url, "quiet", "--target", "3", "--steps", "20", "--step-time", "0.05", "--head-min", "10"
    )
    job = {
        "command": command,
        "cwd": str(tmp_path),
        "workers": 1,
        "gpus": "auto",
        "optuna": {"storage": url, "study": "quiet", "max_retries": 2},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    policies = tmp_path / "policies.yaml"
    policies.write_text(LOG_CRASHES)
    args = ["--config", str(config), "--policies", str(policies)]
    first = run_daemon(script=TWO_EQUAL_GPUS, args=args, name="first")
    (worker,) = first.wait_until(
        lambda: [
            w for w in managed_workers(first.status(), "hpo") if w["trial_number"] is not None
        ],
        timeout_s=60,
        what="the worker in its first trial",
    )
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=10)
    for _ in range(1200):  # the worker finishes the study alone (at most 2 minutes)
        if _gone(worker["pid"]):
            break
        time.sleep(0.1)
    assert _gone(worker["pid"]), "the worker did not finish the study"
    finished = states(url, "quiet")
    assert set(finished) <= {"COMPLETE", "PRUNED"} and sum(finished.values()) == 3, finished

    second = restart_on_same_state(run_daemon, first, args, script=TWO_EQUAL_GPUS)
    second.wait_until(
        lambda: [
            e
            for e in second.events()
            if e["event"] in ("worker exited", "worker ended while gpuwatchd was down")
            and e.get("pid") == worker["pid"]
        ],
        what="the worker's end seen by the next daemon",
    )
    events = second.events()
    assert not [e for e in events if e["event"] == "worker ended while gpuwatchd was down"]
    assert [e for e in events if e["event"] == "worker exited" and e["pid"] == worker["pid"]]
    workers = managed_workers(second.status(), "hpo")
    assert [(w["state"], w["held"], w["pid"]) for w in workers] == [("stopped", "finished", None)]
    assert _started(second) == []
    second.wait_until(lambda: second.status()["ticks"] >= 3, what="ticks that journal findings")
    assert not [e for e in _journal(second) if e["kind"] == "finding_started"]
    assert states(url, "quiet") == finished  # nothing failed, nothing re-enqueued
    assert second.stop() == 0


def test_an_operator_stops_a_running_job_across_a_restart_and_restarts_it(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """``gpuwatchctl job stop`` while trials run: the workers stop, the trials cut short
    are failed and re-enqueued, the slots stay stopped across a daemon restart;
    ``gpuwatchctl job restart`` starts them again and the retries run."""
    url = make_study(tmp_path, "ops")
    # --head-min 10: out of the poisoned corner; a random head 9 crashed a worker, which
    # was in restart backoff when the operator stopped the job ("1 stopped")
    command = worker_command(
        url, "ops", "--n-trials", "40", "--steps", "40", "--step-time", "0.05", "--head-min", "10"
    )
    command[0] = "python"  # from PATH, as users write it
    job = {
        "command": command,
        "env": python_on_path(),
        "cwd": str(tmp_path),
        "workers": 2,
        "gpus": "auto",
        "optuna": {"storage": url, "study": "ops", "max_retries": 1},
    }
    args = ["--config", str(write_config(tmp_path / "gpuwatchd.json", {"hpo": job}))]
    first = run_daemon(script=TWO_EQUAL_GPUS, args=args, name="first")
    first.wait_until(
        lambda: (
            sum(w["trial_number"] is not None for w in managed_workers(first.status(), "hpo")) == 2
        ),
        timeout_s=120,
        what="both workers in a trial",
    )
    stopped = first.ctl("job", "stop", "hpo")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == "job hpo: 2 stopped, 0 started"
    held = [(w["state"], w["held"]) for w in managed_workers(first.status(), "hpo")]
    assert held == [("stopped", "stopped by an operator")] * 2
    cut = [t for t in trials(url, "ops") if t.user_attrs.get("gpuwatchd:failed_reason")]
    assert [t.state.name for t in cut] == ["FAIL", "FAIL"]
    assert states(url, "ops").get("WAITING") == 2  # their retries
    assert first.stop() == 0

    second = restart_on_same_state(run_daemon, first, args, script=TWO_EQUAL_GPUS)
    assert _started(second) == [], "a slot an operator stopped was started by the next daemon"
    restarted = second.ctl("job", "restart", "hpo")
    assert restarted.returncode == 0, restarted.stderr
    assert restarted.stdout.strip() == "job hpo: 0 stopped, 2 started"
    second.wait_until(
        lambda: not states(url, "ops").get("WAITING"), timeout_s=120, what="the retries to run"
    )
    assert len(_started(second)) == 2
    assert second.stop() == 0
