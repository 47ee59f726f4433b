"""Benchmark the job hook's cost on the training thread: the same loop with and without it.

The hook is attached to a real ``gpuwatchd run --devices none`` subprocess on a temp
socket, so its background thread really reports (every 0.25 s) while the loop runs.
Each figure is the median over ``--runs`` runs; the runs with and without the hook are
interleaved, in one process, so that both see the same machine.

* ``loader``: ``for batch in watch.loader(...)`` against ``for batch in batches`` with
  no work per step: the hook's own cost per step (timing, record, stop check).
* ``1 ms step``: the same with a 1 ms busy step: the overhead as a share of the step.
* ``step()``: ``watch.step(fn, batch)`` against ``fn(batch)`` (no split, no backward):
  gradient-accumulation bookkeeping.

Targets (issue 4): <= 5 us per step and <= 1 % on a 1 ms step.

    python bench/hook.py [--steps 200000] [--ms-steps 2000] [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuwatchd.hook import Watch, attach

TARGET_US: float = 5.0
TARGET_PCT: float = 1.0


def spin(seconds: float) -> None:
    """Busy-wait ``seconds`` (a step that keeps the core busy, like compute does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def plain_loop(batches: list[Any], work: Callable[[], None] | None) -> float:
    started = time.perf_counter()
    for _batch in batches:
        if work is not None:
            work()
    return time.perf_counter() - started


def hooked_loop(watch: Watch, batches: list[Any], work: Callable[[], None] | None) -> float:
    loader = watch.loader(lambda knobs: batches)
    started = time.perf_counter()
    for _batch in loader:
        if work is not None:
            work()
    return time.perf_counter() - started


def start_daemon(directory: Path) -> subprocess.Popen[bytes]:
    socket_path = directory / "control.sock"
    daemon = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "gpuwatchd"),
            "run",
            "--socket",
            str(socket_path),
            "--state-dir",
            str(directory / "state"),
            "--devices",
            "none",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not socket_path.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("gpuwatchd did not start")
        time.sleep(0.05)
    return daemon


def main() -> int:
    """Run the benchmark and print the medians; exit status 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200_000, help="zero-work steps per run")
    parser.add_argument("--ms-steps", type=int, default=2_000, help="1 ms steps per run")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="gwbench-", dir="/tmp"))
    daemon = start_daemon(directory)
    try:
        knobs = {"num_workers": 0, "batch_size": 8}
        with attach(
            job="bench", knobs=knobs, socket=directory / "control.sock", report_interval_s=0.25
        ) as watch:
            if not watch.connected:
                raise SystemExit("the hook did not connect to gpuwatchd")
            batches = [("x", "y")] * args.steps
            ms_batches = [("x", "y")] * args.ms_steps
            hooked_loop(watch, batches[:10_000], None)  # warm up
            plain_loop(batches[:10_000], None)

            per_step_us: list[float] = []
            percent: list[float] = []
            step_us: list[float] = []
            plain_ms_s: list[float] = []
            for _ in range(args.runs):
                plain_s = plain_loop(batches, None)
                hooked_s = hooked_loop(watch, batches, None)
                per_step_us.append((hooked_s - plain_s) / args.steps * 1e6)

                one_ms = lambda: spin(0.001)  # noqa: E731
                plain_ms = plain_loop(ms_batches, one_ms)
                hooked_ms = hooked_loop(watch, ms_batches, one_ms)
                plain_ms_s.append(plain_ms)
                percent.append((hooked_ms - plain_ms) / plain_ms * 100)

                fn = lambda batch: None  # noqa: E731
                started = time.perf_counter()
                for batch in batches:
                    fn(batch)
                direct_s = time.perf_counter() - started
                started = time.perf_counter()
                for batch in batches:
                    watch.step(fn, batch)
                via_step_s = time.perf_counter() - started
                step_us.append((via_step_s - direct_s) / args.steps * 1e6)
            steps_recorded = watch.steps
    finally:
        daemon.terminate()
        daemon.wait(timeout=15)
        shutil.rmtree(directory, ignore_errors=True)

    loader_us = statistics.median(per_step_us)
    pct = statistics.median(percent)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"hook connected to gpuwatchd; {steps_recorded} steps recorded; runs={args.runs}")
    print(
        f"loader overhead per step : {loader_us:6.2f} us  (median; runs: "
        f"{', '.join(f'{v:.2f}' for v in per_step_us)})  target <= {TARGET_US} us  "
        f"{'OK' if loader_us <= TARGET_US else 'OVER'}"
    )
    print(
        f"overhead on a 1 ms step  : {pct:6.3f} %   (median; plain loop "
        f"{statistics.median(plain_ms_s) / args.ms_steps * 1e3:.3f} ms/step)  "
        f"target <= {TARGET_PCT} %  {'OK' if pct <= TARGET_PCT else 'OVER'}"
    )
    print(f"watch.step() bookkeeping : {statistics.median(step_us):6.2f} us per call (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
