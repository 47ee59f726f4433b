"""An NVML call that blocks in the driver (D-state; gpud PR 117) against the real daemon.

The daemon runs on FakeNvml (``gpuwatchd.testing.fakerun``) scripted so that GPU 1's
``nvmlDeviceGetUtilizationRates`` blocks for 6 s from its 5th sample on. What an operator
would check: ``gpuwatchctl status`` keeps ticking at its interval, shows GPU 1 stale with
the call's name while GPU 0 keeps fresh samples, the journal-bound log says so once, and
GPU 1 comes back by itself when the call returns.
"""

from __future__ import annotations

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
    daemon.wait_until(lambda: gpus(daemon)[1].get("stale") == CALL, what="GPU 1 stale")
    first = daemon.status()
    # the tick goes on while the call hangs: three more ticks (not a rate: a loaded host may
    # tick late) while GPU 1 is still stale, GPU 0 fresh in each
    during = daemon.wait_until(
        lambda: (s := daemon.status())["ticks"] >= first["ticks"] + 3 and s,
        timeout_s=BLOCK_S,
        what="three ticks during the blocked call",
    )
    gpu0, gpu1 = during["gpus"]
    assert gpu1["stale"] == CALL, during
    assert gpu0["stale"] is None and gpu0["timestamp_s"] > first["gpus"][0]["timestamp_s"]
    # the call returns: GPU 1 answers again without anyone doing anything
    daemon.wait_until(
        lambda: gpus(daemon)[1].get("stale") is None, timeout_s=BLOCK_S + 10, what="recovery"
    )
    events = daemon.events()
    stale = [e for e in events if e["event"] == "gpu.stale"]
    again = [e for e in events if e["event"] == "gpu.stale_cleared"]
    # GPU 1's blocked call is logged once; GPU 0 never for that call (a starved CPU may make
    # one of GPU 0's reads miss its deadline, logged as a plain "NVML call" and cleared)
    assert [e["gpu"] for e in stale if e["call"] == CALL] == [1]
    assert [e["gpu"] for e in again].count(1) == 1
    assert all(e["gpu"] == 1 or e["call"] != CALL for e in stale), stale
    assert gpus(daemon)[1]["utilization_gpu_pct"] == 40.0
