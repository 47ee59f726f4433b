"""Tests of the policy engine: findings -> decisions, cooldown, bounds, dry-run, reload, speed."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import pytest

from gpuwatchd.model import (
    NA,
    Decision,
    GpuSample,
    HostSample,
    JobEvent,
    JobInfo,
    JobReport,
    Knob,
    KnobValue,
    MaybeFloat,
    Snapshot,
)
from gpuwatchd.policy.engine import PolicyEngine
from gpuwatchd.policy.schema import PolicySet, parse_policies
from gpuwatchd.policyfiles import default_policy_path, load_policies

GiB = 2**30
TRACES = Path(__file__).resolve().parent / "data" / "traces"
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
    assert log.params == {
        "message": "host CPU 95.0 % > 90 % for 5s",
        "level": "warning",
        "subjects": ["host"],
    }
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


def test_no_decision_when_value_unchanged_and_the_log_only_narrates() -> None:
    engine = PolicyEngine(policies(HOST_POLICY))
    out = run(
        engine, [float(t) for t in range(7)], host_sample=host(cpu=95.0), jobs=[job("a", 1)]
    )  # already at the action's min 1
    assert out[5] == [] and out[6] == []  # nothing done, so nothing to narrate
    later = engine.step(snap(7.0, host_sample=host(cpu=95.0), jobs=[job("a", 1), job("b", 4)]))
    assert [(d.action, d.job) for d in later.decisions] == [("set_knob", "b"), ("log", None)]


def test_halving_zero_workers_decides_nothing() -> None:
    """Issue 10 item 2: the host rule on a job with 0 workers must not raise it to 1."""
    engine = PolicyEngine(load_policies([default_policy_path()]))
    out = run(engine, [float(t) for t in range(40)], host_sample=host(cpu=95.0), jobs=[job("a", 0)])
    knobs = [d for ds in out for d in ds if d.action in ("set_knob", "tune_loader")]
    assert all(d.params["value"] <= d.params["previous"] for d in knobs)  # type: ignore[operator]
    assert not [d for ds in out for d in ds if d.policy == "host-oversubscribed"]


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


def test_fleet_of_8_gpus_and_16_jobs_under_the_default_policies() -> None:
    """Every GPU, the host and every job are found; the host rule's tuner brings every job
    within its share of the 32 cores (2 workers each for 16 jobs) at once.

    (Speed is measured by bench scripts, not asserted here.)"""
    engine = PolicyEngine(load_policies([default_policy_path()]))
    for t in range(400):
        result = engine.step(fleet(1000.0 + t, util=3.0, cpu=97.0, wait=0.9))
        if t == 5:  # host_cpu_above for 5 s
            knobs = [d for d in result.decisions if d.action == "tune_loader"]
            assert sorted(d.job for d in knobs) == sorted(f"job{i}" for i in range(16))  # type: ignore[type-var]
            assert all(d.params["value"] == 2 and d.params["verdict"] == "bound" for d in knobs)
    assert len(result.findings) == 8 + 1 + 16  # every GPU, the host, every job


# -- scopes ---------------------------------------------------------------------------------


def attached(name: str, pid: int, devices: Sequence[str] = ()) -> JobInfo:
    return JobInfo(name=name, pid=pid, connected_at_s=0.0, cuda_devices=tuple(devices))


@pytest.mark.parametrize("named", [["0", "1"], ["GPU-0000", "GPU-0001"]], ids=["index", "uuid"])
def test_gpu_scope_pairs_job_findings_with_the_gpus_the_job_uses(named: list[str]) -> None:
    # the jobs name their GPU (CUDA_VISIBLE_DEVICES) by NVML index or by UUID
    text = """\
policies:
  - name: idle-and-starved
    scope: gpu
    when:
      low_utilization: {percent: 20, for: 0}
      data_starved: {fraction: 0.5, for: 0}
    do:
      - exec: {argv: [notify, "{subject}", "{gpu_index}", "{job}"], timeout: 5s}
"""
    engine = PolicyEngine(policies(text))
    jobs = [
        job("on0", wait=0.9, devices=[named[0]]),
        job("on1", wait=0.1, devices=[named[1]]),  # GPU 1 idle, but its job is not starved
    ]
    res = engine.step(snap(0.0, [gpu(0, util=5.0), gpu(1, util=5.0), gpu(2, util=90.0)], jobs=jobs))
    (decision,) = res.decisions
    assert decision.params == {"argv": ["notify", "gpu:GPU-0000", "0", ""], "timeout_s": 5.0}
    assert decision.gpu_uuid == "GPU-0000" and decision.job is None
    assert {f.detector for f in decision.findings} == {"low_utilization", "data_starved"}


def test_gpu_scope_groups_each_gpus_own_findings_with_the_hosts() -> None:
    # a GPU acts when every condition holds on it; a host finding concerns every GPU
    text = """\
policies:
  - name: full-and-idle
    scope: gpu
    when:
      vram_above: {percent: 90, for: 0}
      low_utilization: {percent: 20, for: 0}
      host_cpu_above: {percent: 50, for: 0}
    do:
      - exec: {argv: [echo, "{gpu_index}"]}
"""
    engine = PolicyEngine(policies(text))
    gpus = [
        gpu(0, util=5.0, used=79 * GiB),  # both GPU conditions
        gpu(1, util=90.0, used=79 * GiB),  # full, busy
        gpu(2, util=5.0),  # idle, not full
        gpu(3, util=5.0, used=79 * GiB),  # both
    ]
    res = engine.step(snap(0.0, gpus, host(cpu=95.0)))
    assert [d.params["argv"] for d in res.decisions] == [["echo", "0"], ["echo", "3"]]
    for decision, index in zip(res.decisions, (0, 3), strict=True):
        assert [(f.detector, f.gpu_index) for f in decision.findings] == [
            ("vram_above", index),
            ("low_utilization", index),
            ("host_cpu_above", None),
        ]
    calm = PolicyEngine(policies(text)).step(snap(0.0, gpus, host(cpu=10.0)))
    assert calm.decisions == ()  # the host condition does not hold: no GPU acts


def test_job_scope_pairs_gpu_findings_with_the_jobs_on_them() -> None:
    text = """\
policies:
  - name: full-gpu
    scope: job
    when:
      vram_above: {percent: 90, for: 0}
      host_cpu_below: {percent: 80, for: 0}
    do:
      - exec: {argv: [echo, "{job}"]}
"""
    engine = PolicyEngine(policies(text))
    jobs = [attached("a", 1, ["0"]), attached("b", 2, ["GPU-0001"]), attached("c", 3)]
    res = engine.step(snap(0.0, [gpu(0, used=79 * GiB), gpu(1)], host(cpu=10.0), jobs))
    assert [(d.job, d.params["argv"]) for d in res.decisions] == [
        ("a", ["echo", "a"]),
        ("c", ["echo", "c"]),  # no CUDA_VISIBLE_DEVICES: c sees every GPU
    ]
    assert all(d.params["timeout_s"] == 30.0 for d in res.decisions)


def test_global_scope_needs_each_condition_somewhere() -> None:
    text = """\
policies:
  - name: g
    scope: global
    when:
      low_utilization: {percent: 20, for: 0}
      vram_above: {percent: 90, for: 0}
    do: [{exec: {argv: [echo, "{subject}"]}}]
"""
    engine = PolicyEngine(policies(text))
    res = engine.step(snap(0.0, [gpu(0, util=5.0), gpu(1, used=79 * GiB)]))
    (decision,) = res.decisions  # different GPUs, but global scope only asks "anywhere"
    assert decision.params["argv"] == ["echo", "global"] and decision.gpu_uuid is None
    gpu_scoped = PolicyEngine(policies(text.replace("scope: global", "scope: gpu")))
    assert gpu_scoped.step(snap(0.0, [gpu(0, util=5.0), gpu(1, used=79 * GiB)])).decisions == ()


def test_log_is_one_decision_per_firing_in_gpu_scope() -> None:
    text = "policies:\n  - name: idle\n    when: {low_utilization: {for: 0}}\n    do: [log]\n"
    engine = PolicyEngine(policies(text))
    (log,) = engine.step(snap(0.0, [gpu(i, util=1.0) for i in range(4)])).decisions
    assert log.params["subjects"] == [f"gpu:GPU-000{i}" for i in range(4)]
    assert str(log.params["message"]).count("utilization.gpu") == 4


# -- rate limit ------------------------------------------------------------------------------


def test_rate_limit_caps_firings_per_window() -> None:
    text = """\
policies:
  - name: noisy
    when: {host_cpu_above: {percent: 90, for: 0}}
    do: [{exec: {argv: [/bin/true]}}]
    limit: {max: 3, per: 10s}
"""
    engine = PolicyEngine(policies(text))
    out = run(engine, [float(t) for t in range(25)], host_sample=host(cpu=95.0))
    fired = [t for t, ds in enumerate(out) if ds]
    assert fired == [0, 1, 2, 10, 11, 12, 20, 21, 22]  # at t=10 the firing at 0 is 10 s old


def test_rate_limit_counts_firings_not_targets() -> None:
    text = HOST_POLICY.replace("cooldown: 10s", "limit: {max: 1, per: 1h}")
    engine = PolicyEngine(policies(text))
    jobs = [job("a", 8), job("b", 8)]
    out = run(engine, [float(t) for t in range(8)], host_sample=host(cpu=95.0), jobs=jobs)
    assert [len(ds) for ds in out] == [0, 0, 0, 0, 0, 3, 0, 0]  # 2 set_knob + 1 log, once


# -- ladders -------------------------------------------------------------------------------

LADDER = """\
policies:
  - name: lower
    when: {vram_above: {percent: 95, for: 0}}
    do:
      - lower_parallelism: {mode: drain}
      - log: {level: warning}
    cooldown: 10s
  - name: raise
    when: {trials_succeeded_in_row: {count: 2}}
    do:
      - raise_parallelism: {}
"""


def full(t: float, *jobs: JobInfo, used: int = 79 * GiB) -> Snapshot:
    return snap(t, [gpu(0, used=used), gpu(1)], jobs=jobs)


def clean_trials(t: float, name: str, n: int) -> Snapshot:
    events = tuple(
        JobEvent(t, name, "trial", trial_number=i, trial_state="COMPLETE") for i in range(n)
    )
    return Snapshot(t, (gpu(0), gpu(1)), None, events=events)


def test_lower_parallelism_steps_down_to_the_floor_with_cooldown() -> None:
    engine = PolicyEngine(policies(LADDER), managed_jobs={"hpo": (4, 2), "other": (3, 1)})
    worker = attached("hpo", 10, ["0"])
    elsewhere = attached("other", 11, ["1"])  # on GPU 1, which is fine
    moves = []
    for t in range(0, 50):
        for d in engine.step(full(float(t), worker, elsewhere)).decisions:
            moves.append((t, d.action, d.job, dict(d.params)))
    assert moves == [
        (0, "lower_parallelism", "hpo", {"job": "hpo", "from": 4, "to": 3, "mode": "drain"}),
        (0, "log", None, moves[1][3]),
        (10, "lower_parallelism", "hpo", {"job": "hpo", "from": 3, "to": 2, "mode": "drain"}),
        (10, "log", None, moves[3][3]),
    ]  # min_workers 2 is the floor: no third step, and no log without an action
    assert engine.parallelism("hpo") == 2 and engine.parallelism("other") == 3
    assert engine.parallelism("nope") is None


def test_ladder_floor_and_ceiling_params_never_pass_the_config() -> None:
    text = """\
policies:
  - name: down
    when: {host_cpu_above: {percent: 90, for: 0}}
    do: [{lower_parallelism: {job: hpo, step: 5, floor: 1}}]
  - name: up
    when: {host_cpu_below: {percent: 10, for: 0}}
    do: [{raise_parallelism: {job: hpo, step: 5, ceiling: 9}}]
"""
    engine = PolicyEngine(policies(text), managed_jobs={"hpo": (6, 2)})
    (down,) = engine.step(snap(0.0, host_sample=host(cpu=95.0))).decisions
    assert down.params == {"job": "hpo", "from": 6, "to": 2, "mode": "drain"}  # min_workers wins
    (up,) = engine.step(snap(1.0, host_sample=host(cpu=5.0))).decisions
    assert up.params == {"job": "hpo", "from": 2, "to": 6, "mode": "now"}  # workers wins
    assert engine.step(snap(2.0, host_sample=host(cpu=5.0))).decisions == ()  # at the ceiling


def test_raise_after_clean_trials_and_unmanaged_jobs_are_never_targets() -> None:
    engine = PolicyEngine(policies(LADDER), managed_jobs={"hpo": (4, 1)})
    worker = attached("hpo", 10, ["0"])
    engine.step(full(0.0, worker, attached("rogue", 12, ["0"])))
    assert engine.parallelism("hpo") == 3
    res = engine.step(clean_trials(1.0, "hpo", 2))
    assert [dict(d.params) for d in res.decisions] == [
        {"job": "hpo", "from": 3, "to": 4, "mode": "now"}
    ]
    assert engine.step(clean_trials(2.0, "rogue", 2)).decisions == ()  # not a managed job
    assert engine.step(clean_trials(3.0, "hpo", 2)).decisions == ()  # at workers (ceiling)


def test_dry_run_decisions_do_not_move_the_ladder() -> None:
    engine = PolicyEngine(policies(LADDER), managed_jobs={"hpo": (4, 1)})
    engine.paused = True
    worker = attached("hpo", 10, ["0"])
    first = engine.step(full(0.0, worker)).decisions
    again = engine.step(full(10.0, worker)).decisions
    assert first[0].dry_run and again[0].dry_run
    assert first[0].params == again[0].params == {"job": "hpo", "from": 4, "to": 3, "mode": "drain"}
    assert engine.parallelism("hpo") == 4
    engine.paused = False
    (real, _log) = engine.step(full(20.0, worker)).decisions
    assert not real.dry_run and engine.parallelism("hpo") == 3


def test_vram_ladder_without_an_attached_worker_does_nothing() -> None:
    """Which GPU a managed job uses is known from its attached workers; without one the
    engine does not guess (a host finding, by contrast, concerns every managed job)."""
    engine = PolicyEngine(policies(LADDER), managed_jobs={"hpo": (4, 1)})
    assert engine.step(full(0.0)).decisions == ()


def test_managed_jobs_are_validated_and_can_change() -> None:
    with pytest.raises(ValueError, match="min_workers"):
        PolicyEngine(policies(LADDER), managed_jobs={"hpo": (2, 3)})
    engine = PolicyEngine(policies(LADDER), managed_jobs={"hpo": (4, 1)})
    engine.step(full(0.0, attached("hpo", 10, ["0"])))
    engine.set_managed_jobs({"hpo": (2, 1)})
    assert engine.parallelism("hpo") == 2  # position 3 read clamped into the new [1, 2]
    assert engine.managed_jobs == {"hpo": (2, 1)}


# -- placement, restarts ---------------------------------------------------------------------

PLACE = """\
policies:
  - name: place
    when: {idle_gpu: {percent: 10, busy_percent: 50, for: 1s}}
    do:
      - place_on_idle_gpu: {}
      - log
    cooldown: 1m
"""


def test_place_on_idle_gpu_names_the_gpu_for_every_managed_job() -> None:
    engine = PolicyEngine(policies(PLACE), managed_jobs={"a": (2, 1), "b": (2, 1)})
    gpus = [gpu(0, util=99.0), gpu(1, util=0.0)]
    assert engine.step(snap(0.0, gpus)).decisions == ()
    res = engine.step(snap(1.0, gpus))
    places = [d for d in res.decisions if d.action == "place_on_idle_gpu"]
    assert [(d.job, d.gpu_uuid, dict(d.params)) for d in places] == [
        ("a", "GPU-0001", {"job": "a", "gpu_index": 1, "gpu_uuid": "GPU-0001"}),
        ("b", "GPU-0001", {"job": "b", "gpu_index": 1, "gpu_uuid": "GPU-0001"}),
    ]
    assert [d.action for d in res.decisions][-1] == "log"
    assert engine.step(snap(2.0, gpus)).decisions == ()  # cooling down
    named = PolicyEngine(
        policies(PLACE.replace("{}", "{job: b}")), managed_jobs={"a": (2, 1), "b": (2, 1)}
    )
    named.step(snap(0.0, gpus))
    assert [d.job for d in named.step(snap(1.0, gpus)).decisions] == ["b", None]


CRASH = """\
policies:
  - name: crash
    when: {job_crashed: {kind: cuda_assert}}
    do:
      - restart_worker
      - restart_study: {max_retries: 2}
"""


def test_restart_decisions_carry_the_crash() -> None:
    engine = PolicyEngine(policies(CRASH), managed_jobs={"hpo": (3, 1)})
    events = (
        JobEvent(
            5.0, "hpo", "crash", pid=77, crash_kind="cuda_assert", gpu_index=1, trial_number=9
        ),
        JobEvent(5.0, "hpo", "crash", pid=78, crash_kind="cuda_oom", gpu_index=0),
        JobEvent(5.0, "unmanaged", "crash", pid=79, crash_kind="cuda_assert"),
    )
    res = engine.step(Snapshot(5.0, (gpu(0), gpu(1)), None, events=events))
    assert [(d.action, d.job, dict(d.params)) for d in res.decisions] == [
        (
            "restart_worker",
            "hpo",
            {
                "job": "hpo",
                "pid": 77,
                "crash_kind": "cuda_assert",
                "gpu_index": 1,
                "trial_number": 9,
            },
        ),
        (
            "restart_study",
            "hpo",
            {
                "job": "hpo",
                "pid": 77,
                "crash_kind": "cuda_assert",
                "gpu_index": 1,
                "trial_number": 9,
                "max_retries": 2,
            },
        ),
    ]
    # Every crash is a finding (journaled, `gpuwatchctl events`), each once, whether a
    # policy acts on it or not; the policy acts on the managed cuda_assert only.
    assert sorted(f.message.split(":")[0] for f in res.findings) == [
        "job hpo worker pid 77 crashed",
        "job hpo worker pid 78 crashed",
        "job unmanaged worker pid 79 crashed",
    ]
    assert "pid 77" in res.decisions[0].reason


# -- restart of the daemon: restore() ------------------------------------------------------


def test_restore_keeps_cooldown_limit_and_ladder_after_a_kill() -> None:
    text = LADDER.replace("cooldown: 10s", "cooldown: 10s\n    limit: {max: 2, per: 1h}")
    managed = {"hpo": (4, 1)}
    worker = attached("hpo", 10, ["0"])
    first = PolicyEngine(policies(text), managed_jobs=managed)
    journal = [d for t in range(5) for d in first.step(full(float(t), worker)).decisions]
    assert [d.params.get("to") for d in journal] == [3, None]
    # SIGKILL at t=5; a new process restores the journal and goes on at t=6
    second = PolicyEngine(policies(text), managed_jobs=managed)
    second.restore(journal)
    assert second.parallelism("hpo") == 3
    assert second.step(full(6.0, worker)).decisions == ()  # cooldown from t=0 holds
    (move, _log) = second.step(full(10.0, worker)).decisions
    assert move.params == {"job": "hpo", "from": 3, "to": 2, "mode": "drain"}  # not 4 -> 3
    assert second.step(full(20.0, worker)).decisions == ()  # limit 2 per hour reached
    third = PolicyEngine(policies(text), managed_jobs=managed)
    third.restore([*journal, move, _log])
    assert third.step(full(30.0, worker)).decisions == ()  # the limit survives a restart too
    assert third.parallelism("hpo") == 2


def test_restore_of_logs_uses_their_subjects() -> None:
    text = (
        "policies:\n  - name: idle\n    when: {low_utilization: {for: 0}}\n"
        "    do: [log]\n    cooldown: 1m\n"
    )
    first = PolicyEngine(policies(text))
    (log,) = first.step(snap(0.0, [gpu(0, util=1.0), gpu(1, util=99.0)])).decisions
    second = PolicyEngine(policies(text))
    second.restore([log])
    assert second.step(snap(1.0, [gpu(0, util=1.0), gpu(1, util=99.0)])).decisions == ()
    (news,) = second.step(snap(2.0, [gpu(0, util=1.0), gpu(1, util=1.0)])).decisions
    assert news.params["subjects"] == ["gpu:GPU-0001"]  # only GPU 1 is news


def test_reload_keeps_ladders_and_limit_history() -> None:
    text = LADDER.replace("cooldown: 10s", "limit: {max: 1, per: 1h}")
    engine = PolicyEngine(policies(text), managed_jobs={"hpo": (4, 1)})
    worker = attached("hpo", 10, ["0"])
    assert engine.step(full(0.0, worker)).decisions
    engine.reload(policies(text))
    assert engine.step(full(1.0, worker)).decisions == ()
    assert engine.parallelism("hpo") == 3
    engine.reset()
    assert engine.parallelism("hpo") == 4


# -- the packaged defaults ---------------------------------------------------------------------


def trouble(t: float, *, events: Sequence[JobEvent] = (), jobs: Sequence[JobInfo] = ()) -> Snapshot:
    """VRAM at 97 % on GPU 0, GPU 1 idle while GPU 0 is busy."""
    gpus = (gpu(0, util=99.0, used=78 * GiB), gpu(1, util=0.0, used=1 * GiB))
    return Snapshot(t, gpus, host(cpu=30.0), tuple(jobs), events=tuple(events))


def hpo_events(t: int) -> list[JobEvent]:
    out = [JobEvent(float(t), "hpo", "trial", trial_number=t, trial_state="COMPLETE")]
    if t == 100:
        out.append(JobEvent(float(t), "hpo", "crash", pid=42, crash_kind="cuda_assert"))
    return out


def test_default_rules_act_on_managed_jobs_only() -> None:
    worker = attached("hpo", 42, ["0", "1"])
    idle = PolicyEngine(load_policies([default_policy_path()]))
    acted = PolicyEngine(load_policies([default_policy_path()]), managed_jobs={"hpo": (3, 1)})
    actions: list[tuple[int, str, object]] = []
    for t in range(600):
        s = trouble(float(t), events=hpo_events(t), jobs=[worker])
        plain = idle.step(s)
        # without managed jobs only the log-only rules speak: nothing is changed
        assert {d.policy for d in plain.decisions} <= {"vram-near-limit", "gpu-underused"}
        for d in acted.step(s).decisions:
            if d.action != "log":
                actions.append((t, d.action, d.params.get("to", d.params.get("gpu_index"))))
    assert actions == [
        (30, "lower_parallelism", 2),  # 30 s above 95 %: 3 -> 2, then a 10 min cooldown
        (49, "raise_parallelism", 3),  # the 50th clean trial: back to 3 (= workers, ceiling)
        (100, "restart_study", None),  # the cuda_assert; trials at 99 and 150 find the ceiling
        (120, "place_on_idle_gpu", 1),  # GPU 1 idle for 2 min while GPU 0 is busy
    ]
