"""Tests of the per-(subject, metric) time windows."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatchd.model import (
    NA,
    GpuProcess,
    GpuSample,
    HostSample,
    JobEvent,
    JobInfo,
    JobReport,
    MaybeFloat,
    MaybeInt,
    Snapshot,
)
from gpuwatchd.windows import Window, Windows

GiB = 2**30


def gpu(
    index: int,
    t: float,
    util: MaybeFloat = 50.0,
    used: MaybeInt = 10 * GiB,
    total: MaybeInt = 80 * GiB,
    error: str | None = None,
) -> GpuSample:
    return GpuSample(
        uuid=f"GPU-{index:04d}",
        index=index,
        name="H100",
        timestamp_s=t,
        utilization_gpu_pct=util,
        memory_used_bytes=used,
        memory_total_bytes=total,
        error=error,
    )


def job(name: str, report_t: float | None, wait: float = 0.7) -> JobInfo:
    report = None
    if report_t is not None:
        report = JobReport(
            timestamp_s=report_t,
            steps=10,
            epoch=0,
            step_time_s=0.1,
            data_wait_s=0.1 * wait,
            data_wait_fraction=wait,
            samples_per_s=640.0,
        )
    return JobInfo(name=name, pid=100, connected_at_s=0.0, last_report=report)


def test_window_mean_and_gap_is_not_zero() -> None:
    w = Window(horizon_s=60)
    w.append(0.0, 10.0)
    w.append(1.0, None)  # NVML error this tick
    w.append(2.0, 30.0)
    assert w.mean_since(0.0) == pytest.approx(20.0)  # the gap is not read as 0
    assert w.samples() == [(0.0, 10.0), (1.0, NA), (2.0, 30.0)]
    assert w.count_since(0.0) == (3, 1)
    assert w.mean_since(1.5) == pytest.approx(30.0)
    assert w.mean_since(3.0) is None
    assert w.last_t == 2.0 and w.last_value == 30.0


def test_window_of_only_gaps_has_no_mean() -> None:
    w = Window(horizon_s=10)
    w.append(0.0, None)
    w.append(1.0, None)
    assert w.mean_since(0.0) is None
    assert w.last_value is None


def test_window_evicts_past_horizon() -> None:
    w = Window(horizon_s=5)
    for t in range(20):
        w.append(float(t), float(t))
    assert w.first_t == 14.0  # samples with t >= now - horizon stay
    assert len(w) == 6
    assert w.mean_since(0.0) == pytest.approx(sum(range(14, 20)) / 6)


def test_window_bounded_by_max_samples() -> None:
    w = Window(horizon_s=1e9, max_samples=100)
    for t in range(10_000):
        w.append(float(t), 1.0)
    assert len(w) == 100
    assert w.first_t == 9900.0
    assert w.mean_since(0.0) == 1.0
    assert len(w._t) <= 2 * 100 + 256  # compaction keeps the buffers bounded too


def test_window_time_going_back_clears() -> None:
    w = Window(horizon_s=60)
    w.append(100.0, 1.0)
    w.append(101.0, 2.0)
    w.append(50.0, 5.0)
    assert w.samples() == [(50.0, 5.0)]


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.one_of(st.none(), st.floats(0, 100)), min_size=1, max_size=700),
    horizon_s=st.integers(0, 400),
    max_samples=st.integers(1, 300),
    since_back_s=st.integers(0, 500),
)
def test_window_matches_brute_force(
    values: list[float | None], horizon_s: int, max_samples: int, since_back_s: int
) -> None:
    w = Window(horizon_s=horizon_s, max_samples=max_samples)
    for t, v in enumerate(values):
        w.append(float(t), v)
    now = len(values) - 1
    kept = [(t, v) for t, v in enumerate(values) if t >= now - horizon_s][-max_samples:]
    assert [t for t, _ in w.samples()] == [float(t) for t, _ in kept]
    chosen = [v for t, v in kept if t >= now - since_back_s and v is not None]
    mean = w.mean_since(float(now - since_back_s))
    if not chosen:
        assert mean is None
    else:
        assert mean == pytest.approx(math.fsum(chosen) / len(chosen), abs=1e-6)


def test_windows_feed_gpu_host_and_job_metrics() -> None:
    ws = Windows(
        {
            ("gpu", "utilization_gpu_pct"): 30,
            ("gpu", "memory_used_pct"): 30,
            ("gpu", "memory_used_bytes"): 30,
            ("host", "cpu_pct"): 30,
            ("host", "memory_used_pct"): 30,
            ("job", "data_wait_fraction"): 60,
            ("job", "samples_per_s"): 60,
        }
    )
    host = HostSample(
        timestamp_s=5.0,
        cpu_pct=93.0,
        cpu_count=12,
        memory_used_bytes=30 * GiB,
        memory_total_bytes=40 * GiB,
    )
    ws.observe(Snapshot(5.0, (gpu(0, 5.0, util=12.0), gpu(1, 5.0)), host, (job("digits", 4.9),)))
    assert ws.now == 5.0
    assert [(s, u, i) for s, _, u, i in ws.gpus] == [
        ("gpu:GPU-0000", "GPU-0000", 0),
        ("gpu:GPU-0001", "GPU-0001", 1),
    ]
    assert ws.get("gpu:GPU-0000", "utilization_gpu_pct").last_value == 12.0  # type: ignore[union-attr]
    assert ws.get("gpu:GPU-0000", "memory_used_pct").last_value == 12.5  # type: ignore[union-attr]
    assert ws.get("gpu:GPU-0000", "memory_used_bytes").last_value == 10 * GiB  # type: ignore[union-attr]
    assert ws.host
    assert ws.get("host", "cpu_pct").last_value == 93.0  # type: ignore[union-attr]
    assert ws.get("host", "memory_used_pct").last_value == 75.0  # type: ignore[union-attr]
    assert [(s, n) for s, _, n in ws.jobs] == [("job:digits", "digits")]
    assert ws.get("job:digits", "data_wait_fraction").last_value == 0.7  # type: ignore[union-attr]
    assert ws.get("job:digits", "samples_per_s").last_value == 640.0  # type: ignore[union-attr]


def test_only_needed_metrics_are_kept() -> None:
    ws = Windows({("gpu", "utilization_gpu_pct"): 10})
    ws.observe(Snapshot(1.0, (gpu(0, 1.0),), None, (job("j", 1.0),)))
    assert ws.get("gpu:GPU-0000", "memory_used_pct") is None
    assert ws.jobs == () and ws.get("job:j", "data_wait_fraction") is None
    with pytest.raises(ValueError):
        Windows({("gpu", "temperature"): 10})


def test_na_metrics_are_gaps() -> None:
    ws = Windows({("gpu", "utilization_gpu_pct"): 10, ("gpu", "memory_used_pct"): 10})
    ws.observe(Snapshot(1.0, (gpu(0, 1.0, util=NA, used=NA, error="GPU is lost"),), None))
    ws.observe(Snapshot(2.0, (gpu(0, 2.0, total=NA),), None))  # a trace without memory.total
    util = ws.get("gpu:GPU-0000", "utilization_gpu_pct")
    mem = ws.get("gpu:GPU-0000", "memory_used_pct")
    assert util is not None and mem is not None
    assert util.samples() == [(1.0, NA), (2.0, 50.0)]
    assert mem.samples() == [(1.0, NA), (2.0, NA)]


def test_compute_processes_counts_nvml_processes_and_errors_are_gaps() -> None:
    ws = Windows({("gpu", "compute_processes"): 10})
    busy = GpuSample("GPU-0000", 0, "H100", 1.0, processes=(GpuProcess(10), GpuProcess(11)))
    lost = GpuSample("GPU-0001", 1, "H100", 1.0, error="GPU is lost")
    ws.observe(Snapshot(1.0, (busy, gpu(2, 1.0), lost), None))
    counts = [ws.get(f"gpu:GPU-000{i}", "compute_processes") for i in range(3)]
    assert [w.last_value for w in counts if w is not None] == [2.0, None, 0.0]


def test_events_of_the_latest_snapshot_only() -> None:
    ws = Windows({})
    event = JobEvent(1.0, "hpo", "crash", pid=7, crash_kind="cuda_assert")
    ws.observe(Snapshot(1.0, (), None, events=(event,)))
    assert ws.events == (event,)
    ws.observe(Snapshot(2.0, (), None))
    assert ws.events == ()
    ws.observe(Snapshot(3.0, (), None, events=(event,)))
    ws.clear()
    assert ws.events == ()


def test_stale_job_report_becomes_a_gap() -> None:
    ws = Windows({("job", "data_wait_fraction"): 60}, job_report_stale_s=10)
    ws.observe(Snapshot(0.0, (), None, (job("j", None),)))  # attached, not reported yet
    for t in range(1, 15):
        ws.observe(Snapshot(float(t), (), None, (job("j", 1.0),)))  # same report every tick
    w = ws.get("job:j", "data_wait_fraction")
    assert w is not None
    values = dict(w.samples())
    assert values[0.0] is NA
    assert values[1.0] == 0.7 and values[11.0] == 0.7  # 10 s after it was first seen
    assert values[12.0] is NA and values[14.0] is NA
    ws.observe(Snapshot(15.0, (), None, (job("j", 14.8, wait=0.2),)))  # a fresh report
    assert w.last_value == 0.2


def test_absent_subjects_are_dropped_and_restart_fresh() -> None:
    ws = Windows({("gpu", "utilization_gpu_pct"): 60, ("job", "data_wait_fraction"): 60})
    ws.observe(Snapshot(1.0, (gpu(0, 1.0), gpu(1, 1.0)), None, (job("a", 1.0),)))
    ws.observe(Snapshot(2.0, (gpu(0, 2.0),), None, ()))
    assert set(ws.subjects()) == {"gpu:GPU-0000"}
    ws.observe(Snapshot(3.0, (gpu(0, 3.0), gpu(1, 3.0)), None, ()))
    w1 = ws.get("gpu:GPU-0001", "utilization_gpu_pct")
    assert w1 is not None and w1.samples() == [(3.0, 50.0)]


def test_clock_step_back_clears_everything() -> None:
    ws = Windows({("gpu", "utilization_gpu_pct"): 60})
    ws.observe(Snapshot(100.0, (gpu(0, 100.0),), None))
    ws.observe(Snapshot(10.0, (gpu(0, 10.0),), None))
    w = ws.get("gpu:GPU-0000", "utilization_gpu_pct")
    assert w is not None and w.samples() == [(10.0, 50.0)]


def test_configure_keeps_history_of_kept_metrics() -> None:
    ws = Windows({("gpu", "utilization_gpu_pct"): 5, ("gpu", "memory_used_pct"): 5})
    for t in range(3):
        ws.observe(Snapshot(float(t), (gpu(0, float(t)),), None))
    ws.configure({("gpu", "utilization_gpu_pct"): 60})
    assert ws.needs == {("gpu", "utilization_gpu_pct"): 60.0}
    w = ws.get("gpu:GPU-0000", "utilization_gpu_pct")
    assert w is not None and len(w) == 3 and w.horizon_s == 60.0
    assert ws.get("gpu:GPU-0000", "memory_used_pct") is None


def test_memory_stays_bounded_over_a_long_run() -> None:
    ws = Windows({("gpu", "utilization_gpu_pct"): 30}, max_samples=4096)
    for t in range(20_000):
        ws.observe(Snapshot(t * 0.1, tuple(gpu(i, t * 0.1) for i in range(2)), None))
    for subject in ws.subjects():
        w = ws.get(subject, "utilization_gpu_pct")
        assert w is not None and len(w) == 301  # 30 s at 100 ms, both ends included
        assert len(w._t) < 1000
