"""A hardware fault cordons a GPU in a real daemon (issue 22 acceptance): ``gpuwatchd run``
on the fake NVML (two GPUs; Xid 79 on GPU 1, raised once the worker placed there has
begun a trial) supervising the example Optuna worker (real PyTorch CPU trials, real
Optuna on SQLite). The default policies' Xid rule
cordons GPU 1; the worker placed there is stopped and relaunched on GPU 0, its trial
failed and re-enqueued; nothing is placed on GPU 1 again; the cordon is shown by
``gpuwatchctl status``, survives a daemon restart and is lifted by ``gpuwatchctl gpu
uncordon 1``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import TWO_GPUS, RunningDaemon, restart_on_same_state
from gpuwatchd.policyfiles import default_policy_path
from hpo_env import (
    TWO_EQUAL_GPUS,
    decisions,
    make_study,
    managed_workers,
    trials,
    worker_command,
    write_config,
)

pytestmark = pytest.mark.slow

WORKER_ID = "gpuwatchd:worker_id"
"""The user attr the hook tags each trial with: the launch id of the worker running it."""


def _script(xid_file: Path) -> dict[str, Any]:
    """Fake GPU 1 raises Xid 79 once ``xid_file`` exists: the test creates it when the
    worker placed there runs a trial (a sample count would presume how fast a loaded
    machine imports torch and starts the first trial)."""
    script: dict[str, Any] = json.loads(json.dumps(TWO_EQUAL_GPUS))
    script["devices"][1]["xids"] = [{"file_exists": str(xid_file), "xid": 79}]
    return script


def _worker_id_on_gpu(daemon: RunningDaemon, gpu: int) -> str:
    """The launch id of the running ``hpo`` worker placed on ``gpu`` ("" while none runs there)."""
    ids = [
        w["worker_id"]
        for w in managed_workers(daemon.status(), "hpo")
        if w["gpu"] == gpu and w["state"] == "running" and w["worker_id"]
    ]
    return ids[0] if len(ids) == 1 else ""


def _fresh_trials(url: str, worker_id: str) -> list[int]:
    """The RUNNING trials of launch ``worker_id`` (its hook tags each with the id as it
    starts) that have reported no intermediate value yet: most of their steps to go."""
    return [
        t.number
        for t in trials(url, "hpo")
        if t.state.name == "RUNNING"
        and t.user_attrs.get(WORKER_ID) == worker_id
        and not t.intermediate_values
    ]


def test_xid_79_cordons_the_gpu_and_moves_its_worker_with_its_trial_retried(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    url = make_study(tmp_path, "hpo")
    command = worker_command(
        url, "hpo", "--target", "8", "--steps", "20", "--step-time", "0.1", "--head-min", "10"
    )
    config = write_config(
        tmp_path / "gpuwatchd.json",
        {
            "hpo": {
                "command": command,
                "cwd": str(tmp_path),
                "workers": 2,
                "gpus": "auto",
                "optuna": {"storage": url, "study": "hpo", "max_retries": 2},
                "restart": {"backoff": "0.3s", "max_backoff": "1s"},
            }
        },
    )
    args = ["--config", str(config), "--policies", str(default_policy_path())]
    xid_file = tmp_path / "xid-79-on-gpu-1"
    daemon = run_daemon(script=_script(xid_file), args=args)
    state_dir = daemon.workdir / "state"

    # The Xid strikes while the worker on GPU 1 is early in a trial (however long torch
    # took to import): the stop lands in that trial, not after it.
    stopped_id = daemon.wait_until(
        lambda: _worker_id_on_gpu(daemon, 1), timeout_s=60, what="a worker on GPU 1"
    )
    daemon.wait_until(
        lambda: _fresh_trials(url, stopped_id),
        timeout_s=120,
        what="a trial of the worker on GPU 1 with most of its steps to go",
    )
    xid_file.touch()

    def cordoned() -> list[dict[str, Any]]:
        done = [
            d
            for d in decisions(state_dir)
            if d["action"] == "cordon_gpu" and d["outcome"] != "pending"
        ]
        return done

    (decision,) = daemon.wait_until(cordoned, timeout_s=60, what="the cordon_gpu outcome")
    assert decision["policy"] == "gpu-hardware-xid"
    assert decision["params"]["gpu_index"] == 1
    assert decision["outcome"] == "applied", decision
    assert "GPU 1 cordoned; relaunched elsewhere: hpo worker" in decision["detail"]
    assert "Xid 79" in decision["findings"][0]["message"]

    # The worker that ran on GPU 1 was stopped and placed again on GPU 0.
    events = daemon.wait_until(
        lambda: [e for e in daemon.events() if e["event"] == "worker placed"][2:],
        timeout_s=30,
        what="the relaunch's placement",
    )
    assert all(e["gpu"] == 0 for e in events), events
    workers = daemon.wait_until(
        lambda: (
            [w for w in managed_workers(daemon.status(), "hpo") if w["gpu"] == 1] == []
            and managed_workers(daemon.status(), "hpo")
        ),
        timeout_s=30,
        what="no worker on GPU 1",
    )
    assert {w["gpu"] for w in workers} == {0}
    status = daemon.status()
    assert [(c["index"], c["by"]) for c in status["cordons"]] == [(1, "policy gpu-hardware-xid")]
    table = daemon.ctl("status")
    assert "GPU 1 cordoned" in table.stdout

    # Its trial was failed and re-enqueued (stopped by gpuwatchd, not at fault).
    def retried() -> list[Any]:
        return [t for t in trials(url, "hpo") if t.user_attrs.get("gpuwatchd:retry_reason")]

    (retry,) = daemon.wait_until(retried, timeout_s=30, what="the stopped trial's retry")
    assert retry.user_attrs["gpuwatchd:retry_reason"] == "stopped"
    parent = {t.number: t for t in trials(url, "hpo")}[retry.user_attrs["gpuwatchd:parent"]]
    assert parent.state.name == "FAIL"
    assert parent.user_attrs[WORKER_ID] == stopped_id  # the trial of the worker on GPU 1

    # The Xid was found once: one cordon decision, one finding in the journal's events.
    assert len(cordoned()) == 1
    placed_on_1 = [e for e in daemon.events() if e["event"] == "worker placed" and e["gpu"] == 1]
    assert len(placed_on_1) == 1  # the first placement only, before the fault
    # Both workers stay on GPU 0 to the end of the study.
    daemon.wait_until(
        lambda: all(w["state"] == "stopped" for w in managed_workers(daemon.status(), "hpo")),
        timeout_s=120,
        what="the study to finish",
    )
    later_placements = [e["gpu"] for e in daemon.events() if e["event"] == "worker placed"][2:]
    assert later_placements and set(later_placements) == {0}
    daemon.stop()

    # The cordon survives a restart (here without jobs) and an operator lifts it.
    later = restart_on_same_state(run_daemon, daemon, ["--policies", str(default_policy_path())])
    assert [c["index"] for c in later.status()["cordons"]] == [1]
    lifted = later.ctl("gpu", "uncordon", "1")
    assert lifted.returncode == 0, lifted.stderr
    assert "GPU 1 uncordoned (cordoned by policy gpu-hardware-xid)" in lifted.stdout
    assert later.status()["cordons"] == []
    again = later.ctl("--json", "gpu", "cordon", "0")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["cordoned"] is True
    assert [c["index"] for c in later.status()["cordons"]] == [0]


def test_dry_run_decides_the_cordons_and_changes_nothing(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    """``--dry-run``: Xid 48 on GPU 0 and GPU 1 lost are found once each and their
    cordon_gpu decisions are journaled as dry runs; no GPU is cordoned."""
    script = json.loads(json.dumps(TWO_GPUS))
    script["devices"][0]["xids"] = [[3, 48]]
    script["devices"][1]["lost_from"] = 5
    args = ["--policies", str(default_policy_path()), "--dry-run"]
    daemon = run_daemon(script=script, args=args)
    state_dir = daemon.workdir / "state"

    def cordons() -> list[dict[str, Any]]:
        made = [d for d in decisions(state_dir) if d["action"] == "cordon_gpu"]
        return made if len(made) == 2 else []

    made = daemon.wait_until(cordons, timeout_s=30, what="two cordon_gpu decisions")
    assert {(d["policy"], d["params"]["gpu_index"]) for d in made} == {
        ("gpu-hardware-xid", 0),
        ("gpu-hardware-lost", 1),
    }
    assert all(d["dry_run"] and d["outcome"] == "dry-run" for d in made), made
    time.sleep(1.0)  # five more ticks: still one decision each (found once)
    assert len([d for d in decisions(state_dir) if d["action"] == "cordon_gpu"]) == 2
    status = daemon.status()
    assert status["cordons"] == []
    shown = [d for d in status["decisions"] if d["action"] == "cordon_gpu"]
    assert {d["outcome"] for d in shown} == {"dry-run"}
