"""Benchmark one daemon tick: 8 fake GPUs, 16 attached jobs, the default policies.

Prints the median and p90 microseconds per tick over N ticks (default 1000), the
share of one core that is at 1 Hz, and the daemon's RSS after those ticks.
Targets (issue 2): <= 2 ms per tick (<= 0.2 % of a core at 1 Hz), RSS <= 60 MB,
with neither torch nor optuna imported.

The only fake is NVML (gpuwatchd.testing); the host sampler reads the real
/proc for 16 real child processes standing in for the jobs, the policy
engine runs the packaged default.yaml, and the journal is a real SQLite file.

    python bench/tick.py [--ticks 1000] [--gpus 8] [--jobs 16]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuwatchd.config import Settings
from gpuwatchd.daemon import Daemon
from gpuwatchd.model import JobInfo, JobReport, Knob
from gpuwatchd.testing import FakeClock, FakeNvml, install_fake_nvml


def rss_bytes() -> int:
    """Resident set size of this process from /proc/self/status (VmRSS, proc(5))."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def make_jobs(pids: list[int], now_s: float) -> tuple[JobInfo, ...]:
    """16 attached jobs as the control server reports them, each with DataLoader knobs."""
    return tuple(
        JobInfo(
            name=f"job{i}",
            pid=pid,
            connected_at_s=now_s,
            cuda_devices=(str(i % 8),),
            knobs={
                "num_workers": Knob("num_workers", 4, 0, 64),
                "prefetch_factor": Knob("prefetch_factor", 2, 1, 64),
            },
            last_report=JobReport(
                timestamp_s=now_s,
                steps=100,
                epoch=1,
                step_time_s=0.05,
                data_wait_s=0.005,
                data_wait_fraction=0.1,
                samples_per_s=1280.0,
            ),
        )
        for i, pid in enumerate(pids)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ticks", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=16)
    args = parser.parse_args()

    children = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        for _ in range(args.jobs)
    ]
    state_dir = tempfile.mkdtemp(prefix="gpuwatchd-bench-")
    try:
        clock = FakeClock()
        fake = FakeNvml.h100s(args.gpus, utilization_pct=55.0, memory_used_bytes=40 * 2**30)
        with install_fake_nvml(fake):
            daemon = Daemon(Settings(devices="nvml", state_dir=state_dir), clock=clock)
            daemon.open_samplers()
            daemon.open_journal()  # the tick writes findings and decisions to SQLite
            jobs = make_jobs([c.pid for c in children], clock())
            durations_s = []
            for _ in range(args.ticks):
                clock.advance(1.0)
                started = time.perf_counter()
                daemon.tick(jobs)
                durations_s.append(time.perf_counter() - started)
            rss = rss_bytes()
    finally:
        for child in children:
            child.kill()
            child.wait()
        shutil.rmtree(state_dir, ignore_errors=True)

    durations_us = sorted(d * 1e6 for d in durations_s)
    median_us = statistics.median(durations_us)
    p90_us = durations_us[int(0.9 * len(durations_us))]
    heavy = [name for name in ("torch", "optuna") if name in sys.modules]
    print(f"tick: {args.gpus} fake GPUs, {args.jobs} jobs, default policies, {args.ticks} ticks")
    print(f"  median {median_us:.0f} us/tick, p90 {p90_us:.0f} us/tick (target <= 2000 us)")
    print(f"  at 1 Hz: {median_us / 1e6 * 100:.3f} % of one core (target <= 0.2 %)")
    print(f"  RSS after {args.ticks} ticks: {rss / 2**20:.1f} MiB (target <= 60 MB)")
    print(f"  heavy modules imported: {', '.join(heavy) or 'none'}")
    ok = median_us <= 2000 and rss <= 60e6 and not heavy
    print("  result: " + ("within targets" if ok else "OUTSIDE TARGETS"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
