"""Evidence belongs to one launch, and a clean exit stays clean across a daemon kill: a
real ``gpuwatchd run --config`` SIGKILLed while its workers end, then started again on
the same state (what systemd's restart does)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import RunningDaemon, restart_on_same_state
from hpo_env import CRASHES, TWO_EQUAL_GPUS, managed_workers, write_config

pytestmark = pytest.mark.slow

# The slot's first launch dies as PyTorch does on a device-side assert (its stderr stays
# in worker-0.err); the second attaches, waits for GATE, ends its block (a detach), then
# lingers until LINGER exists and exits 0 (the hook's exit line).
TWO_LAUNCHES = """\
import os, sys, time
from gpuwatchd.hook import attach

marker, gate, linger, recorded = sys.argv[1:5]
if not os.path.exists(marker):
    open(marker, "w").close()
    sys.stderr.write(open(recorded).read())
    sys.exit(1)
with attach():
    while not os.path.exists(gate):
        time.sleep(0.05)
while not os.path.exists(linger):
    time.sleep(0.05)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_a_clean_exit_during_a_daemon_kill_is_no_crash_and_old_stderr_is_no_evidence(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    script = tmp_path / "two_launches.py"
    script.write_text(TWO_LAUNCHES)
    recorded = CRASHES / "assert_runtimeerror_traceback.txt"

    def job(name: str) -> dict[str, object]:
        paths = [tmp_path / f"{name}.{p}" for p in ("marker", "gate", "linger")]
        argv = [sys.executable, str(script), *map(str, paths), str(recorded)]
        return {"command": argv, "workers": 1, "gpus": [0], "restart": {"backoff": "0.1s"}}

    config = write_config(tmp_path / "jobs.json", {"clean": job("clean"), "killed": job("killed")})
    first = run_daemon(script=TWO_EQUAL_GPUS, args=["--config", str(config)], name="first")

    def second_launch(name: str) -> int:
        def attached() -> int | None:
            (w,) = managed_workers(first.status(), name)
            hooked = {j["pid"] for j in first.status()["jobs"]}
            return w["pid"] if w["restarts"] == 1 and w["pid"] in hooked else None

        pid: int = first.wait_until(attached, what=f"{name}'s second launch attached")
        return pid

    pids = {name: second_launch(name) for name in ("clean", "killed")}
    crashed = [e for e in first.events() if e["event"] == "worker crashed"]
    assert sorted(e["kind"] for e in crashed) == ["cuda_assert", "cuda_assert"]

    # "clean" ends its block (a detach: not an exit), and the daemon is killed.
    (tmp_path / "clean.gate").write_text("")
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=10)
    # While no daemon watches: "clean" exits 0 (its hook's exit line in its stderr),
    # "killed" is SIGKILLed from outside.
    (tmp_path / "clean.linger").write_text("")
    os.kill(pids["killed"], signal.SIGKILL)
    for pid in pids.values():
        _wait_gone(pid)

    second = restart_on_same_state(
        run_daemon, first, ["--config", str(config)], script=TWO_EQUAL_GPUS
    )
    (clean,) = managed_workers(second.status(), "clean")
    assert (clean["state"], clean["held"], clean["last_crash_kind"]) == (
        "stopped",
        "finished",
        None,
    )
    gone = [e for e in second.events() if e["event"] == "worker ended while gpuwatchd was down"]
    # Only "killed" crashed, judged on its own launch's output: not the earlier assert.
    assert [(e["job"], e["kind"]) for e in gone] == [("killed", "other")]
    assert not [
        e for e in second.events() if e["event"] == "worker started" and e["job"] == "clean"
    ]
    assert second.stop() == 0
