"""The tick gives the event loop a turn between its steps (issue 24: a ``status`` must not
wait for a whole tick). A real in-process daemon (FakeNvml's eight H100s) serves its
control socket; a client sends ``status`` while the tick's GPU sample holds the loop (the
injected slow step), and the daemon answers it before the tick ends.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest


def test_a_status_sent_during_a_tick_is_answered_before_the_tick_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuwatchd.config import Settings
    from gpuwatchd.daemon import Daemon
    from gpuwatchd.testing import FakeNvml

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml.h100s(8, utilization_pct=3.0))
    path = tmp_path / "control.sock"
    daemon = Daemon(Settings(devices="nvml", state_dir=str(tmp_path / "state"), socket=str(path)))
    daemon.open_samplers()
    events: list[str] = []
    status_reply = daemon.status_reply

    def answering(**params: Any) -> Any:
        events.append("status answered")
        return status_reply(**params)

    monkeypatch.setattr(daemon, "status_reply", answering)

    async def scenario() -> list[dict[str, Any]]:
        await daemon.server.start()
        loop = asyncio.get_running_loop()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(str(path))
                file = conn.makefile("rwb")

                def send(request_id: int) -> None:
                    file.write(json.dumps({"id": request_id, "op": "status"}).encode() + b"\n")
                    file.flush()

                def read() -> dict[str, Any]:
                    reply: dict[str, Any] = json.loads(file.readline())
                    return reply

                send(1)
                first = await loop.run_in_executor(None, read)  # connected and served
                sampler: Any = daemon.ticker.gpu_sampler
                sample = sampler.sample

                def slow_sample(now_s: float) -> Any:  # holds the loop; a status arrives
                    events.append("tick sampling")
                    send(2)
                    return sample(now_s)

                monkeypatch.setattr(sampler, "sample", slow_sample)
                await daemon.ticker.tick_job()
                events.append("tick ended")
                second = await loop.run_in_executor(None, read)
                file.close()
                return [first, second]
        finally:
            await daemon.server.close()

    first, second = asyncio.run(scenario())
    assert events == ["status answered", "tick sampling", "status answered", "tick ended"]
    assert first["ok"] and second["ok"] and second["id"] == 2
    assert second["result"]["ticks"] == 0  # answered while the first tick was still running
    assert daemon.stats.ticks == 1
