"""The managed-job detectors (gpuwatchd.detectors.managed) on the supervisor's view of
each job: a given-up slot is an open finding until an operator starts it again, and a job
with no worker left while its work is unfinished is one of its own (issue 20, item 3)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import REPO, RunningDaemon
from gpuwatchd.detectors import DETECTORS
from gpuwatchd.model import ManagedJobState, Snapshot
from gpuwatchd.windows import Windows
from hpo_env import TWO_EQUAL_GPUS, managed_workers, write_config

FAILED = (0, "crash loop: died 5 times in a row without progress")


def _run(name: str, states: list[tuple[ManagedJobState, ...]], **params: object) -> list[list[str]]:
    detector = DETECTORS[name](DETECTORS[name].parse_params(params, _fail))
    windows = Windows()
    out = []
    for t, managed in enumerate(states):
        windows.observe(Snapshot(timestamp_s=float(t), gpus=(), host=None, managed=managed))
        out.append([f.message for f in detector.evaluate(windows)])
    return out


def _fail(key: str, message: str) -> None:
    raise AssertionError(f"{key}: {message}")


def test_a_given_up_slot_is_a_finding_until_it_runs_again() -> None:
    up = ManagedJobState("hpo", given_up=(FAILED,), live=2, slots=3)
    fixed = ManagedJobState("hpo", live=3, slots=3)
    seen = _run("worker_given_up", [(up,), (up,), (fixed,), (up,)])
    assert [len(m) for m in seen] == [1, 1, 0, 1]
    assert "job hpo: 1 worker slot(s) given up (worker 0: crash loop" in seen[0][0]


def test_for_delays_the_finding() -> None:
    up = ManagedJobState("hpo", given_up=(FAILED,), live=0, slots=1)
    seen = _run("worker_given_up", [(up,)] * 4, **{"for": "2s"})
    assert [len(m) for m in seen] == [0, 0, 1, 1]


def test_a_job_with_no_worker_left_and_no_finished_slot_is_stalled() -> None:
    stalled = ManagedJobState("hpo", given_up=(FAILED, (1, "budget")), live=0, slots=2)
    one_left = ManagedJobState("hpo", given_up=(FAILED,), live=1, slots=2)
    done = ManagedJobState("hpo", given_up=(FAILED,), live=0, finished=1, slots=2)
    seen = _run("job_stalled", [(stalled,), (one_left,), (done,), (stalled,)])
    assert [len(m) for m in seen] == [1, 0, 0, 1]
    assert seen[0] == ["job hpo: no worker left and its study is unfinished"]


@pytest.mark.slow
def test_a_given_up_job_is_an_open_finding_until_the_operator_starts_it(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    """A real ``gpuwatchd run`` with the shipped default policies: a worker that dies at
    once while its environment is broken is given up (crash loop), and ``status`` shows
    ``worker_given_up`` and ``job_stalled`` open on every tick, never silently; the
    operator fixes the cause and runs ``gpuwatchctl job start``: the findings clear."""
    broken = tmp_path / "broken"
    broken.write_text("")
    script = (
        "import os, sys, time\n"
        f"if os.path.exists({str(broken)!r}):\n"
        "    sys.exit('cannot read the data set')\n"
        "time.sleep(300)\n"
    )
    job = {
        "command": [sys.executable, "-c", script],
        "cwd": str(tmp_path),
        "workers": 1,
        "restart": {"backoff": "0.1s", "max_backoff": "0.1s", "crash_loop": 2},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    args = ["--config", str(config), "--policies", str(REPO / "policies" / "default.yaml")]
    daemon = run_daemon(script=TWO_EQUAL_GPUS, args=args)

    def open_findings() -> set[str]:
        return {f["detector"] for f in daemon.status()["findings"] if f["job"] == "hpo"}

    daemon.wait_until(
        lambda: {"worker_given_up", "job_stalled"} <= open_findings(),
        timeout_s=60,
        what="worker_given_up and job_stalled open",
    )
    (worker,) = managed_workers(daemon.status(), "hpo")
    assert worker["state"] == "failed" and worker["given_up"] is True
    assert "without progress" in worker["note"]
    ticks = daemon.status()["ticks"]
    daemon.wait_until(lambda: daemon.status()["ticks"] >= ticks + 2, what="two more ticks")
    # still open two ticks later: a state, not an event
    assert {"worker_given_up", "job_stalled"} <= open_findings()
    logged = [e for e in daemon.events() if e.get("policy") == "worker-given-up"]
    assert logged, "the default policy logged nothing"

    broken.unlink()
    result = daemon.ctl("job", "start", "hpo")
    assert result.returncode == 0, result.stderr
    daemon.wait_until(lambda: not open_findings(), timeout_s=30, what="the findings to clear")
    (worker,) = managed_workers(daemon.status(), "hpo")
    assert worker["state"] == "running" and worker["given_up"] is False
    assert daemon.stop() == 0
