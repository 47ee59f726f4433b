"""An NVML call that blocks in the driver (D-state; gpud PR 117) against the real daemon.

The daemon runs on FakeNvml (``gpuwatchd.testing.fakerun``) scripted so that GPU 1's
``nvmlDeviceGetUtilizationRates`` blocks for 6 s from its 5th sample on. What an operator
would check: ``gpuwatchctl status`` keeps ticking at its interval, shows GPU 1 stale with
the call's name while GPU 0 keeps fresh samples, the journal-bound log says so once, and
GPU 1 comes back by itself when the call returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from conftest import RunningDaemon

BLOCK_S = 6.0
CALL = "nvmlDeviceGetUtilizationRates"

SCRIPT: dict[str, Any] = {
    "devices": [
        {
            "uuid": "GPU-00000000-0000-0000-0000-000000000000",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_bytes": 80 * 2**30,
            "series": {"utilization.gpu": [90.0]},
        },
        {
            "uuid": "GPU-11111111-1111-1111-1111-111111111111",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_bytes": 80 * 2**30,
            "series": {"utilization.gpu": [40.0]},
            "block": {"call": CALL, "from_sample": 5, "seconds": BLOCK_S},
        },
    ]
}


def gpus(daemon: RunningDaemon) -> list[dict[str, Any]]:
    return list(daemon.status()["gpus"])


@pytest.mark.slow
def test_a_blocked_nvml_call_marks_one_gpu_stale_and_the_tick_goes_on(
    run_daemon: Callable[..., RunningDaemon],
) -> None:
    daemon = run_daemon(script=SCRIPT)
    interval_s = float(daemon.status()["interval_s"])
    daemon.wait_until(lambda: gpus(daemon)[1].get("stale") == CALL, what="GPU 1 stale")
    first = daemon.status()
    started = time.monotonic()
    time.sleep(2.0)
    during = daemon.status()
    elapsed = time.monotonic() - started
    # the tick kept its interval while the call hung (at most one interval's slack)
    assert during["ticks"] - first["ticks"] >= elapsed / interval_s - 2, (first, during)
    assert during["last_tick_duration_s"] < interval_s
    gpu0, gpu1 = during["gpus"]
    assert gpu1["stale"] == CALL
    assert gpu0["stale"] is None and gpu0["timestamp_s"] > first["gpus"][0]["timestamp_s"]
    # the call returns: GPU 1 answers again without anyone doing anything
    daemon.wait_until(
        lambda: gpus(daemon)[1].get("stale") is None, timeout_s=BLOCK_S + 10, what="recovery"
    )
    events = daemon.events()
    stale = [e for e in events if e["event"] == "gpu.stale"]
    again = [e for e in events if e["event"] == "gpu.stale_cleared"]
    assert [(e["gpu"], e["call"]) for e in stale] == [(1, CALL)]
    assert [e["gpu"] for e in again] == [1]
    assert gpus(daemon)[1]["utilization_gpu_pct"] == 40.0
