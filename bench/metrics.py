"""Benchmark the Prometheus endpoint at scale: a real ``gpuwatchd run --metrics-listen``
replaying 8 GPUs with 64 attached jobs reporting 4 times a second.

Prints, from one run, p50/p99 of a full scrape over HTTP (goal p99 < 10 ms) next to the
p50/p99 of a ``status`` request measured the same way, and the exposition's size.

    python bench/metrics.py [--scrapes 200] [--jobs 64]

The load generator shares the machine's cores with the daemon; on a busy machine the
times include waiting for a core.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import socket
import sys
import time
import urllib.request
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "bench_control", Path(__file__).with_name("control.py")
)
assert _spec is not None and _spec.loader is not None
control = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(control)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str) -> tuple[float, int]:
    began = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = reply.read()
    return time.perf_counter() - began, len(body)


def _pct(times: list[float], q: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


async def _measure(args: argparse.Namespace, sock: str, url: str) -> dict[str, float]:
    stop = asyncio.Event()
    jobs = [
        asyncio.create_task(control._job(sock, n, args.reports_per_s, stop))
        for n in range(args.jobs)
    ]
    await asyncio.sleep(2.0)  # attached, a few ticks with them
    loop = asyncio.get_running_loop()
    scrapes: list[float] = []
    size = 0
    for _ in range(args.scrapes):
        took, size = await loop.run_in_executor(None, _scrape, url)
        scrapes.append(took)
        await asyncio.sleep(0.05)
    status, status_size = await control._status_load(sock, 20.0, args.scrapes / 20.0)
    await asyncio.gather(*(control._finish(stop, job) for job in jobs))
    return {
        "scrape_p50": _pct(scrapes, 0.5),
        "scrape_p99": _pct(scrapes, 0.99),
        "size": size,
        "status_p50": _pct(status, 0.5),
        "status_p99": _pct(status, 0.99),
        "status_size": status_size,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--reports-per-s", type=float, default=4.0)
    args = parser.parse_args()
    port = _free_port()
    with control.replay_daemon(["--metrics-listen", f"127.0.0.1:{port}"], settle_s=1.0) as (
        sock,
        _daemon,
    ):
        figures = asyncio.run(_measure(args, sock, f"http://127.0.0.1:{port}/metrics"))
    print(f"daemon: replay of 8 GPUs ({control.TRACE.name}), {args.jobs} jobs attached")
    print(
        f"scrape: p50 {figures['scrape_p50'] * 1e3:.2f} ms, "
        f"p99 {figures['scrape_p99'] * 1e3:.2f} ms"
        f" over {args.scrapes} scrapes ({figures['size'] / 1024:.1f} KiB; goal p99 < 10 ms)"
    )
    print(
        f"status: p50 {figures['status_p50'] * 1e3:.2f} ms, "
        f"p99 {figures['status_p99'] * 1e3:.2f} ms"
        f" ({figures['status_size'] / 1024:.1f} KiB), same run"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
