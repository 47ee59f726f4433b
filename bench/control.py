"""Benchmark the control plane at scale (issue 24): ``gpuwatchd run --config ... --policies
...`` as users run it, replaying 8 GPUs (tests/data/traces), with 64 jobs attached over raw
sockets from a process of their own, each sending ``hello`` with a ``num_workers`` knob
and a ``report`` every 250 ms (and answering the daemon's ``set_knob``/``drain``/``stop``
as the hook does).

Prints, from one run:

* ``status`` round trip over a raw socket: p50/p99 over ``--status-per-s`` requests a
  second for ``--seconds`` (goal p99 < 2 ms), and the reply size, twice: with each job's
  reports at a phase of its own (independent jobs: each job's first report after a
  uniform random fraction of the period, seeded), then with all jobs reporting in the
  same instant (each burst of 64 reports holds the loop: the worst case); the tick's duration
  (its steps' time: the loop answers requests between them, and during the host's
  sample, taken in a worker thread; the 64 jobs share this script's pid, so that sample
  reads one process);
* daemon RSS from /proc (VmRSS) with the 64 jobs attached, and before (goal < 60 MiB);
* daemon CPU (% of one core) while it serves those status requests and 256 reports/s;
* ``gpuwatchctl status`` wall time as a user runs it, for the table and with ``--json``
  (median of ``--ctl-runs``; goal < 100 ms), beside ``python -c pass``, each with its
  CPU time (what a loaded host does not inflate);
* the load average (/proc/loadavg) before and after.

    python bench/control.py [--seconds 10] [--jobs 64] [--reports-per-s 4] [--status-per-s 100]

Everything runs on this machine, which is shared: the load generators (this process and
the jobs' process) share the CPUs with the daemon and whatever else runs, so the round
trips include waiting for a core; quote the load average with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "data" / "traces" / "h100x8_gpt350m_ckpt10_100ms.csv"
POLICIES = Path(__file__).resolve().parents[1] / "policies" / "default.yaml"
"""The shipped policies, what a fresh install runs."""
CONFIG = "interval: 1s\n"
"""The daemon's configuration file (everything else at its defaults)."""
BIN = Path(sys.executable).parent
REPORT = {
    "steps": 10,
    "epoch": 1,
    "step_time_s": 0.25,
    "data_wait_s": 0.05,
    "data_wait_fraction": 0.2,
    "samples_per_s": 512.0,
}

REPORT_JSON = json.dumps(REPORT, separators=(",", ":")).encode()
"""The report as every job sends it: encoded once (the jobs' process shares the cores
with the daemon; re-encoding it 256 times a second was its work, not the daemon's)."""


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _loadavg() -> str:
    """The 1, 5 and 15 minute load averages (/proc/loadavg)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _job(
    path: str, number: int, per_s: float, stop: asyncio.Event, phase_s: float = 0.0
) -> int:
    """One attached job over a raw socket: ``hello`` with a ``num_workers`` knob, then,
    after ``phase_s`` seconds, a ``report`` every ``1 / per_s`` seconds until ``stop``;
    answers the daemon's commands (``set_knob`` applied at once, ``drain``/``stop``
    acknowledged) as the hook does. Returns the reports sent; raises AssertionError on a
    refused hello or report."""
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
    answered = asyncio.create_task(_answer(reader, writer))
    sent = 0
    await asyncio.sleep(phase_s)
    try:
        while not stop.is_set() and not answered.done():
            sent += 1
            writer.write(b'{"id":%d,"op":"report","report":%s}\n' % (sent, REPORT_JSON))
            await asyncio.sleep(1 / per_s)
    finally:
        writer.close()
    answered.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await answered
    return sent


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read the daemon's lines for one job: replies to its reports must be ``ok``; its
    ``set_knob``/``drain``/``stop`` requests are answered as the hook answers them."""
    while line := await reader.readline():
        if b'"ok":true' in line[:64]:  # a reply's head: {"id":N,"ok":true,...
            continue
        message = json.loads(line)
        if "op" not in message:
            raise AssertionError(message)
        result: dict[str, object] = {}
        if message["op"] == "set_knob":
            result = {"knob": message["knob"], "value": message["value"]}
        reply = {"id": message["id"], "ok": True, "result": result}
        writer.write(json.dumps(reply).encode() + b"\n")


async def _status_load(
    path: str, per_s: float, seconds: float, tick_s: list[float] | None = None
) -> tuple[list[float], int]:
    """``status`` round trips in seconds, ``per_s`` a second for ``seconds``, and the last
    reply's size; every tenth reply's ``last_tick_duration_s`` goes to ``tick_s``."""
    reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
    times: list[float] = []
    refused: list[str] = []
    size = 0
    period = 1 / per_s
    start = time.perf_counter()
    for i in range(int(per_s * seconds)):
        began = time.perf_counter()
        writer.write(b'{"id":%d,"op":"status"}\n' % i)
        line = await reader.readline()
        times.append(time.perf_counter() - began)
        if b'"ok":true' not in line[:64]:  # the reply's head: {"id":N,"ok":...
            refused.append(json.loads(line)["error"]["code"])
        elif tick_s is not None and i % 10 == 0:
            tick_s.append(json.loads(line)["result"]["last_tick_duration_s"])
        size = len(line)
        next_at = start + (i + 1) * period
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    writer.close()
    if refused:
        print(f"status refused {len(refused)} times of {len(times)}: {sorted(set(refused))}")
    return times, size


def _run_jobs(
    path: str, jobs: int, per_s: float, stop: Any, sent: Any, in_step: bool = False
) -> None:
    """In a process of its own: ``jobs`` jobs reporting ``per_s`` times a second until
    ``stop`` (a multiprocessing Event) is set; puts the reports sent on ``sent``. Each
    job's reports start at a phase of its own (seeded uniform), or all at once with
    ``in_step``."""
    phases = random.Random(24)

    async def run() -> None:
        done = asyncio.Event()
        tasks = [
            asyncio.create_task(
                _job(path, n, per_s, done, 0.0 if in_step else phases.random() / per_s)
            )
            for n in range(jobs)
        ]
        while not stop.is_set():
            await asyncio.sleep(0.05)
        sent.put(sum(await asyncio.gather(*(_finish(done, task) for task in tasks))))

    asyncio.run(run())


@contextmanager
def attached_jobs(
    path: str, jobs: int, per_s: float, in_step: bool = False
) -> Iterator[tuple[Callable[[], int], int]]:
    """``jobs`` jobs attached to ``path`` from a separate process (so that their 256
    reports/s do not delay this process's ``status`` round trips), reporting at phases of
    their own or ``in_step``; yields a function that stops them and returns how many
    reports they sent, and that process's pid."""
    stop, sent = multiprocessing.Event(), multiprocessing.Queue()
    process = multiprocessing.Process(
        target=_run_jobs, args=(path, jobs, per_s, stop, sent, in_step)
    )
    process.start()
    counted: list[int] = []

    def finish() -> int:
        if not counted:
            stop.set()
            counted.append(sent.get(timeout=60))
            process.join(timeout=30)
        return counted[0]

    try:
        yield finish, process.pid
    finally:
        finish()


def _load(
    args: argparse.Namespace, path: str, pid: int, in_step: bool = False
) -> dict[str, float]:
    attached = time.monotonic()
    with attached_jobs(path, args.jobs, args.reports_per_s, in_step) as (finish, jobs_pid):
        time.sleep(2.0)  # all attached, a few ticks with them
        rss_jobs = _rss_mib(pid)
        cpu0, jobs_cpu0, wall0 = _cpu_s(pid), _cpu_s(jobs_pid), time.monotonic()
        tick_s: list[float] = []
        times, size = asyncio.run(_status_load(path, args.status_per_s, args.seconds, tick_s))
        cpu = (_cpu_s(pid) - cpu0) / (time.monotonic() - wall0)
        jobs_cpu = (_cpu_s(jobs_pid) - jobs_cpu0) / (time.monotonic() - wall0)
        reports_per_s = finish() / (time.monotonic() - attached)
    times.sort()
    return {
        "p50": times[len(times) // 2],
        "p99": times[int(len(times) * 0.99)],
        "n": len(times),
        "size": size,
        "rss_jobs": rss_jobs,
        "cpu": cpu,
        "jobs_cpu": jobs_cpu,
        "reports_per_s": reports_per_s,
        "tick_max": max(tick_s, default=float("nan")),
        "tick_median": statistics.median(tick_s) if tick_s else float("nan"),
    }


async def _finish(stop: asyncio.Event, job: asyncio.Task[int]) -> int:
    stop.set()
    return await job


def _ctl(socket_path: str, *args: str, runs: int) -> tuple[float, float]:
    """Median wall time and median CPU time (user + system, its own) in seconds of
    ``gpuwatchctl --socket PATH ARGS`` over ``runs`` runs, NaN (with the error printed)
    when any run fails. The CPU time does not count waiting for a core, the wall
    time on a loaded host mostly does."""
    times, cpu = [], []
    for _ in range(runs):
        began, used = time.perf_counter(), _children_cpu_s()
        done = subprocess.run(
            [str(BIN / "gpuwatchctl"), "--socket", socket_path, *args],
            capture_output=True,
            check=False,
        )
        times.append(time.perf_counter() - began)
        cpu.append(_children_cpu_s() - used)
        if done.returncode != 0:
            print(f"gpuwatchctl {' '.join(args)} failed: {done.stderr.decode().strip()}")
            return float("nan"), float("nan")
    return statistics.median(times), statistics.median(cpu)


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children (getrusage)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


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
        (work / "config.yaml").write_text(CONFIG)
        sock = str(work / "c.sock")
        command = [
            str(BIN / "gpuwatchd"), "run", "--config", str(work / "config.yaml"),
            "--policies", str(POLICIES),
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
    # as pip install does: with PYTHONDONTWRITEBYTECODE set, every gpuwatchctl run of an
    # editable checkout would compile its modules again (~8 ms CPU)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "gpuwatchd")], check=True)
    load_before = _loadavg()
    with replay_daemon(profile=args.profile) as (sock, daemon):
        rss_idle = _rss_mib(daemon.pid)
        ctl_empty = _ctl(sock, "status", runs=args.ctl_runs)
        figures = _load(args, sock, daemon.pid)
        burst = _load(args, sock, daemon.pid, in_step=True)
        # the jobs are gone again; attach them once more for the CLI figures
        ctl_table, ctl_json = _ctl_with_jobs(args, sock)
        runs = [_time([sys.executable, "-c", "pass"]) for _ in range(args.ctl_runs)]
        baseline = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    jobs = args.jobs
    print(
        f"daemon: gpuwatchd run --policies {POLICIES.name}, replay of 8 GPUs ({TRACE.name}), "
        f"{jobs} jobs x {args.reports_per_s:g} reports/s over raw sockets"
    )
    print(
        f"load average {load_before} before, {_loadavg()} after, on {os.cpu_count()} CPUs "
        "(a shared machine: other work competes for the cores)"
    )
    print(
        f"status round trip: p50 {figures['p50'] * 1e3:.2f} ms, p99 {figures['p99'] * 1e3:.2f} ms"
        f" over {figures['n']} requests at {args.status_per_s:g}/s "
        f"(reply {figures['size'] / 1024:.1f} KiB; goal p99 < 2 ms), the jobs' reports at "
        "phases of their own"
    )
    print(
        f"  with all {jobs} jobs reporting in the same instant: p50 {burst['p50'] * 1e3:.2f} ms,"
        f" p99 {burst['p99'] * 1e3:.2f} ms (each burst of {jobs} reports holds the loop)"
    )
    print(
        f"tick (its steps; the loop answers between them): median"
        f" {figures['tick_median'] * 1e3:.1f} ms, max {figures['tick_max'] * 1e3:.1f} ms"
        " of those seen in every tenth reply"
    )
    print(f"daemon RSS: {rss_idle:.1f} MiB idle, {figures['rss_jobs']:.1f} MiB with {jobs} jobs "
          "(goal < 60 MiB)")  # fmt: skip
    rate = figures["reports_per_s"]
    print(
        f"daemon CPU: {figures['cpu'] * 100:.1f} % of a core serving {args.status_per_s:g} "
        f"status/s and ~{rate:.0f} reports/s (the jobs' process: "
        f"{figures['jobs_cpu'] * 100:.1f} %)"
    )
    print(
        f"gpuwatchctl status wall time (CPU time): {ctl_empty[0] * 1e3:.0f} ms "
        f"({ctl_empty[1] * 1e3:.0f}) with no job, {ctl_table[0] * 1e3:.0f} ms "
        f"({ctl_table[1] * 1e3:.0f}) with {jobs} (table), {ctl_json[0] * 1e3:.0f} ms "
        f"({ctl_json[1] * 1e3:.0f}) --json; python -c pass {baseline[0] * 1e3:.0f} ms "
        f"({baseline[1] * 1e3:.0f}) (goal table < 100 ms)"
    )
    return 0


def _ctl_with_jobs(
    args: argparse.Namespace, sock: str
) -> tuple[tuple[float, float], tuple[float, float]]:
    with attached_jobs(sock, args.jobs, args.reports_per_s):
        time.sleep(1.5)
        table = _ctl(sock, "status", runs=args.ctl_runs)
        as_json = _ctl(sock, "--json", "status", runs=args.ctl_runs)
    return table, as_json


def _time(command: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of ``command`` (as :func:`_ctl` counts them)."""
    began, used = time.perf_counter(), _children_cpu_s()
    subprocess.run(command, check=True)
    return time.perf_counter() - began, _children_cpu_s() - used


if __name__ == "__main__":
    sys.exit(main())
