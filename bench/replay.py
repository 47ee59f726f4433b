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
average of the machine before it (other work inflates wall times); each format end to
end, a day and a week, and the rate of the week's six more days (``formats``, beside
the start-up and the floor under it: Python importing numpy and pyarrow); a fleet of 8
hosts x 8 GPUs in Parquet, a day and a week, as a file per host and day and as one file
of all hosts (``fleet``: rate, peak RSS, week / day); a month of 64 GPUs in Parquet
(``month``).

Target (issue 3): >= 200,000 GPU-samples/s through the engine, i.e. a day of 8 GPUs at
1 Hz (691,200 GPU-samples) in under 4 s. ``--profile`` prints where one steps run
spends its time (cProfile, by own time).

    python bench/replay.py [--samples 1000000] [--runs 3] [--policies PATH] [--profile]
    python bench/replay.py --month-only [--month-days 30] [--month-dir build/bench-month]
    python bench/replay.py --fleet-only [--fleet-dir build/bench-fleet]
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

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
MONTH_DIR = Path(__file__).resolve().parents[1] / "build" / "bench-month"
"""Where ``--month-only`` writes its file (the repository's ignored build/)."""
FLEET_DIR = MONTH_DIR.parent / "bench-fleet"
"""Where the fleet's files are written (build/, as the month's)."""


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
            done = subprocess.run(
                command, capture_output=True, text=True, check=True, env=_installed_env()
            )
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


START_S = 1_753_574_400
"""2025-07-27 00:00:00 UTC: the first second of every generated trace."""


def cycle_cells(source: Path, gpus: int) -> list[list[tuple[str, int, str]]]:
    """Per frame of ``source`` (every 10th: 1 Hz of a 100 ms trace), per GPU of ``gpus``
    (cycling through the trace's): (utilization %, memory used MiB, power W) as the CSV
    writes them."""
    trace = parse_trace(source)
    return [
        [
            (
                f"{s.utilization_gpu_pct:.0f}",
                int(s.memory_used_bytes) // 2**20,  # type: ignore[call-overload]
                f"{s.power_draw_w:.2f}",
            )
            for s in (f.samples[g % trace.gpu_count] for g in range(gpus))
        ]
        for f in trace.frames[::10]
    ]


def parquet_tables(
    cells: list[list[tuple[str, int, str]]], hosts: Sequence[str], first_s: int, seconds: int
) -> Iterator[Any]:
    """``seconds`` seconds at 1 Hz from UTC second ``first_s`` of ``cells``' GPUs on each
    of ``hosts`` (host ``k`` 7 k frames ahead in the cycle, GPU uuids ``GPU-host-g``) as
    pyarrow Tables of :func:`~gpuwatchd.sampling.parquet.parquet_schema`, about a million
    rows each (a row group); each second's rows host by host, GPU by GPU."""
    import numpy as np
    import pyarrow as pa

    from gpuwatchd.sampling.parquet import PARQUET_COLUMNS, parquet_schema

    names = [name for name, _ in PARQUET_COLUMNS]
    schema = parquet_schema()
    gpus = len(cells[0])
    util = np.array([[float(c[0]) for c in row] for row in cells])
    used = np.array([[c[1] for c in row] for row in cells], dtype=np.int64)
    power = np.array([[float(c[2]) for c in row] for row in cells])
    width = gpus * len(hosts)
    uuids = pa.array([f"GPU-{h}-{g}" for h in hosts for g in range(gpus)])
    block = max(1, (1 << 20) // width)
    for first in range(0, seconds, block):
        second = np.arange(first, min(first + block, seconds)) + (first_s - START_S)
        rows = second.shape[0] * width
        column = np.tile(np.arange(width), second.shape[0])
        host, gpu = np.divmod(column, gpus)
        which = (np.repeat(second, width) + 7 * host) % len(cells)
        columns = {
            "host": pa.DictionaryArray.from_arrays(host.astype(np.int32), pa.array(hosts)),
            "timestamp": pa.array(np.repeat((START_S + second) * 1000, width)),
            "index": pa.array(gpu.astype(np.int32)),
            "uuid": pa.DictionaryArray.from_arrays(column.astype(np.int32), uuids),
            "name": pa.DictionaryArray.from_arrays(
                np.zeros(rows, dtype=np.int32), pa.array(["NVIDIA H100 80GB HBM3"])
            ),
            "utilization.gpu [%]": util[which, gpu],
            "memory.used [MiB]": used[which, gpu],
            "memory.total [MiB]": np.full(rows, 81559, dtype=np.int64),
            "temperature.gpu": np.full(rows, 60.0),
            "power.draw [W]": power[which, gpu],
        }
        yield pa.table({name: columns[name] for name in names}).cast(schema)


def write_trace(source: Path, out: Path, form: str, days: int, gpus: int = 8) -> int:
    """Write ``days`` days of ``gpus`` GPUs at 1 Hz cycling through ``source``'s samples
    (every 10th frame), in ``form``: ``record`` (gpuwatchd record's own CSV: timestamp,
    index, uuid, name, ...), ``smi`` (no index, rows 2 ms apart) or ``parquet``
    (gpuwatchd.sampling.parquet's columns). Returns the GPU-samples written."""
    import pyarrow.parquet as pq

    from gpuwatchd.record import CSV_HEADER
    from gpuwatchd.sampling.parquet import parquet_schema

    cells = cycle_cells(source, gpus)
    start = START_S
    seconds = 86_400 * days
    if form == "parquet":
        writer = pq.ParquetWriter(out, parquet_schema(), compression="zstd")
        for table in parquet_tables(cells, ("bench",), start, seconds):
            writer.write_table(table)
        writer.close()
        return seconds * gpus
    with out.open("w") as handle:
        if form == "record":
            handle.write(CSV_HEADER + "\n")
        else:
            handle.write("timestamp, power.draw [W], utilization.gpu [%], memory.used [MiB]\n")
        for second in range(seconds):
            row = cells[second % len(cells)]
            day = time.strftime("%Y/%m/%d %H:%M:%S", time.gmtime(start + second))
            if form == "record":
                handle.write("".join(
                    f"{day}.000, {g}, GPU-bench-{g}, NVIDIA H100 80GB HBM3, {u} %, {m} MiB, "
                    f"81559 MiB, 60, {p} W\n" for g, (u, m, p) in enumerate(row)
                ))  # fmt: skip
            else:
                handle.write("".join(
                    f"{day}.{2 * g:03d}, {p} W, {u} %, {m} MiB\n" for g, (u, m, p) in enumerate(row)
                ))  # fmt: skip
    return seconds * gpus


def _installed_env() -> dict[str, str]:
    """This environment without ``PYTHONDONTWRITEBYTECODE``, for the ``gpuwatchd replay``
    runs: an installed package has its modules compiled (pip writes the .pyc files), but
    with that variable set (as in some CI and container images) every start compiles
    gpuwatchd's ~80 modules again (measured: ~0.09 s CPU of the 0.5 s start-up). The
    first run writes them. The venv is the one this script runs in (the Makefile's
    editable install: its finder is imported by ``site`` at every start; ``python -S``
    starts ~16 ms CPU sooner here)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


_LAUNCHER = """
import os, subprocess, sys, time
began = time.perf_counter()
child = subprocess.Popen(sys.argv[1:], stderr=subprocess.DEVNULL)
_, status, usage = os.wait4(child.pid, 0)
wall = time.perf_counter() - began
print(wall, status, usage.ru_maxrss, usage.ru_utime + usage.ru_stime, file=sys.stderr)
"""
"""Runs a command and prints its wall seconds, wait status, peak RSS (KiB) and CPU
seconds to stderr. Linux gives a child the peak RSS of the process it was forked from
(``ru_maxrss`` survives exec): started from this script, which grows writing the traces
(a week of Parquet: 393 MiB), every replay would report at least that; started from this
small launcher, it reports its own."""


def measure(
    command: list[str], env: dict[str, str] | None = None
) -> tuple[float, float, float, str]:
    """Run ``command`` through :data:`_LAUNCHER`: (wall s, peak RSS MiB of that process,
    its user + system CPU seconds, its stdout). SystemExit when it exits non-zero."""
    done = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, *command], capture_output=True, check=True, env=env
    )
    wall_s, status, rss_kib, cpu_s = done.stderr.decode().split()[-4:]
    if int(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed: status {status}")
    return float(wall_s), int(rss_kib) / 1024, float(cpu_s), done.stdout.decode()


def replay_once(path: Path) -> tuple[float, float, dict[str, Any]]:
    """``gpuwatchd replay PATH --json``: (wall s, peak RSS MiB of that process, summary
    with ``cpu_s`` added: the process's user + system CPU seconds), run through
    :data:`_LAUNCHER` (:func:`measure`). Several hosts' summaries are added up:
    GPU-samples, ``parse_s``, ``engine_s``, findings and decisions summed, ``vectorized``
    of every one, ``hosts`` counted."""
    command = [str(Path(sys.executable).parent / "gpuwatchd"), "replay", str(path), "--json"]
    wall_s, rss_mib, cpu_s, out = measure(command, env=_installed_env())
    lines = out.splitlines()
    summaries = [json.loads(line) for line in lines if line.startswith('{"kind":"summary"')]
    summary = dict(summaries[-1], hosts=len(summaries), cpu_s=cpu_s)
    for key in ("gpu_samples", "parse_s", "engine_s", "findings_started", "decisions"):
        summary[key] = sum(s[key] for s in summaries)
    summary["vectorized"] = all(s["vectorized"] for s in summaries)
    return wall_s, rss_mib, summary


def formats(source: Path) -> None:
    """End to end in each format: a day of 8 GPUs at 1 Hz (rate, peak RSS) and a week
    (peak RSS; issue 24: no more than the day's + 20 %), and the week's six days more
    than the day over the wall time they add (the rate once started); before them, the
    start-up (a replay of one sample) and the floor under it (Python importing numpy and
    pyarrow, median of 5)."""
    print(f"formats (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}):")
    with tempfile.TemporaryDirectory(prefix="gwformats-") as tmp:
        # what every run pays before its first sample: Python, gpuwatchd's CLI, numpy,
        # pyarrow, the policies and the engine (a trace of one sample of 8 GPUs)
        from gpuwatchd.record import CSV_HEADER

        tiny = Path(tmp) / "one-sample.csv"
        tiny.write_text(CSV_HEADER + "\n" + "".join(
            f"2025/07/27 00:00:00.000, {g}, GPU-bench-{g}, NVIDIA H100 80GB HBM3, 50 %, "
            f"1000 MiB, 81559 MiB, 60, 300.00 W\n" for g in range(8)
        ))  # fmt: skip
        wall, rss_one, summary = replay_once(tiny)
        print(
            f"  startup (replay of one sample of 8 GPUs): {wall:.2f} s wall, "
            f"{summary['cpu_s']:.2f} s CPU, peak RSS {rss_one:.0f} MiB"
        )
        # the floor under any replay of Parquet in Python: the interpreter, numpy and
        # pyarrow imported (median of 5: each one is short and noisy)
        floor = [
            measure([sys.executable, "-c", "import numpy, pyarrow.parquet, pyarrow.compute"])
            for _ in range(5)
        ]
        floor_s = statistics.median(wall for wall, _, _, _ in floor)
        print(
            f"  floor (python -c 'import numpy, pyarrow.parquet, pyarrow.compute', median of "
            f"5): {floor_s:.3f} s wall; a day of 8 GPUs at 5,000,000/s is "
            f"{8 * 86_400 / 5e6:.3f} s"
        )
        for form, suffix, goal in (("record", "csv", 1e6), ("smi", "csv", 1e6),
                                   ("parquet", "parquet", 5e6)):  # fmt: skip
            rss, walls, counts = {}, {}, {}
            for days in (1, 7):
                path = Path(tmp) / f"{form}-{days}d.{suffix}"
                samples = counts[days] = write_trace(source, path, form, days)
                wall, rss[days], summary = replay_once(path)
                walls[days] = wall
                path.unlink()
                print(
                    f"  {form:<8} {days} day(s) of 8 GPUs at 1 Hz, {samples:>10,} GPU-samples: "
                    f"{wall:6.2f} s, {samples / wall:>11,.0f} GPU-samples/s (goal {goal:,.0f}), "
                    f"CPU {summary['cpu_s']:.2f} s, peak RSS {rss[days]:6.0f} MiB, "
                    f"parse {summary['parse_s']:.2f} s, engine {summary['engine_s']:.2f} s, "
                    f"vectorized {summary['vectorized']}"
                )
            print(f"  {form:<8} week / day peak RSS: {rss[7] / rss[1]:.2f} (goal <= 1.20)")
            print(
                f"  {form:<8} the week's 6 days more than the day, once started: "
                f"{(counts[7] - counts[1]) / (walls[7] - walls[1]):,.0f} GPU-samples/s"
            )
        print(f"  (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end)")


def fleet(source: Path, where: Path, hosts: int = 8, gpus: int = 8) -> None:
    """``hosts`` hosts of ``gpus`` GPUs at 1 Hz in Parquet, a day and a week, laid out two
    ways: one file per host and day (``gpu-00-2025-07-27.parquet``: what a fleet collects
    of ``gpuwatchd record --out``) and one file of every host's rows, second by second
    (written under ``where``, outside /tmp, removed after), through ``gpuwatchd replay
    DIR --json``: rate and peak RSS (issue 24: the week's no more than the day's + 20 %)."""
    import shutil

    import pyarrow.parquet as pq

    from gpuwatchd.sampling.parquet import parquet_schema

    def write(path: Path, names: Sequence[str], first_s: int, seconds: int) -> None:
        writer = pq.ParquetWriter(path, parquet_schema(), compression="zstd")
        for table in parquet_tables(cells, names, first_s, seconds):
            writer.write_table(table)
        writer.close()

    print(f"fleet (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}):")
    names = [f"gpu-{k:02d}" for k in range(hosts)]
    cells = cycle_cells(source, gpus)
    for layout in ("a file per host and day", "one file of all hosts"):
        rss = {}
        for days in (1, 7):
            folder = where / f"fleet-{days}d"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            try:
                if layout.startswith("one"):
                    write(folder / "fleet.parquet", names, START_S, 86_400 * days)
                else:
                    for host in names:
                        for day in range(days):
                            first_s = START_S + 86_400 * day
                            date = time.strftime("%Y-%m-%d", time.gmtime(first_s))
                            write(folder / f"{host}-{date}.parquet", (host,), first_s, 86_400)
                files = len(list(folder.iterdir()))
                wall, rss[days], summary = replay_once(folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            samples = summary["gpu_samples"]
            print(
                f"  {layout}, {days} day(s) of {summary['hosts']} hosts x {gpus} GPUs at 1 Hz "
                f"({files} files), {samples:,} GPU-samples: {wall:6.2f} s, "
                f"{samples / wall:>11,.0f} GPU-samples/s, CPU {summary['cpu_s']:.2f} s, peak RSS "
                f"{rss[days]:4.0f} MiB, parse {summary['parse_s']:.2f} s, engine "
                f"{summary['engine_s']:.2f} s, vectorized {summary['vectorized']}"
            )
        print(f"  {layout}: week / day peak RSS {rss[7] / rss[1]:.2f} (goal <= 1.20)")
    print(f"  (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end)")


def month(source: Path, where: Path, days: int = 30) -> None:
    """A month (``days`` days) of 64 GPUs at 1 Hz in Parquet (166 M GPU-samples, written a
    row group at a time under ``where``, a directory outside /tmp, removed after), through
    ``gpuwatchd replay FILE --json`` (issue 24's goal: under 3 minutes and 1 GiB)."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"month-{days}d-64gpus.parquet"
    try:
        began = time.perf_counter()
        samples = write_trace(source, path, "parquet", days, gpus=64)
        written_s = time.perf_counter() - began
        size_mib = path.stat().st_size / 2**20
        before = os.getloadavg()
        wall, peak, summary = replay_once(path)
        after = os.getloadavg()
    finally:
        path.unlink(missing_ok=True)
    print(
        f"parquet, {days} days of 64 GPUs at 1 Hz, {samples:,} GPU-samples (written in "
        f"{written_s:.0f} s, {size_mib:,.0f} MiB): {wall:.1f} s (goal < 180 s), "
        f"{samples / wall:,.0f} GPU-samples/s, peak RSS {peak:.0f} MiB (goal < 1024); CPU "
        f"{summary['cpu_s']:.1f} s (user + system; what the wall time is on an idle core); parse "
        f"{summary['parse_s']:.1f} s, engine {summary['engine_s']:.1f} s, "
        f"{summary['findings_started']:,} findings started, {summary['decisions']:,} "
        f"decisions, vectorized {summary['vectorized']}; load average "
        f"{before[0]:.2f} before, {after[0]:.2f} after"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--samples", type=int, default=1_000_000, help="GPU-samples per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--policies", action="append", help="default: the packaged default.yaml")
    parser.add_argument("--profile", action="store_true", help="cProfile one steps run")
    parser.add_argument(
        "--formats-only", action="store_true", help="only the end-to-end figures per format"
    )
    parser.add_argument(
        "--no-month", action="store_true", help="skip the month of 64 GPUs in Parquet"
    )
    parser.add_argument(
        "--month-only", action="store_true", help="only the month of 64 GPUs in Parquet"
    )
    parser.add_argument(
        "--fleet-only", action="store_true", help="only the day and week of 8 hosts in Parquet"
    )
    parser.add_argument(
        "--fleet-dir",
        type=Path,
        default=FLEET_DIR,
        help="where the fleet's Parquet files are written (and removed): not /tmp, often RAM",
    )
    parser.add_argument(
        "--month-days", type=int, default=30, help="days of the month run (default 30)"
    )
    parser.add_argument(
        "--month-dir",
        type=Path,
        default=MONTH_DIR,
        help="where the month's Parquet file is written (and removed): not /tmp, often RAM",
    )
    args = parser.parse_args()
    if args.month_only:
        month(args.trace, args.month_dir, args.month_days)
        return 0
    if args.fleet_only:
        fleet(args.trace, args.fleet_dir)
        return 0
    if args.formats_only:
        formats(args.trace)
        fleet(args.trace, args.fleet_dir)
        if not args.no_month:
            month(args.trace, args.month_dir, args.month_days)
        return 0

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
    formats(args.trace)
    fleet(args.trace, args.fleet_dir)
    if not args.no_month:
        month(args.trace, args.month_dir, args.month_days)

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run_backtest(long, policies, engine="steps")
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
