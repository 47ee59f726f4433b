"""Placing managed workers when a GPU's first NVML read is late (issue 21).

Under CPU load (13-16 on 2 cores) GPU 1's first read missed the sampler's deadline
(50 ms at ``--interval 0.2``), the start-up sample had no memory reading for it, and
``gpus: auto`` put both workers on GPU 0. Here the daemon runs on FakeNvml scripted so
that GPU 1's first ``nvmlDeviceGetUtilizationRates`` (the first call of its first read)
takes 0.3 s; what an operator checks: the two workers of a ``gpus: auto`` job are on
the two equally free GPUs, each placed by free memory. A read that stays blocked longer
than the start-up's wait (``INITIAL_SAMPLE_WAIT_S``, 2 s) does not hold the start: the
GPU is logged ``gpu.stale`` and the worker placed before the call returns.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import RunningDaemon
from hpo_env import managed_workers, write_config

pytestmark = pytest.mark.slow

GIB = 2**30
CALL = "nvmlDeviceGetUtilizationRates"


def two_gpus(gpu1_late_s: float, gpu0_used_gib: int = 2) -> dict[str, Any]:
    """FakeNvml script: two H100s, GPU 1's first read blocked ``gpu1_late_s`` seconds."""
    return {
        "devices": [
            {
                "uuid": "GPU-00000000-0000-0000-0000-000000000000",
                "name": "NVIDIA H100 80GB HBM3",
                "memory_total_bytes": 80 * GIB,
                "series": {"utilization.gpu": [0.0], "memory.used": [gpu0_used_gib * GIB]},
            },
            {
                "uuid": "GPU-11111111-0000-0000-0000-000000000000",
                "name": "NVIDIA H100 80GB HBM3",
                "memory_total_bytes": 80 * GIB,
                "series": {"utilization.gpu": [0.0], "memory.used": [2 * GIB]},
                "block": {"call": CALL, "from_sample": 0, "seconds": gpu1_late_s},
            },
        ]
    }


def sleepy_job(tmp_path: Path, workers: int) -> list[str]:
    """``--config`` args of a ``gpus: auto`` job of ``workers`` sleeping workers."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    job = {"command": sleeper, "workers": workers, "gpus": "auto"}
    return ["--config", str(write_config(tmp_path / "gpuwatchd.json", {"sleepy": job}))]


def started(daemon: RunningDaemon, count: int) -> list[dict[str, Any]]:
    """The job's workers once ``count`` of them have a pid, else []."""
    workers = managed_workers(daemon.status(), "sleepy")
    return workers if len([w for w in workers if w["pid"]]) == count else []


def test_a_gpu_whose_first_read_is_late_still_gets_its_worker(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    daemon = run_daemon(script=two_gpus(gpu1_late_s=0.3), args=sleepy_job(tmp_path, 2))
    workers = daemon.wait_until(lambda: started(daemon, 2), what="both workers started")
    assert sorted(w["gpu"] for w in workers) == [0, 1], workers
    for worker in workers:
        assert "most free memory per worker" in worker["placement_reason"], worker
    assert daemon.stop() == 0


def test_a_gpu_whose_first_read_hangs_is_logged_stale_and_does_not_hold_the_start(
    run_daemon: Callable[..., RunningDaemon], tmp_path: Path
) -> None:
    # GPU 1 would be the better GPU (78 GiB free against 10) had it answered
    script = two_gpus(gpu1_late_s=5.0, gpu0_used_gib=70)
    daemon = run_daemon(script=script, args=sleepy_job(tmp_path, 1))
    (worker,) = daemon.wait_until(lambda: started(daemon, 1), what="the worker started")
    assert worker["gpu"] == 0 and "10.0 GiB free" in worker["placement_reason"], worker
    daemon.wait_until(
        lambda: any(e["event"] == "gpu.stale_cleared" for e in daemon.events()),
        what="GPU 1 answering again",
    )
    events = [(e["event"], e.get("gpu"), e.get("call")) for e in daemon.events()]
    stale = events.index(("gpu.stale", 1, CALL))
    placed = events.index(("worker placed", 0, None))
    cleared = events.index(("gpu.stale_cleared", 1, None))
    assert stale < placed < cleared, events
    assert daemon.stop() == 0
