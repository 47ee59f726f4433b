"""Benchmark `gpuwatchd replay`: GPU-samples per second through detectors and policies.

Replays the real 8 x H100 trace (tests/data/traces, 5,449 samples x 8 GPUs = 43,592
GPU-samples) repeated back to back until at least ``--samples`` GPU-samples (default
1,000,000; each copy shifted in time to follow the previous one) through
:func:`gpuwatchd.backtest.run_backtest` with the packaged default policies, and
prints, as medians of ``--runs`` runs (default 3), in one run of this script:

* parse: ``parse_trace`` of the file, seconds and GPU-samples/s;
* engine, steps: a ``PolicyEngine.step`` per frame + finding start/clear tracking
  (``engine="steps"``), wall seconds, GPU-samples/s and CPU time;
* engine, arrays: the same trace as TraceColumns through ``engine="arrays"``
  (gpuwatchd/backtest_arrays.py), and the ratio to steps; both must give the same
  events (checked here too);
* step only: ``PolicyEngine.step`` alone over the same snapshots.

Then ``gpuwatchd replay`` end to end, as a user runs it, on a day of 8 GPUs at 1 Hz
(691,200 GPU-samples; issue 13's goal: 1,000,000 GPU-samples/s), with the load
average of the machine before it (other work inflates wall times).

Target (issue 3): >= 200,000 GPU-samples/s through the engine, i.e. a day of 8 GPUs at
1 Hz (691,200 GPU-samples) in under 4 s. ``--profile`` prints where one steps run
spends its time (cProfile, by own time).

    python bench/replay.py [--samples 1000000] [--runs 3] [--policies PATH] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuwatchd.backtest import run_backtest
from gpuwatchd.model import Snapshot
from gpuwatchd.policy.engine import PolicyEngine
from gpuwatchd.policy.schema import PolicySet
from gpuwatchd.policyfiles import default_policy_path, load_policies
from gpuwatchd.sampling.columns import TraceColumns
from gpuwatchd.sampling.replay import Frame, Trace, parse_trace

TRACE = (
    Path(__file__).resolve().parents[1]
    / "tests"
    / "data"
    / "traces"
    / "h100x8_gpt350m_ckpt10_100ms.csv"
)
TARGET_PER_S = 200_000


def repeat(trace: Trace, min_samples: int) -> Trace:
    """``trace`` played back to back until it holds ``min_samples`` GPU-samples.

    Copy ``k`` is shifted by ``k * (duration + 0.1 s)``. Only the frames are re-stamped:
    the windows stamp every sample with the snapshot's time, not the sample's own.
    """
    per_copy = len(trace.frames) * trace.gpu_count
    copies = max(1, -(-min_samples // per_copy))
    period = trace.duration_s + 0.1
    frames = tuple(
        Frame(frame.timestamp_s + k * period, frame.samples)
        for k in range(copies)
        for frame in trace.frames
    )
    return Trace(trace.path, trace.gpu_count, frames)


def step_only(trace: Trace, policies: PolicySet) -> float:
    """Seconds for ``PolicyEngine.step`` over every frame, nothing else timed."""
    engine = PolicyEngine(policies, max_gap_s=10.0)
    status = f"replay: {trace.path}"
    snapshots = [Snapshot(f.timestamp_s, f.samples, None, (), status) for f in trace.frames]
    step = engine.step
    began = time.perf_counter()
    for snapshot in snapshots:
        step(snapshot)
    return time.perf_counter() - began


def write_day(source: Path, out: Path, gpus: int = 8) -> int:
    """Write a day of ``gpus`` GPUs sampled at 1 Hz as nvidia-smi logs it (rows of the
    GPUs interleaved 2 ms apart, no index column), cycling through the real samples of
    ``source`` (every 10th frame of a 100 ms trace). Returns the GPU-samples written."""
    trace = parse_trace(source)
    frames = trace.frames[::10]
    start = 1_753_574_400  # 2025-07-27 00:00:00 UTC
    with out.open("w") as handle:
        handle.write("timestamp, power.draw [W], utilization.gpu [%], memory.used [MiB]\n")
        for second in range(86_400):
            frame = frames[second % len(frames)]
            day = time.strftime("%Y/%m/%d %H:%M:%S", time.gmtime(start + second))
            for gpu in range(gpus):
                sample = frame.samples[gpu % trace.gpu_count]
                used = int(sample.memory_used_bytes) // 2**20  # type: ignore[call-overload]
                handle.write(
                    f"{day}.{2 * gpu:03d}, {sample.power_draw_w:.2f} W, "
                    f"{sample.utilization_gpu_pct:.0f} %, {used} MiB\n"
                )
    return 86_400 * gpus


def end_to_end(source: Path, runs: int) -> None:
    """``gpuwatchd replay DAY.csv --json`` as a user runs it, on a day of 8 GPUs at 1 Hz."""
    with tempfile.TemporaryDirectory(prefix="gwreplay-") as tmp:
        day = Path(tmp) / "day-8gpus-1hz.csv"
        samples = write_day(source, day)
        command = [str(Path(sys.executable).parent / "gpuwatchd"), "replay", str(day), "--json"]
        walls, parses, engines = [], [], []
        load = os.getloadavg()[0]
        for _ in range(runs):
            began = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            walls.append(time.perf_counter() - began)
            summary = json.loads(done.stdout.splitlines()[-1])
            parses.append(summary["parse_s"])
            engines.append(summary["engine_s"])
    wall = statistics.median(walls)
    print(
        f"gpuwatchd replay (end to end, a day of 8 GPUs at 1 Hz, {samples:,} GPU-samples; "
        f"load average {load:.2f}): {wall:.2f} s, {samples / wall:,.0f} GPU-samples/s (parse "
        f"{statistics.median(parses):.2f} s, engine {statistics.median(engines):.2f} s; "
        f"vectorized: {summary.get('vectorized')}; goal 1,000,000/s)"
    )
    print(f"runs (wall s): {', '.join(f'{w:.2f}' for w in walls)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--samples", type=int, default=1_000_000, help="GPU-samples per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--policies", action="append", help="default: the packaged default.yaml")
    parser.add_argument("--profile", action="store_true", help="cProfile one steps run")
    args = parser.parse_args()

    policies = load_policies(args.policies or [default_policy_path()])
    parse_s = []
    trace = parse_trace(args.trace)
    for _ in range(args.runs):
        began = time.perf_counter()
        trace = parse_trace(args.trace)
        parse_s.append(time.perf_counter() - began)
    file_samples = len(trace.frames) * trace.gpu_count
    long = repeat(trace, args.samples)
    samples = len(long.frames) * long.gpu_count
    columns = TraceColumns.from_trace(long)
    assert columns is not None

    engine_s, engine_cpu_s, step_s, arrays_s = [], [], [], []
    findings = decisions = 0
    for _ in range(args.runs):
        cpu = time.process_time()
        result = run_backtest(long, policies, engine="steps")
        engine_cpu_s.append(time.process_time() - cpu)
        engine_s.append(result.summary.engine_s)
        findings, decisions = result.summary.findings_started, result.summary.decisions
        arrays = run_backtest(columns, policies, engine="arrays")
        arrays_s.append(arrays.summary.engine_s)
        if arrays.events != result.events:
            print("arrays and steps DIFFER: a bug in gpuwatchd/backtest_arrays.py")
            return 1
        step_s.append(step_only(long, policies))

    parse_med = statistics.median(parse_s)
    engine_med = statistics.median(engine_s)
    arrays_med = statistics.median(arrays_s)
    step_med = statistics.median(step_s)
    cpu_med = statistics.median(engine_cpu_s)
    rate = samples / engine_med
    print(f"trace: {args.trace.name}: {trace.gpu_count} GPUs, {len(trace.frames)} samples "
          f"({file_samples:,} GPU-samples, {trace.duration_s:.1f} s)")  # fmt: skip
    print(f"policies: {', '.join(p.name for p in policies.policies)}")
    print(f"python {sys.version.split()[0]}; medians of {args.runs} runs; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"parse   {parse_med:8.3f} s  {file_samples / parse_med:>12,.0f} GPU-samples/s "
          f"(one file)")  # fmt: skip
    print(f"steps   {engine_med:8.3f} s  {rate:>12,.0f} GPU-samples/s "
          f"({samples:,} GPU-samples, {len(long.frames):,} snapshots; "
          f"{findings} findings started, {decisions} decisions)")  # fmt: skip
    print(f"steps   {cpu_med:8.3f} s  {samples / cpu_med:>12,.0f} GPU-samples/s "
          f"(CPU time of the same runs: what a shared machine's wall time hides)")  # fmt: skip
    print(f"step    {step_med:8.3f} s  {samples / step_med:>12,.0f} GPU-samples/s "
          f"(PolicyEngine.step alone)")  # fmt: skip
    speedup = engine_med / arrays_med
    print(f"arrays  {arrays_med:8.3f} s  {samples / arrays_med:>12,.0f} GPU-samples/s "
          f"(the same trace as columns, same events; {speedup:.1f} x steps)")  # fmt: skip
    day_s = 8 * 86_400 / rate
    verdict = "meets" if rate >= TARGET_PER_S else "BELOW"
    print(f"a day of 8 GPUs at 1 Hz: {day_s:.2f} s through the steps engine; {verdict} the "
          f"target of {TARGET_PER_S:,} GPU-samples/s")  # fmt: skip
    print(f"runs (steps s): {', '.join(f'{s:.3f}' for s in engine_s)}; "
          f"(arrays s): {', '.join(f'{s:.3f}' for s in arrays_s)}")  # fmt: skip

    end_to_end(args.trace, args.runs)

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run_backtest(long, policies, engine="steps")
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
