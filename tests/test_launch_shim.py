"""The subprocess launcher with its launcher shim (gpuwatchd/jobs/launch.py,
gpuwatchd/jobs/exit_shim.py) under a real supervisor and real processes: the job's
environment reaches the worker exactly and never the shim, which runs as the daemon's
user; a launch cancelled while the shim starts the worker, or whose shim does not report
the worker's pid in time, leaves no worker running."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from gpuwatchd.config import JobConfig
from gpuwatchd.jobs import launch
from gpuwatchd.jobs.output import OutputFiles
from gpuwatchd.jobs.procfs import is_same_process
from gpuwatchd.jobs.supervisor import Supervisor
from job_fixture import make_job

ENVIRONS = r"""
import json, os, sys, time

def environ(pid):
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if e)

seen = {"worker": environ(os.getpid()), "shim": environ(os.getppid())}
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(seen, f)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


def _supervisor(tmp_path: Path, job: JobConfig, environ: dict[str, str]) -> Supervisor:
    return Supervisor(
        [job],
        state_dir=tmp_path / "state",
        socket_path=str(tmp_path / "gpuwatchd.sock"),
        environ=environ,
        gpus_expected=False,
        launcher="subprocess",
    )


def _processes_running(token: str) -> list[int]:
    """Live (not zombie) processes whose command line holds ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if token.encode() in cmdline and is_same_process(int(entry.name), None):
            found.append(int(entry.name))
    return found


def test_the_job_environment_reaches_the_worker_exactly_and_not_the_shim(
    tmp_path: Path,
) -> None:
    seen = tmp_path / "seen.json"
    job_env = {"LD_PRELOAD": "/nonexistent.so", "MARKER": "from-job"}
    job = JobConfig(
        name="hpo",
        command=(sys.executable, "-c", ENVIRONS, str(seen)),
        cwd=str(tmp_path),
        env=job_env,
        workers=1,
    )
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # C locale: Python coerces it
    sup = _supervisor(tmp_path, job, base)

    async def scenario() -> dict[str, dict[str, str]]:
        await sup.start()
        try:
            deadline = time.monotonic() + 30
            while not seen.exists():
                assert time.monotonic() < deadline, "the worker never wrote its environment"
                await asyncio.sleep(0.02)
            return dict(json.loads(seen.read_text()))
        finally:
            await sup.stop()

    environs = asyncio.run(scenario())
    worker = dict(environs["worker"])
    assert worker.pop("GPUWATCHD_WORKER_ID").startswith("hpo.0.")
    assert worker == {
        **base,
        **job_env,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "",
        "GPUWATCHD_JOB": "hpo",
        "GPUWATCHD_SOCKET": str(tmp_path / "gpuwatchd.sock"),
        "GPUWATCHD_WORKER": "0",
    }
    shim = environs["shim"]
    assert shim.get("LD_PRELOAD") != "/nonexistent.so"
    assert "MARKER" not in shim
    assert "GPUWATCHD_JOB" not in shim


def _wait_gone(token: str) -> list[int]:
    """Wait (10 s at most) until no live process holds ``token``; SIGKILL and return what
    is left (what a failing run left behind)."""
    deadline = time.monotonic() + 10  # SIGKILLed: gone once reaped by init
    while _processes_running(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _processes_running(token)
    for pid in left:
        os.kill(pid, 9)
    return left


def test_a_launch_cancelled_while_the_shim_starts_the_worker_leaves_no_worker(
    tmp_path: Path,
) -> None:
    token = f"gpuwatchd-test-{os.getpid()}-{time.monotonic_ns()}"
    job = JobConfig(
        name="hpo",
        command=(sys.executable, "-c", "import time, sys; time.sleep(60)", token),
        cwd=str(tmp_path),
        env={},
        workers=1,
    )
    sup = _supervisor(tmp_path, job, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    jobdir = tmp_path / "state" / "jobs" / "hpo"

    async def scenario() -> None:
        starting = asyncio.create_task(sup.start())
        deadline = time.monotonic() + 30
        while not list(jobdir.glob("exit-*.json")):  # the shim is being started
            assert time.monotonic() < deadline, "the launch never began"
            assert not starting.done(), "start() ended before the launch could be cancelled"
            await asyncio.sleep(0.001)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting

    asyncio.run(scenario())
    assert _wait_gone(token) == [], "a worker kept running with no daemon watching it"
    assert list(jobdir.glob("exit-*.json")) == []


def test_a_shim_that_does_not_report_in_time_is_killed_with_its_worker(tmp_path: Path) -> None:
    token = f"gpuwatchd-test-{os.getpid()}-{time.monotonic_ns()}"
    started = tmp_path / "started"
    script = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(60)"
    cfg = JobConfig(
        name="hpo",
        command=(sys.executable, "-c", script, str(started), token),
        cwd=str(tmp_path),
        env={},
        workers=1,
    )
    job = make_job(cfg, tmp_path, parallelism=1)
    files = OutputFiles(tmp_path, 0, max_bytes=2**20)
    spawned = launch.spawn(job, files, {"PATH": os.environ.get("PATH", "")}, tmp_path / "x")
    deadline = time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.02)
    with pytest.raises(OSError, match="did not start the worker within"):
        launch.read_worker_pid(spawned, timeout_s=0.0)  # as if the pid never came
    assert spawned.shim.returncode is not None
    assert _wait_gone(token) == [], "the worker outlived its killed shim"
