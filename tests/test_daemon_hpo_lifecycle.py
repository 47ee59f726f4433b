"""A managed job's lifecycle across daemon restarts and operator commands: a real
``gpuwatchd run --config`` on the fake NVML supervising the example Optuna worker
(``examples/hpo/worker.py``: PyTorch CPU trials, Optuna on SQLite)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import RunningDaemon, restart_on_same_state
from hpo_env import (
    TWO_EQUAL_GPUS,
    make_study,
    managed_workers,
    states,
    worker_command,
    write_config,
)

pytestmark = pytest.mark.slow


def _started(daemon: RunningDaemon) -> list[int]:
    return [e["pid"] for e in daemon.events() if e["event"] == "worker started"]


def test_a_finished_study_is_not_run_again_after_a_daemon_restart_until_job_start(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    url = make_study(tmp_path, "done")
    command = worker_command(url, "done", "--target", "4", "--steps", "5", "--step-time", "0")
    job = {"command": command, "cwd": str(tmp_path), "workers": 2, "gpus": "auto"}
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    first = run_daemon(script=TWO_EQUAL_GPUS, args=["--config", str(config)], name="first")
    first.wait_until(
        lambda: all(w["held"] == "finished" for w in managed_workers(first.status(), "hpo")),
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
