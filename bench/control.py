"""Benchmark the control plane at scale: a real ``gpuwatchd run`` replaying 8 GPUs with 64
attached jobs, each reporting 4 times a second.

Prints, from one run:

* ``status`` round trip: p50/p99 over ``--status-per-s`` requests a second for
  ``--seconds`` (goal p99 < 2 ms), and the reply size;
* daemon RSS with the 64 jobs attached (and before they attach; goal < 60 MiB);
* daemon CPU (% of one core) while it serves those status requests and 256 reports/s;
* ``gpuwatchctl status`` wall time for the table and with ``--json`` (median of
  ``--ctl-runs``; goal < 100 ms), beside ``python -c pass``.

    python bench/control.py [--seconds 10] [--jobs 64] [--reports-per-s 4] [--status-per-s 100]

Everything runs on this machine: the load generator (this process) shares the CPU with
the daemon, so on a busy machine the round trips include waiting for a core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

TRACE = (
    Path(__file__).resolve().parents[1]
    / "tests"
    / "data"
    / "traces"
    / "h100x8_gpt350m_ckpt10_100ms.csv"
)
BIN = Path(sys.executable).parent
REPORT = {
    "steps": 10,
    "epoch": 1,
    "step_time_s": 0.25,
    "data_wait_s": 0.05,
    "data_wait_fraction": 0.2,
    "samples_per_s": 512.0,
}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _job(path: str, number: int, per_s: float, stop: asyncio.Event) -> int:
    reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
    hello = {
        "id": 0,
        "op": "hello",
        "role": "job",
        "job": f"bench-{number:02d}",
        "pid": os.getpid(),
        "cuda_devices": [str(number % 8)],
        "knobs": {
            "num_workers": {"value": 4, "min": 0, "max": 16},
            "prefetch_factor": {"value": 2, "min": 1, "max": 8},
            "persistent_workers": {"value": True},
        },
        "study": "bench",
        "trial": {"number": number, "params": {"lr": 0.001}},
    }
    writer.write(json.dumps(hello).encode() + b"\n")
    assert json.loads(await reader.readline())["ok"], "hello refused"
    sent = 0
    while not stop.is_set():
        sent += 1
        writer.write(json.dumps({"id": sent, "op": "report", "report": REPORT}).encode() + b"\n")
        reply = json.loads(await reader.readline())
        assert reply["ok"], reply
        await asyncio.sleep(1 / per_s)
    writer.close()
    return sent


async def _status_load(path: str, per_s: float, seconds: float) -> tuple[list[float], int]:
    reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
    times: list[float] = []
    size = 0
    period = 1 / per_s
    start = time.perf_counter()
    for i in range(int(per_s * seconds)):
        began = time.perf_counter()
        writer.write(b'{"id":%d,"op":"status"}\n' % i)
        line = await reader.readline()
        times.append(time.perf_counter() - began)
        size = len(line)
        next_at = start + (i + 1) * period
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    writer.close()
    return times, size


async def _load(args: argparse.Namespace, path: str, pid: int) -> dict[str, float]:
    stop = asyncio.Event()
    jobs = [asyncio.create_task(_job(path, n, args.reports_per_s, stop)) for n in range(args.jobs)]
    await asyncio.sleep(2.0)  # all attached, a few ticks with them
    rss_jobs = _rss_mib(pid)
    cpu0, wall0 = _cpu_s(pid), time.monotonic()
    times, size = await _status_load(path, args.status_per_s, args.seconds)
    cpu = (_cpu_s(pid) - cpu0) / (time.monotonic() - wall0)
    reports = sum(await asyncio.gather(*(_finish(stop, job) for job in jobs)))
    times.sort()
    return {
        "p50": times[len(times) // 2],
        "p99": times[int(len(times) * 0.99)],
        "n": len(times),
        "size": size,
        "rss_jobs": rss_jobs,
        "cpu": cpu,
        "reports": reports,
    }


async def _finish(stop: asyncio.Event, job: asyncio.Task[int]) -> int:
    stop.set()
    return await job


def _ctl(socket_path: str, *args: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        done = subprocess.run(
            [str(BIN / "gpuwatchctl"), "--socket", socket_path, *args],
            capture_output=True,
            check=False,
        )
        times.append(time.perf_counter() - began)
        assert done.returncode == 0, done.stderr
    return statistics.median(times)


@contextmanager
def replay_daemon(
    extra: Sequence[str] = (), profile: str | None = None, settle_s: float = 2.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real ``gpuwatchd run`` replaying :data:`TRACE` in a temporary directory.

    Args: ``extra`` flags appended to ``gpuwatchd run``; ``profile`` runs it under
    cProfile into that file; ``settle_s`` seconds waited once its socket exists.
    Yields (control socket path, the daemon's process); terminates it on exit.
    Raises: AssertionError when no socket appears within 30 s or the daemon exits.
    """
    with tempfile.TemporaryDirectory(prefix="gwbench-") as tmp:
        work = Path(tmp)
        (work / "config.yaml").write_text("{}\n")
        sock = str(work / "c.sock")
        command = [
            str(BIN / "gpuwatchd"), "run", "--config", str(work / "config.yaml"),
            "--devices", f"replay:{TRACE}", "--socket", sock, "--state-dir", str(work / "state"),
            "--log-format", "json", "--log-level", "warning", *extra,
        ]  # fmt: skip
        if profile:
            command[:1] = [sys.executable, "-m", "cProfile", "-o", profile, "-m", "gpuwatchd"]
        with (work / "daemon.log").open("wb") as log:
            daemon = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while not Path(sock).exists():
                assert time.monotonic() < deadline and daemon.poll() is None, "no daemon"
                time.sleep(0.1)
            time.sleep(settle_s)
            yield sock, daemon
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--reports-per-s", type=float, default=4.0)
    parser.add_argument("--status-per-s", type=float, default=100.0)
    parser.add_argument("--ctl-runs", type=int, default=7)
    parser.add_argument("--profile", metavar="FILE", help="run the daemon under cProfile into FILE")
    args = parser.parse_args()
    with replay_daemon(profile=args.profile) as (sock, daemon):
        rss_idle = _rss_mib(daemon.pid)
        ctl_empty = _ctl(sock, "status", runs=args.ctl_runs)
        figures = asyncio.run(_load(args, sock, daemon.pid))
        # the jobs are gone again; attach them once more for the CLI figures
        ctl_table, ctl_json = asyncio.run(_ctl_with_jobs(args, sock))
        baseline = statistics.median(
            _time([sys.executable, "-c", "pass"]) for _ in range(args.ctl_runs)
        )
    jobs = args.jobs
    print(
        f"daemon: replay of 8 GPUs ({TRACE.name}), {jobs} jobs x {args.reports_per_s:g} reports/s"
    )
    print(
        f"status round trip: p50 {figures['p50'] * 1e3:.2f} ms, p99 {figures['p99'] * 1e3:.2f} ms"
        f" over {figures['n']} requests at {args.status_per_s:g}/s "
        f"(reply {figures['size'] / 1024:.1f} KiB; goal p99 < 2 ms)"
    )
    print(f"daemon RSS: {rss_idle:.1f} MiB idle, {figures['rss_jobs']:.1f} MiB with {jobs} jobs "
          "(goal < 60 MiB)")  # fmt: skip
    rate = figures["reports"] / (args.seconds + 2.0)
    print(
        f"daemon CPU: {figures['cpu'] * 100:.1f} % of a core serving {args.status_per_s:g} "
        f"status/s and ~{rate:.0f} reports/s"
    )
    print(
        f"gpuwatchctl status: {ctl_empty * 1e3:.0f} ms with no job, {ctl_table * 1e3:.0f} ms "
        f"with {jobs} (table), {ctl_json * 1e3:.0f} ms --json; python -c pass "
        f"{baseline * 1e3:.0f} ms (goal table < 100 ms)"
    )
    return 0


async def _ctl_with_jobs(args: argparse.Namespace, sock: str) -> tuple[float, float]:
    stop = asyncio.Event()
    jobs = [asyncio.create_task(_job(sock, n, args.reports_per_s, stop)) for n in range(args.jobs)]
    await asyncio.sleep(1.5)
    loop = asyncio.get_running_loop()
    table = await loop.run_in_executor(None, lambda: _ctl(sock, "status", runs=args.ctl_runs))
    as_json = await loop.run_in_executor(
        None, lambda: _ctl(sock, "--json", "status", runs=args.ctl_runs)
    )
    await asyncio.gather(*(_finish(stop, job) for job in jobs))
    return table, as_json


def _time(command: list[str]) -> float:
    began = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - began


if __name__ == "__main__":
    sys.exit(main())
