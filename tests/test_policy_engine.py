"""Tests of the policy engine: findings -> decisions, cooldown, bounds, dry-run, reload, speed."""

from __future__ import annotations

import csv
import statistics
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import pytest

from gpuwatchd.model import (
    NA,
    Decision,
    GpuSample,
    HostSample,
    JobInfo,
    JobReport,
    Knob,
    KnobValue,
    MaybeFloat,
    Snapshot,
)
from gpuwatchd.policy.engine import PolicyEngine, compute_knob_value
from gpuwatchd.policy.schema import PolicySet, default_policy_path, load_policies, parse_policies

GiB = 2**30
TRACES = Path("/work/shared/traces")
H100_TRACE = TRACES / "h100x8_gpt350m_ckpt10_100ms.csv"


def policies(text: str) -> PolicySet:
    return parse_policies(text, "test.yaml")


def gpu(index: int, util: MaybeFloat = 90.0, used: int = 10 * GiB) -> GpuSample:
    return GpuSample(
        uuid=f"GPU-{index:04d}",
        index=index,
        name="H100",
        timestamp_s=0.0,
        utilization_gpu_pct=util,
        memory_used_bytes=used,
        memory_total_bytes=80 * GiB,
    )


def host(cpu: float = 10.0, mem_pct: float = 10.0) -> HostSample:
    return HostSample(
        timestamp_s=0.0,
        cpu_pct=cpu,
        cpu_count=8,
        memory_used_bytes=int(mem_pct * GiB),
        memory_total_bytes=100 * GiB,
    )


def job(
    name: str,
    workers: KnobValue = 4,
    lo: KnobValue | None = 0,
    hi: KnobValue | None = 64,
    wait: float | None = None,
    t: float = 0.0,
    devices: Sequence[str] = (),
) -> JobInfo:
    report = None
    if wait is not None:
        report = JobReport(t, 1, 0, 0.1, 0.1 * wait, wait, 100.0)
    return JobInfo(
        name=name,
        pid=1,
        connected_at_s=0.0,
        cuda_devices=tuple(devices),
        knobs={"num_workers": Knob("num_workers", workers, lo, hi)},
        last_report=report,
    )


def snap(
    t: float,
    gpus: Sequence[GpuSample] = (),
    host_sample: HostSample | None = None,
    jobs: Sequence[JobInfo] = (),
) -> Snapshot:
    return Snapshot(t, tuple(gpus), host_sample, tuple(jobs))


HOST_POLICY = """\
policies:
  - name: host-oversubscribed
    when:
      host_cpu_above: {percent: 90, for: 5s}
    do:
      - set_knob: {knob: num_workers, factor: 0.5, min: 1}
      - log: {level: warning}
    cooldown: 10s
"""


def run(engine: PolicyEngine, times: Sequence[float], **kw: object) -> list[list[Decision]]:
    return [list(engine.step(snap(t, **kw)).decisions) for t in times]  # type: ignore[arg-type]


def test_host_policy_acts_on_every_job_with_the_knob() -> None:
    engine = PolicyEngine(policies(HOST_POLICY))
    jobs = [job("a", 8), job("b", 3), JobInfo(name="noknob", pid=2, connected_at_s=0.0)]
    for t in range(5):
        result = engine.step(snap(float(t), host_sample=host(cpu=95.0), jobs=jobs))
        assert result.findings == () and result.decisions == ()
    result = engine.step(snap(5.0, host_sample=host(cpu=95.0), jobs=jobs))
    assert [f.detector for f in result.findings] == ["host_cpu_above"]
    knobs = [d for d in result.decisions if d.action == "set_knob"]
    assert [(d.job, dict(d.params)) for d in knobs] == [
        ("a", {"knob": "num_workers", "value": 4, "previous": 8}),
        ("b", {"knob": "num_workers", "value": 2, "previous": 3}),  # 1.5 rounds half up
    ]
    (log,) = [d for d in result.decisions if d.action == "log"]
    assert log.params == {"message": "host CPU 95.0 % > 90 % for 5s", "level": "warning"}
    assert log.policy == "host-oversubscribed" and log.timestamp_s == 5.0
    assert all(d.findings == result.findings and not d.dry_run for d in result.decisions)
    assert knobs[0].reason == "host CPU 95.0 % > 90 % for 5s"


def test_cooldown_per_policy_and_target() -> None:
    engine = PolicyEngine(policies(HOST_POLICY))
    jobs = [job("a", 8)]
    out = run(engine, [float(t) for t in range(30)], host_sample=host(cpu=95.0), jobs=jobs)
    acted = [t for t, ds in enumerate(out) if any(d.action == "set_knob" for d in ds)]
    assert acted == [5, 15, 25]  # findings every tick, action once per 10 s cooldown
    logged = [t for t, ds in enumerate(out) if any(d.action == "log" for d in ds)]
    assert logged == [5, 15, 25]


def test_cooldown_is_per_target_job() -> None:
    engine = PolicyEngine(policies(HOST_POLICY))
    for t in range(6):
        engine.step(snap(float(t), host_sample=host(cpu=95.0), jobs=[job("a", 8)]))
    later = engine.step(snap(6.0, host_sample=host(cpu=95.0), jobs=[job("a", 8), job("b", 8)]))
    assert [d.job for d in later.decisions if d.action == "set_knob"] == ["b"]


def test_no_decision_when_value_unchanged() -> None:
    engine = PolicyEngine(policies(HOST_POLICY))
    out = run(
        engine, [float(t) for t in range(7)], host_sample=host(cpu=95.0), jobs=[job("a", 1)]
    )  # already at the action's min 1
    assert [d.action for d in out[5]] == ["log"]
    assert out[6] == []  # the log is cooling down


def test_all_conditions_must_hold() -> None:
    text = """\
policies:
  - name: idle-and-starved
    when:
      low_utilization: {percent: 20, for: 3s}
      data_starved: {fraction: 0.5, for: 3s}
    do:
      - set_knob: {knob: num_workers, step: 2, max: 16}
"""
    engine = PolicyEngine(policies(text))
    for t in range(4):  # GPU busy: only data_starved holds
        res = engine.step(
            snap(float(t), [gpu(0, util=95.0)], jobs=[job("digits", 4, wait=0.9, t=float(t))])
        )
    assert [f.detector for f in res.findings] == ["data_starved"] and res.decisions == ()
    for t in range(4, 8):
        res = engine.step(
            snap(
                float(t),
                [gpu(0, util=5.0)],
                jobs=[job("digits", 4, wait=0.9, t=float(t), devices=["0"])],
            )
        )
    assert {f.detector for f in res.findings} == {"data_starved", "low_utilization"}
    (decision,) = res.decisions
    assert decision.job == "digits" and decision.params == {
        "knob": "num_workers",
        "value": 6,
        "previous": 4,
    }


def test_job_findings_target_only_their_job() -> None:
    text = """\
policies:
  - name: data-starved
    when: {data_starved: {fraction: 0.5, for: 2s}}
    do: [{set_knob: {knob: num_workers, factor: 2, max: 16}}]
"""
    engine = PolicyEngine(policies(text))
    for t in range(3):
        res = engine.step(
            snap(
                float(t),
                jobs=[
                    job("starved", 0, wait=0.8, t=float(t)),
                    job("fine", 2, wait=0.1, t=float(t)),
                ],
            )
        )
    (decision,) = res.decisions
    assert decision.job == "starved"
    assert decision.params["value"] == 1  # 0 * 2 would stick at 0; a factor moves it by >= 1
    assert [f.job for f in decision.findings] == ["starved"]


def test_gpu_findings_target_jobs_on_that_gpu() -> None:
    text = """\
policies:
  - name: idle
    when: {low_utilization: {percent: 20, for: 0}}
    do: [{set_knob: {knob: num_workers, step: 1}}]
"""
    engine = PolicyEngine(policies(text))
    jobs = [
        job("on0", devices=["0"]),
        job("on1", devices=["1"]),
        job("by-uuid", devices=["GPU-0001"]),
        job("all"),
    ]
    res = engine.step(snap(0.0, [gpu(0, util=90.0), gpu(1, util=3.0)], jobs=jobs))
    assert sorted(d.job for d in res.decisions) == ["all", "by-uuid", "on1"]  # type: ignore[type-var]


def test_explicit_job_param() -> None:
    text = HOST_POLICY.replace("min: 1}", "min: 1, job: b}")
    engine = PolicyEngine(policies(text))
    out = run(
        engine,
        [float(t) for t in range(6)],
        host_sample=host(cpu=95.0),
        jobs=[job("a", 8), job("b", 8)],
    )
    assert [d.job for d in out[5] if d.action == "set_knob"] == ["b"]


@pytest.mark.parametrize(
    ("knob", "params", "expected"),
    [
        (Knob("w", 8, 0, 64), {"factor": 0.5}, 4),
        (Knob("w", 3, 0, 64), {"factor": 0.5}, 2),  # 1.5 rounds half up
        (Knob("w", 1, 0, 64), {"factor": 0.5, "min": 1}, 1),  # clamped: unchanged
        (Knob("w", 1, 0, 64), {"factor": 0.5, "min": 0}, 0),
        (Knob("w", 0, 0, 64), {"factor": 2}, 1),  # moves by at least 1
        (Knob("w", 12, 0, 64), {"factor": 2, "max": 16}, 16),  # action max
        (Knob("w", 12, 0, 10), {"factor": 2, "max": 16}, 10),  # the knob's own max wins
        (Knob("w", 2, 2, 10), {"factor": 0.1, "min": 0}, 2),  # the knob's own min wins
        (Knob("w", 4, None, None), {"step": -3}, 1),
        (Knob("w", 4, 0, 64), {"value": 2.6}, 3),  # int knob stays int
        (Knob("w", 4, 0, 64), {"value": 100}, 64),
        (Knob("lr", 0.1, 0.0, 1.0), {"factor": 0.5}, 0.05),
        (Knob("persistent_workers", False), {"value": True}, True),
        (Knob("persistent_workers", False), {"factor": 2}, None),
        (Knob("w", 4, 0, 64), {"value": True}, None),
    ],
)
def test_compute_knob_value(
    knob: Knob, params: dict[str, object], expected: KnobValue | None
) -> None:
    value = compute_knob_value(knob, params)
    assert value == expected
    assert type(value) is type(expected)


def test_dry_run_paused_and_policy_dry_run_mark_decisions() -> None:
    times = [float(t) for t in range(6)]
    kw = {"host_sample": host(cpu=95.0), "jobs": [job("a", 8)]}
    assert not any(d.dry_run for d in run(PolicyEngine(policies(HOST_POLICY)), times, **kw)[5])
    dry = run(PolicyEngine(policies(HOST_POLICY), dry_run=True), times, **kw)[5]
    assert dry and all(d.dry_run for d in dry)
    paused_engine = PolicyEngine(policies(HOST_POLICY))
    paused_engine.paused = True
    paused = run(paused_engine, times, **kw)[5]
    assert len(paused) == 2 and all(d.dry_run for d in paused)  # still decided, marked
    per_policy = run(PolicyEngine(policies(HOST_POLICY + "    dry_run: true\n")), times, **kw)[5]
    assert per_policy and all(d.dry_run for d in per_policy)
    paused_engine.paused = False
    resumed = run(paused_engine, [16.0], **kw)[0]  # after the cooldown
    assert resumed and not any(d.dry_run for d in resumed)


def test_reload_keeps_streaks_and_cooldowns_of_persisting_policies() -> None:
    engine = PolicyEngine(policies(HOST_POLICY))
    jobs = [job("a", 8)]
    for t in range(6):
        engine.step(snap(float(t), host_sample=host(cpu=95.0), jobs=jobs))
    other = """\
  - name: gpu-idle
    when: {low_utilization: {percent: 20, for: 5s}}
    do: [log]
"""
    engine.reload(policies(HOST_POLICY + other))
    assert engine.policies.names == ("host-oversubscribed", "gpu-idle")
    res = engine.step(snap(6.0, host_sample=host(cpu=95.0), jobs=jobs))
    assert [f.detector for f in res.findings] == ["host_cpu_above"]  # no new warm-up
    assert res.decisions == ()  # still cooling down from t=5
    res = engine.step(snap(15.0, host_sample=host(cpu=95.0), jobs=jobs))
    assert [d.action for d in res.decisions] == ["set_knob", "log"]


def test_reload_with_changed_params_warms_up_again() -> None:
    engine = PolicyEngine(policies(HOST_POLICY))
    for t in range(6):
        engine.step(snap(float(t), host_sample=host(cpu=95.0)))
    engine.reload(policies(HOST_POLICY.replace("percent: 90", "percent: 80")))
    assert engine.step(snap(6.0, host_sample=host(cpu=95.0))).findings == ()
    engine.reload(PolicySet())
    assert len(engine.policies) == 0
    assert engine.step(snap(7.0, host_sample=host(cpu=95.0))).findings == ()


def test_clock_step_back_and_long_gap_reset_streaks() -> None:
    engine = PolicyEngine(policies(HOST_POLICY), max_gap_s=3.0)
    for t in range(6):
        engine.step(snap(100.0 + t, host_sample=host(cpu=95.0)))
    assert engine.step(snap(106.0, host_sample=host(cpu=95.0))).findings
    assert engine.step(snap(50.0, host_sample=host(cpu=95.0))).findings == ()  # clock back
    for t in range(51, 56):
        engine.step(snap(float(t), host_sample=host(cpu=95.0)))
    assert engine.step(snap(60.0, host_sample=host(cpu=95.0))).findings == ()  # 5 s unseen


def test_gpu_lost_breaks_the_streak_in_the_engine() -> None:
    engine = PolicyEngine(
        policies(
            HOST_POLICY.replace(
                "host_cpu_above: {percent: 90, for: 5s}", "low_utilization: {percent: 20, for: 5s}"
            )
        )
    )
    for t in range(5):
        engine.step(snap(float(t), [gpu(0, util=0.0)]))
    engine.step(snap(5.0, [gpu(0, util=NA)]))
    assert engine.step(snap(6.0, [gpu(0, util=0.0)])).findings == ()


def test_log_cooldown_per_subject() -> None:
    text = """\
policies:
  - name: idle
    when: {low_utilization: {percent: 20, for: 2s}}
    do: [log]
    cooldown: 1m
"""
    engine = PolicyEngine(policies(text))
    logs = []
    for t in range(30):
        gpus = [gpu(0, util=0.0), gpu(1, util=0.0 if t >= 10 else 90.0)]
        if t >= 20:
            gpus = [gpu(1, util=0.0)]  # GPU 0 goes away: the log must not repeat
        logs.append([d for d in engine.step(snap(float(t), gpus)).decisions])
    fired = [(t, str(ds[0].params["message"])) for t, ds in enumerate(logs) if ds]
    assert [t for t, _ in fired] == [2, 12]  # GPU 1 joining is news; GPU 0 leaving is not
    assert "GPU 0" in fired[1][1] and "GPU 1" in fired[1][1]
    assert logs[2][0].gpu_uuid == "GPU-0000" and logs[12][0].gpu_uuid is None


def read_h100_trace() -> list[Snapshot]:
    """The real nvidia-smi log: 8 rows (GPUs in index order) per sample, every 100 ms."""
    with H100_TRACE.open(newline="") as stream:
        rows = list(csv.reader(stream))[1:]
    snaps = []
    for start in range(0, len(rows) - 7, 8):
        group = rows[start : start + 8]
        stamp = datetime.strptime(group[0][0].strip(), "%Y/%m/%d %H:%M:%S.%f")
        t = stamp.replace(tzinfo=timezone.utc).timestamp()
        gpus = tuple(
            GpuSample(
                uuid=f"GPU-{i}",
                index=i,
                name="H100",
                timestamp_s=t,
                utilization_gpu_pct=float(row[2].strip().rstrip("%")),
                memory_used_bytes=int(row[3].strip().split()[0]) * 2**20,
            )
            for i, row in enumerate(group)
        )
        snaps.append(Snapshot(t, gpus, None))
    return snaps


@pytest.mark.skipif(not H100_TRACE.exists(), reason="shared/traces not mounted")
def test_default_gpu_underused_reports_idle_stretches_of_the_h100_trace() -> None:
    snaps = read_h100_trace()
    engine = PolicyEngine(load_policies([default_policy_path()]))
    start, end = snaps[0].timestamp_s, snaps[-1].timestamp_s
    idle_gpus_at: dict[float, set[int]] = {}
    for s in snaps:
        found = engine.step(s).findings
        idle_gpus_at[s.timestamp_s - start] = {
            f.gpu_index
            for f in found
            if f.detector == "low_utilization" and f.gpu_index is not None
        }
    at_start = [gpus for t, gpus in idle_gpus_at.items() if 25 <= t <= 100]
    assert at_start and all(gpus == set(range(8)) for gpus in at_start)  # ~105 s idle start
    tail = [gpus for t, gpus in idle_gpus_at.items() if t >= end - start - 2]
    assert tail and all(gpus == set(range(8)) for gpus in tail)  # the ~30 s idle end
    busy = [gpus for t, gpus in idle_gpus_at.items() if 200 <= t <= 600]
    assert all(not (gpus & set(range(1, 8))) for gpus in busy)  # GPUs 1-7 train at ~100 %


def fleet(t: float, util: float, cpu: float, wait: float) -> Snapshot:
    gpus = tuple(
        GpuSample(
            uuid=f"GPU-{i:08d}-0000-0000",
            index=i,
            name="H100",
            timestamp_s=t,
            utilization_gpu_pct=util,
            memory_used_bytes=40 * GiB,
            memory_total_bytes=80 * GiB,
        )
        for i in range(8)
    )
    jobs = tuple(
        JobInfo(
            name=f"job{i}",
            pid=1000 + i,
            connected_at_s=0.0,
            cuda_devices=(str(i % 8),),
            knobs={
                "num_workers": Knob("num_workers", 4, 0, 64),
                "prefetch_factor": Knob("prefetch_factor", 2, 1, 64),
            },
            last_report=JobReport(t, 100, 1, 0.05, 0.05 * wait, wait, 1280.0),
        )
        for i in range(16)
    )
    return Snapshot(t, gpus, HostSample(t, cpu, 32, 100 * GiB, 256 * GiB), jobs)


@pytest.mark.parametrize(("util", "cpu", "wait"), [(55.0, 40.0, 0.1), (3.0, 97.0, 0.9)])
def test_one_step_with_8_gpus_16_jobs_default_policies_is_fast(
    util: float, cpu: float, wait: float
) -> None:
    engine = PolicyEngine(load_policies([default_policy_path()]))
    snaps = [fleet(1000.0 + t, util, cpu, wait) for t in range(400)]
    durations = []
    for s in snaps:
        started = time.perf_counter()
        result = engine.step(s)
        durations.append(time.perf_counter() - started)
    if util < 20:
        assert len(result.findings) == 8 + 1 + 16  # every GPU, the host, every job
    median_s = statistics.median(durations[100:])
    assert median_s < 2e-3, f"{median_s * 1e6:.0f} us per step"  # issue 2: far below 2 ms


def test_replay_throughput_gpu_samples_per_second() -> None:
    engine = PolicyEngine(load_policies([default_policy_path()]))
    snaps = [
        Snapshot(
            t * 0.1, tuple(gpu(i, util=0.0 if t % 600 < 300 else 95.0) for i in range(8)), None
        )
        for t in range(3000)
    ]
    best_s = float("inf")
    for _ in range(3):
        engine.reset()
        started = time.perf_counter()
        for s in snaps:
            engine.step(s)
        best_s = min(best_s, time.perf_counter() - started)
    rate = len(snaps) * 8 / best_s
    assert rate > 120_000, f"{rate:.0f} GPU-samples/s"  # ~300k on an idle core
