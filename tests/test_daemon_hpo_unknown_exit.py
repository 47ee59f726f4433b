"""A worker that ends while no daemon watches it, its exit status unknown to the next
daemon (it was not that daemon's child): a real ``gpuwatchd run --config`` SIGKILLed
and started again on the same state, supervising a real Optuna worker
(``tests/optuna_worker.py --hook``: the hook's Optuna integration, SQLite storage given
on the command line, ``python`` from ``PATH``, ``n_trials`` per process).

The worker holds its last trial until the test releases it (or kills it), so the
daemon is killed while the trial runs and the worker's ``detach`` reaches no daemon,
deterministically. A clean exit is known only from its launch's evidence (the exit file
the launcher shim writes, ``gpuwatchd/jobs/exit_shim.py``; never presumed from the
study): the clean case is also test_daemon_hpo_lifecycle.py's (examples/hpo/worker.py);
here every side of the rule on one worker: exit 0 after its last trial COMPLETE is no
crash; ``raise SystemExit(3)`` at the top level after it is one (the hook's exit line,
written as if clean, is not read); a death inside that trial (still RUNNING) is one, and
its trial is retried; so is a death with the shim (the cgroup killed): nothing says how
it ended, so it died.
"""

from __future__ import annotations

import json
import os
import signal
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
    trials,
    write_config,
)

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "optuna_worker.py"


def _journal(daemon: RunningDaemon) -> list[dict[str, Any]]:
    """``gpuwatchctl --json events -n 1000``: the journal's events."""
    result = daemon.ctl("--json", "events", "-n", "1000")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _gone(pid: int) -> bool:
    """The process has ended (reaped, or a zombie of an init that has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _parent(pid: int) -> int:
    """The parent pid of ``pid`` (``/proc``): the launcher shim of a managed worker."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[1])


@pytest.mark.parametrize(
    "end", ["exits_cleanly", "exits_3_at_top_level", "killed_in_its_trial", "killed_with_its_shim"]
)
def test_a_worker_ending_while_the_daemon_is_down_is_judged_by_its_launch_and_the_study(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path, end: str
) -> None:
    url = make_study(tmp_path, "gone")
    mark, release = tmp_path / "held", tmp_path / "release"
    command = [
        "python", str(WORKER), url, "gone", "--trials", "2", "--hook",
        "--hold-at", "2", "--mark", str(mark), "--release", str(release),
    ]  # fmt: skip
    if end == "exits_3_at_top_level":
        command += ["--exit", "3"]
    job = {
        "command": command,
        "env": python_on_path(),
        "cwd": str(tmp_path),
        "workers": 1,
        "gpus": "auto",
        "optuna": {"storage": url, "study": "gone", "max_retries": 2},
        "restart": {"backoff": "0.2s"},
    }
    config = write_config(tmp_path / "gpuwatchd.json", {"hpo": job})
    policies = tmp_path / "policies.yaml"
    policies.write_text(LOG_CRASHES)
    args = ["--config", str(config), "--policies", str(policies)]
    first = run_daemon(script=TWO_EQUAL_GPUS, args=args, name="first")
    first.wait_until(mark.exists, timeout_s=120, what="the worker's second trial to hold")
    (worker,) = managed_workers(first.status(), "hpo")
    pid = worker["pid"]
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=10)
    shim = _parent(pid)
    assert shim != first.process.pid  # the worker runs under its launcher shim
    if end in ("exits_cleanly", "exits_3_at_top_level"):
        release.touch()  # the last trial completes; the process exits, no daemon listens
    else:
        if end == "killed_with_its_shim":  # as systemd kills a control group
            os.kill(shim, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)  # dies inside its trial
        release.touch()  # (a relaunched worker must not hold)
    _wait(lambda: _gone(pid), "the worker to end")

    second = restart_on_same_state(run_daemon, first, args, script=TWO_EQUAL_GPUS)

    def crashed() -> list[dict[str, Any]]:
        return [
            e
            for e in _journal(second)
            if e["kind"] == "finding_started" and f"pid {pid} crashed" in e["message"]
        ]

    # A crash found at start is journaled by the first ticks: let a few pass.
    second.wait_until(lambda: second.status()["ticks"] >= 5, what="five ticks")
    down = [e for e in second.events() if e["event"] == "worker ended while gpuwatchd was down"]
    if end == "exits_cleanly":
        # Not this daemon's child, but its shim's exit file says 0: a clean end, no crash.
        assert [t.state.name for t in trials(url, "gone")] == ["COMPLETE", "COMPLETE"]
        (slot,) = managed_workers(second.status(), "hpo")
        assert (slot["state"], slot["held"], slot["pid"]) == ("stopped", "finished", None)
        assert "exit file" in slot["note"], slot
        assert not crashed(), crashed()
        assert not [e for e in second.events() if e["event"] == "worker started"]
        assert not [e for e in second.events() if e["event"] == "worker crashed"]
    elif end == "exits_3_at_top_level":
        # Both trials COMPLETE and the hook wrote its exit line, yet the status was 3.
        assert [t.state.name for t in trials(url, "gone")][:2] == ["COMPLETE", "COMPLETE"]
        assert [(e["pid"], e["returncode"]) for e in down] == [(pid, 3)]
        assert len(crashed()) == 1
    else:
        # Its trial was left RUNNING: a crash (killed), journaled, the trial retried.
        returncode = None if end == "killed_with_its_shim" else -signal.SIGKILL
        assert [(e["pid"], e["returncode"]) for e in down] == [(pid, returncode)]
        assert len(crashed()) == 1
        second.wait_until(
            lambda: all(w["held"] == "finished" for w in managed_workers(second.status(), "hpo")),
            timeout_s=120,
            what="the relaunched worker to finish",
        )
        by_number = {t.number: t for t in trials(url, "gone")}
        assert by_number[1].state.name == "FAIL"
        assert by_number[1].user_attrs["gpuwatchd:failed_reason"] == "killed"
        retry = [t for t in by_number.values() if t.user_attrs.get("gpuwatchd:parent") == 1]
        assert [t.state.name for t in retry] == ["COMPLETE"]
        # enqueued before the relaunch (one trial left of its two) asked any trial
        assert [t.number for t in retry] == [2]
    assert second.stop() == 0
