"""Benchmark ``gpuwatchd replay --prometheus`` over a long range: a day and a week.

Writes its own dcgm-exporter series (2 hosts x 8 H100s, ``DCGM_FI_DEV_GPU_UTIL``,
``_FB_USED``, ``_FB_FREE``, ``_GPU_TEMP``, ``_POWER_USAGE`` every 15 s for ``--days``
days: jobs training for hours, idle stretches, a rank left idle, evaluation phases, memory
near the limit, missed scrapes) as OpenMetrics, backfills them into a scratch TSDB
(``promtool tsdb create-blocks-from openmetrics``) under its own temporary folder, starts
Debian's ``prometheus`` on it on 127.0.0.1 (a free port; the machine's Prometheus is never
touched) and runs, as a user would, for the first day and for the whole week::

    gpuwatchd replay --prometheus URL --start S --end E --step 15s --json

Prints the backfill time apart, then for each range: wall time, GPU-samples/s, the replay
process's peak RSS and CPU time, the ``query_range`` calls Prometheus counted
(``prometheus_http_requests_total``) and the CPU time it spent meanwhile, findings and
decisions, and the load average before and after; then the week's peak RSS over the
day's (goal <= 1.20: memory bounded by the chunk, not the range). How to run it and what
it measured: docs/benchmarks.md, "Replay from Prometheus".

    python bench/prometheus.py [--days 7] [--runs 1] [--dir build/bench-prometheus]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

_spec = importlib.util.spec_from_file_location(
    "bench_replay", Path(__file__).with_name("replay.py")
)
assert _spec is not None and _spec.loader is not None
bench_replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_replay)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/prometheus_tsdb.py: the tests' private Prometheus
from tests.prometheus_tsdb import prometheus_serving, prometheus_tool  # noqa: E402

WORK_DIR = REPO / "build" / "bench-prometheus"
"""Parent of the bench's temporary folder (the repository's ignored build/, not /tmp,
which is often RAM: a week's OpenMetrics file is about 650 MiB)."""
HOSTS = ("gpu-a", "gpu-b")
GPUS = 8
STEP_S = 15
START_S = 1_751_328_000  # 2025-07-01T00:00:00Z
FB_TOTAL_MIB = 81_559  # an H100 80GB HBM3's memory.total as NVML gives it
METRICS = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "util", "{:.0f}"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "used", "{:.0f}"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "free", "{:.0f}"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temp", "{:.0f}"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power", "{:.3f}"),
)
"""dcgm-exporter's default counters read by the replay: name, HELP, key, value format."""


def gpu_series(host: int, gpu: int, steps: int) -> dict[str, np.ndarray]:
    """One GPU's values at each 15 s step (NaN: a missed scrape), keys of :data:`METRICS`.

    The host runs jobs back to back (seed: the host): training 2-10 h, each with a
    checkpoint dip every 30 min, sometimes on 7 of the 8 GPUs (the 8th idle: an idle
    rank) or near the memory limit; evaluation phases of 20-60 min at 20-50 %; idle
    stretches of 5 min-2 h, half of them with the memory still held. About 1 in 500
    scrapes is missed and, once a day, 10 min (an exporter restart)."""
    plan = np.random.default_rng(1000 + host)
    values = np.random.default_rng(2000 + 16 * host + gpu)
    util = np.zeros(steps)
    used = np.zeros(steps)
    at = 0
    while at < steps:
        kind = plan.choice(["train", "eval", "idle"], p=[0.5, 0.2, 0.3])
        minutes = {"train": (120, 600), "eval": (20, 60), "idle": (5, 120)}[kind]
        length = int(plan.integers(*minutes)) * 60 // STEP_S
        left_out = int(plan.integers(GPUS)) if plan.random() < 0.25 else -1
        memory = float(plan.choice([48_000, 62_000, 71_000, 79_000], p=[0.3, 0.3, 0.3, 0.1]))
        held = plan.random() < 0.5
        part = slice(at, min(at + length, steps))
        n = part.stop - part.start
        if kind == "train" and gpu != left_out:
            busy = np.clip(values.normal(93, 4, n), 0, 100)
            busy[np.arange(n) % (30 * 60 // STEP_S) < 2] = values.uniform(0, 8)  # checkpoint
            util[part], used[part] = busy, memory + values.normal(0, 300, n)
        elif kind == "eval" and gpu != left_out:
            util[part] = np.clip(values.normal(35, 12, n), 0, 100)
            used[part] = 0.6 * memory + values.normal(0, 200, n)
        else:
            util[part] = 0.0
            used[part] = (memory if held else 0.0) + values.uniform(0, 4, n)
        at += length
    used = np.clip(np.round(used), 0, FB_TOTAL_MIB - 512)
    power = 70 + 6.2 * util + values.normal(0, 12, steps)
    temp = 33 + 0.38 * util + values.normal(0, 1.5, steps)
    missed = values.random(steps) < 0.002
    for day in range(steps * STEP_S // 86_400):
        first = day * 86_400 // STEP_S + int(values.integers(0, 86_400 // STEP_S - 40))
        missed[first : first + 40] = True
    out = {
        "util": np.round(util),
        "used": used,
        "free": FB_TOTAL_MIB - used,
        "temp": np.round(temp),
        "power": np.clip(power, 60, 700),
    }
    for series in out.values():
        series[missed] = np.nan
    return out


def write_openmetrics(path: Path, days: int) -> int:
    """Write :data:`HOSTS` x :data:`GPUS` GPUs' series over ``days`` days from
    :data:`START_S` to ``path`` (OpenMetrics with timestamps, each metric's series
    together, as promtool reads them); returns the samples written."""
    steps = days * 86_400 // STEP_S
    stamps = [str(START_S + k * STEP_S) for k in range(steps)]
    series = {(h, g): gpu_series(h, g, steps) for h in range(len(HOSTS)) for g in range(GPUS)}
    written = 0
    with path.open("w") as handle:
        for metric, help_text, key, form in METRICS:
            handle.write(f"# HELP {metric} {help_text}\n# TYPE {metric} gauge\n")
            for (h, g), values in series.items():
                host = HOSTS[h]
                labels = (
                    f'gpu="{g}",UUID="GPU-{host}-{g:04d}",device="nvidia{g}",'
                    f'modelName="NVIDIA H100 80GB HBM3",Hostname="{host}",'
                    f'DCGM_FI_DRIVER_VERSION="550.54.15",instance="{host}:9400",'
                    'job="dcgm-exporter"'
                )
                prefix = f"{metric}{{{labels}}} "
                kept = [
                    f"{prefix}{form.format(v)} {t}\n"
                    for v, t in zip(values[key].tolist(), stamps, strict=True)
                    if v == v  # NaN: a missed scrape
                ]
                handle.writelines(kept)
                written += len(kept)
        handle.write("# EOF\n")
    return written


def query_range_calls(url: str) -> int:
    """Prometheus's own count of ``/api/v1/query_range`` requests so far (every code)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    pattern = r'^prometheus_http_requests_total\{[^}]*handler="/api/v1/query_range"[^}]*\} (\S+)$'
    return int(sum(float(m) for m in re.findall(pattern, text, re.MULTILINE)))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def replay(url: str, server_pid: int, days: int) -> dict[str, Any]:
    """``gpuwatchd replay --prometheus`` of the first ``days`` days, measured, with the
    CPU seconds Prometheus spent meanwhile (answering it)."""
    end_s = START_S + days * 86_400 - STEP_S
    command = [
        str(Path(sys.executable).parent / "gpuwatchd"), "replay", "--prometheus", url,
        "--start", str(START_S), "--end", str(end_s), "--step", f"{STEP_S}s", "--json",
    ]  # fmt: skip
    env = dict(os.environ, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    calls = query_range_calls(url)
    load = os.getloadavg()[0]
    server_cpu_s = cpu_seconds(server_pid)
    wall_s, rss_mib, cpu_s, out = bench_replay.measure(command, env)
    server_cpu_s = cpu_seconds(server_pid) - server_cpu_s
    summaries = [s for s in map(json.loads, out.splitlines()) if s["kind"] == "summary"]
    if [s["trace"] for s in summaries] != list(HOSTS):
        raise SystemExit(f"replay of {days} day(s): hosts {[s['trace'] for s in summaries]}")
    return {
        "wall_s": wall_s,
        "rss_mib": rss_mib,
        "cpu_s": cpu_s,
        "server_cpu_s": server_cpu_s,
        "calls": query_range_calls(url) - calls,
        "gpu_samples": sum(s["gpu_samples"] for s in summaries),
        "parse_s": sum(s["parse_s"] for s in summaries),
        "engine_s": sum(s["engine_s"] for s in summaries),
        "findings": sum(s["findings_started"] for s in summaries),
        "decisions": sum(s["decisions"] for s in summaries),
        "load": (load, os.getloadavg()[0]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--days", type=int, default=7, help="the long range (default 7)")
    parser.add_argument("--runs", type=int, default=1, help="replays of each range")
    parser.add_argument("--dir", type=Path, default=WORK_DIR, help="parent of the scratch folder")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="promlong-", dir=args.dir) as tmp:
        work = Path(tmp)
        began = time.perf_counter()
        samples = write_openmetrics(work / "dcgm.om", args.days)
        written_s = time.perf_counter() - began
        size_mib = (work / "dcgm.om").stat().st_size / 2**20
        began = time.perf_counter()
        made = subprocess.run(
            [prometheus_tool("promtool"), "tsdb", "create-blocks-from", "openmetrics", "--quiet",
             "--max-block-duration=200h", str(work / "dcgm.om"), str(work / "tsdb")],
            capture_output=True, text=True,
        )  # fmt: skip
        backfill_s = time.perf_counter() - began
        if made.returncode != 0:
            raise SystemExit(made.stdout + made.stderr)
        (work / "dcgm.om").unlink()
        print(
            f"series: {len(HOSTS)} hosts x {GPUS} GPUs x {len(METRICS)} metrics, {args.days} "
            f"days at {STEP_S} s: {samples:,} samples, written in {written_s:.1f} s "
            f"({size_mib:,.0f} MiB of OpenMetrics); backfill (promtool) {backfill_s:.1f} s"
        )
        rss: dict[int, float] = {}
        with prometheus_serving(work / "tsdb", work, ready_s=120) as (url, server):
            for days in sorted({1, args.days}):
                for _ in range(args.runs):
                    run = replay(url, server.pid, days)
                    rss[days] = max(rss.get(days, 0.0), run["rss_mib"])
                    print(
                        f"replay {days} day(s), {run['gpu_samples']:,} GPU-samples: "
                        f"{run['wall_s']:.2f} s, {run['gpu_samples'] / run['wall_s']:,.0f} "
                        f"GPU-samples/s, peak RSS {run['rss_mib']:.0f} MiB, CPU "
                        f"{run['cpu_s']:.2f} s (reading {run['parse_s']:.2f} s, engine "
                        f"{run['engine_s']:.2f} s), {run['calls']} query_range calls "
                        f"(Prometheus CPU {run['server_cpu_s']:.2f} s), "
                        f"{run['findings']:,} findings started, {run['decisions']:,} "
                        f"decisions; load average {run['load'][0]:.2f} before, "
                        f"{run['load'][1]:.2f} after"
                    )
    if args.days > 1:
        print(f"{args.days} days / 1 day peak RSS: {rss[args.days] / rss[1]:.2f} (goal <= 1.20)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
