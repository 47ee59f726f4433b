"""Tests of the detectors: warm-up, for: durations, NA breaking streaks, scope, messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detector_params import Located, fail, make
from gpuwatchd.detectors import (
    DETECTORS,
    DataStarved,
    Detector,
    EventFinding,
    HostCpuAbove,
    HostCpuBelow,
    HostMemoryAbove,
    IdleGpu,
    JobCrashed,
    LowUtilization,
    TrialsSucceededInRow,
    VramAbove,
)
from gpuwatchd.model import (
    NA,
    Finding,
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
from gpuwatchd.windows import Windows

GiB = 2**30


def gpu(
    index: int,
    util: MaybeFloat = 50.0,
    used: MaybeInt = 10 * GiB,
    total: MaybeInt = 80 * GiB,
    error: str | None = None,
    pids: Sequence[int] = (),
) -> GpuSample:
    return GpuSample(
        uuid=f"GPU-{index:04d}",
        index=index,
        name="H100",
        timestamp_s=0.0,
        utilization_gpu_pct=util,
        memory_used_bytes=used,
        memory_total_bytes=total,
        processes=tuple(GpuProcess(pid) for pid in pids),
        error=error,
    )


def host(cpu: float = 10.0, mem_pct: float = 10.0) -> HostSample:
    return HostSample(
        timestamp_s=0.0,
        cpu_pct=cpu,
        cpu_count=8,
        memory_used_bytes=int(mem_pct * GiB),
        memory_total_bytes=100 * GiB,
    )


def job(name: str, wait: float, report_t: float) -> JobInfo:
    return JobInfo(
        name=name,
        pid=1,
        connected_at_s=0.0,
        last_report=JobReport(report_t, 1, 0, 0.1, 0.1 * wait, wait, 100.0),
    )


class Rig:
    """Windows plus detectors, stepped like the engine does (observe, then evaluate)."""

    def __init__(self, *detectors: Detector) -> None:
        self.detectors = detectors
        needs: dict[Any, float] = {}
        for d in detectors:
            for key, horizon in d.needs().items():
                needs[key] = max(horizon, needs.get(key, 0.0))
        self.windows = Windows(needs)

    def step(
        self,
        t: float,
        gpus: Sequence[GpuSample] = (),
        host_sample: HostSample | None = None,
        jobs: Sequence[JobInfo] = (),
        events: Sequence[JobEvent] = (),
    ) -> list[Finding]:
        self.windows.observe(
            Snapshot(t, tuple(gpus), host_sample, tuple(jobs), events=tuple(events))
        )
        return [f for d in self.detectors for f in d.evaluate(self.windows)]


def test_registry_names_every_detector() -> None:
    assert set(DETECTORS) == {
        "vram_above",
        "low_utilization",
        "idle_gpu",
        "allocated_but_idle",
        "host_cpu_above",
        "host_cpu_below",
        "host_memory_above",
        "data_starved",
        "job_crashed",
        "trials_succeeded_in_row",
        "worker_given_up",
        "job_stalled",
        "xid",
        "ecc_dbe",
        "row_remap",
        "gpu_lost",
        "gpu_throttled",
        "gpu_recovered",
    }
    for name, cls in DETECTORS.items():
        assert cls.name == name and cls.description
        # window detectors need for:, event detectors fire once per event and have none
        assert any(p.name == "for" for p in cls.params) == (not cls.event)
        for param in cls.params:
            assert param.help and param.unit


def test_defaults() -> None:
    assert IdleGpu.parse_params(None, fail) == {
        "percent": 10.0,
        "busy_percent": 50.0,
        "no_process": False,
        "for": 120.0,
    }
    assert IdleGpu.parse_params({"no_process": True}, fail) == {"no_process": True, "for": 120.0}
    assert JobCrashed.parse_params(None, fail) == {"kind": ("any",)}
    assert JobCrashed.parse_params({"kind": ["cuda_oom", "cuda_assert"]}, fail) == {
        "kind": ("cuda_assert", "cuda_oom")
    }
    assert TrialsSucceededInRow.parse_params(None, fail) == {"count": 50}
    assert VramAbove.parse_params({"bytes": "70GiB", "clear": "60GiB"}, fail) == {
        "bytes": 70 * GiB,
        "clear": 60 * GiB,
        "for": 30.0,
    }
    assert LowUtilization.parse_params(None, fail) == {"percent": 20.0, "for": 300.0}
    assert VramAbove.parse_params({}, fail) == {"percent": 90.0, "for": 30.0}
    assert HostCpuAbove.parse_params({}, fail) == {"percent": 90.0, "for": 30.0}
    assert HostMemoryAbove.parse_params({}, fail) == {"percent": 90.0, "for": 30.0}
    assert DataStarved.parse_params({}, fail) == {"fraction": 0.5, "for": 60.0}
    assert VramAbove.parse_params({"bytes": "20GiB"}, fail) == {"bytes": 20 * GiB, "for": 30.0}


@pytest.mark.parametrize(
    ("cls", "raw", "key", "text"),
    [
        (VramAbove, {"percent": 90, "bytes": "20GiB"}, "bytes", "only one of percent, bytes"),
        (LowUtilization, {"percent": 120}, "percent", "outside 0..100"),
        (LowUtilization, {"for": "30 parsecs"}, "for", "unknown duration unit"),
        (LowUtilization, {"threshold": 3}, "threshold", "unknown parameter 'threshold'"),
        (DataStarved, {"fraction": 2}, "fraction", "outside 0..1"),
        (VramAbove, {"percent": 95, "clear": 97}, "clear", "clear (97) must not be above"),
        (VramAbove, {"bytes": "70GiB", "clear": "80GiB"}, "clear", "must not be above bytes"),
        (VramAbove, {"percent": 95, "clear": "60GiB"}, "clear", "unit of the threshold"),
        (LowUtilization, {"percent": 20, "clear": 10}, "clear", "must not be below percent"),
        (DataStarved, {"fraction": 0.5, "clear": 0.6}, "clear", "must not be above fraction"),
        (IdleGpu, {"percent": 50, "busy_percent": 40}, "busy_percent", "must be above percent"),
        (IdleGpu, {"no_process": True, "percent": 5}, "percent", "does not apply"),
        (IdleGpu, {"no_process": "yes"}, "no_process", "expected true or false"),
        (JobCrashed, {"kind": "segfault"}, "kind", "expected one of cuda_assert"),
        (JobCrashed, {"kind": []}, "kind", "non-empty list"),
        (TrialsSucceededInRow, {"count": 0}, "count", "integer >= 1"),
        (TrialsSucceededInRow, {"for": "1m"}, "for", "unknown parameter 'for'"),
    ],
)
def test_bad_params_name_the_key(
    cls: type[Detector], raw: dict[str, object], key: str, text: str
) -> None:
    with pytest.raises(Located) as err:
        cls.parse_params(raw, fail)
    assert err.value.key == key
    assert text in str(err.value)


def test_warm_up_then_fires_at_exactly_for() -> None:
    rig = Rig(make(LowUtilization, {"percent": 20, "for": "30s"}))
    for t in range(30):
        assert rig.step(float(t), [gpu(3, util=0.0)]) == [], f"fired during warm-up at {t}s"
    (finding,) = rig.step(30.0, [gpu(3, util=0.0)])
    assert finding.detector == "low_utilization"
    assert finding.subject == "gpu:GPU-0003"
    assert finding.gpu_uuid == "GPU-0003" and finding.gpu_index == 3 and finding.job is None
    assert finding.since_s == 0.0 and finding.timestamp_s == 30.0
    assert finding.threshold == 20.0 and finding.value == 0.0
    assert finding.message == "GPU 3 utilization.gpu 0.0 % < 20 % for 30s"


def test_keeps_reporting_while_it_holds_with_window_mean() -> None:
    rig = Rig(make(LowUtilization, {"percent": 20, "for": "5m"}))
    found = []
    for t in range(0, 400):
        util = 10.0 if t < 200 else 0.0
        found.append(rig.step(float(t), [gpu(3, util=util)]))
    assert all(not f for f in found[:300])
    assert all(len(f) == 1 for f in found[300:])  # one finding per evaluation while it holds
    last = found[-1][0]
    assert last.since_s == 0.0
    # mean over [99, 399]: 101 samples of 10 % and 200 of 0 %
    assert last.value == pytest.approx(10.0 * 101 / 301)
    assert last.message == f"GPU 3 utilization.gpu {last.value:.1f} % < 20 % for 5m00s"


def test_threshold_is_strict() -> None:
    rig = Rig(
        make(LowUtilization, {"percent": 20, "for": 0}),
        make(HostCpuAbove, {"percent": 90, "for": 0}),
    )
    assert rig.step(0.0, [gpu(0, util=20.0)], host(cpu=90.0)) == []
    found = rig.step(1.0, [gpu(0, util=19.9)], host(cpu=90.1))
    assert {f.detector for f in found} == {"low_utilization", "host_cpu_above"}


def test_na_sample_breaks_the_streak() -> None:
    rig = Rig(make(LowUtilization, {"percent": 20, "for": "10s"}))
    for t in range(10):
        rig.step(float(t), [gpu(0, util=0.0)])
    rig.step(10.0, [gpu(0, util=NA, error="Unknown Error")])  # a lost sample is not 0 %
    for t in range(11, 21):
        assert rig.step(float(t), [gpu(0, util=0.0)]) == []
    (finding,) = rig.step(21.0, [gpu(0, util=0.0)])
    assert finding.since_s == 11.0


def test_missing_subject_breaks_the_streak() -> None:
    rig = Rig(make(LowUtilization, {"percent": 20, "for": "5s"}))
    for t in range(4):
        rig.step(float(t), [gpu(0, util=0.0), gpu(1, util=0.0)])
    rig.step(4.0, [gpu(1, util=0.0)])  # GPU 0 vanished for one tick
    found = rig.step(5.0, [gpu(0, util=0.0), gpu(1, util=0.0)])
    assert [f.gpu_index for f in found] == [1]


def test_value_back_over_threshold_breaks_the_streak() -> None:
    rig = Rig(make(HostCpuAbove, {"percent": 90, "for": "15s"}))
    for t in range(14):
        rig.step(float(t), host_sample=host(cpu=95.0))
    rig.step(14.0, host_sample=host(cpu=50.0))
    for t in range(15, 30):
        assert rig.step(float(t), host_sample=host(cpu=95.0)) == []
    (finding,) = rig.step(30.0, host_sample=host(cpu=95.0))
    assert finding.subject == "host" and finding.gpu_uuid is None and finding.job is None
    assert finding.message == "host CPU 95.0 % > 90 % for 15s"


def test_scope_is_per_gpu() -> None:
    rig = Rig(make(LowUtilization, {"for": "2s"}))
    for t in range(3):
        found = rig.step(float(t), [gpu(0, util=5.0), gpu(1, util=99.0), gpu(2, util=1.0)])
    assert sorted(f.gpu_index for f in found) == [0, 2]  # type: ignore[type-var]


def test_vram_percent_and_bytes() -> None:
    pct = make(VramAbove, {"percent": 95, "for": 0})
    size = make(VramAbove, {"bytes": "70GiB", "for": 0})
    rig = Rig(pct, size)
    found = rig.step(0.0, [gpu(0, used=78 * GiB), gpu(1, used=60 * GiB)])
    assert [(f.gpu_index, f.detector) for f in found] == [(0, "vram_above"), (0, "vram_above")]
    assert found[0].message == "GPU 0 memory.used 97.5 % > 95 %"
    assert found[1].message == "GPU 0 memory.used 78.0 GiB > 70.0 GiB"
    assert found[1].threshold == 70 * GiB


def test_vram_percent_needs_memory_total() -> None:
    rig = Rig(make(VramAbove, {"percent": 50, "for": 0}))
    assert rig.step(0.0, [gpu(0, used=79 * GiB, total=NA)]) == []


def test_host_memory() -> None:
    rig = Rig(make(HostMemoryAbove, {"percent": 90, "for": "1s"}))
    rig.step(0.0, host_sample=host(mem_pct=95.0))
    (finding,) = rig.step(1.0, host_sample=host(mem_pct=95.0))
    assert finding.message == "host memory 95.0 % > 90 % for 1s"


def test_data_starved_per_job_and_stale_reports() -> None:
    rig = Rig(make(DataStarved, {"fraction": 0.5, "for": "3s"}))
    for t in range(4):
        found = rig.step(float(t), jobs=[job("starved", 0.8, t - 0.1), job("fine", 0.1, t - 0.1)])
    (finding,) = found
    assert finding.job == "starved" and finding.subject == "job:starved"
    assert finding.gpu_uuid is None
    assert finding.message == "job starved data-wait fraction 0.80 > 0.5 for 3s"
    # the job stops reporting: after job_report_stale_s its old report is no evidence
    now = 4.0
    while rig.step(now, jobs=[job("starved", 0.8, 2.9)]):
        now += 1.0
    assert now == 34.0  # report first seen at 3 s, no evidence once unchanged for over 30 s


def test_reset_forgets_streaks() -> None:
    det = make(LowUtilization, {"for": "2s"})
    rig = Rig(det)
    for t in range(3):
        rig.step(float(t), [gpu(0, util=0.0)])
    assert det.streaks() == {"gpu:GPU-0000": 0.0}
    det.reset()
    assert rig.step(3.0, [gpu(0, util=0.0)]) == []


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=80),
    for_ticks=st.integers(0, 60),
)
def test_a_condition_shorter_than_for_never_fires(
    data: list[tuple[int, bool]], for_ticks: int
) -> None:
    """Timestamps in 100 ms ticks (random steps); the detector fires at t exactly when the
    unbroken run of satisfying samples ending at t spans at least for:."""
    for_s = for_ticks / 10
    rig = Rig(make(HostCpuAbove, {"percent": 90, "for": for_s}))
    tick = 0
    run_start: int | None = None
    for step, above in data:
        tick += step
        t = tick / 10
        found = rig.step(t, host_sample=host(cpu=95.0 if above else 10.0))
        run_start = (tick if run_start is None else run_start) if above else None
        holds = run_start is not None and tick - run_start >= for_ticks
        assert bool(found) == holds, (t, run_start, for_s)
        if found:
            assert found[0].since_s == run_start / 10  # type: ignore[operator]


def test_host_cpu_below_holds_only_while_the_host_has_cores_to_spare() -> None:
    rig = Rig(make(HostCpuBelow, {"percent": 80, "for": "2s"}))
    verdicts = [
        bool(rig.step(float(t), host_sample=host(cpu=cpu)))
        for t, cpu in enumerate([50.0, 60.0, 70.0, 95.0, 40.0, 40.0, 40.0])
    ]
    # Holds once 2 s below 80 % are covered, breaks at 95 %, holds again 2 s later.
    assert verdicts == [False, False, True, False, False, False, True]
    (finding,) = rig.step(7.0, host_sample=host(cpu=40.0))
    assert finding.message == "host CPU 40.0 % < 80 % for 2s"


# -- hysteresis -------------------------------------------------------------------------


def test_hysteresis_holds_until_the_value_crosses_clear_then_needs_a_full_for() -> None:
    rig = Rig(make(VramAbove, {"percent": 95, "clear": 90, "for": "3s"}))
    pct = [96, 96, 96, 96, 93, 91, 96, 90.5, 90, 96, 96, 96, 96]
    fired = [
        bool(rig.step(float(t), [gpu(0, used=int(p / 100 * 80 * GiB))])) for t, p in enumerate(pct)
    ]
    # t0-2 warm-up, t3 fires; 93 and 91 stay above clear 90 so it keeps holding (as does
    # 96 and 90.5); 90 is not above clear: it clears; then a new full 3 s is needed.
    assert fired == [
        *[False, False, False, True],  # warm-up, then it fires
        *[True, True, True, True],  # 93, 91, 96, 90.5: all above clear
        *[False, False, False, False, True],  # 90 clears it; 3 s more for a new verdict
    ]


def test_hysteresis_does_not_apply_before_firing() -> None:
    rig = Rig(make(VramAbove, {"percent": 95, "clear": 90, "for": "3s"}))
    pct = [96, 96, 93, 96, 96, 96, 96]  # 93 during warm-up breaks the streak: not firing yet
    fired = [
        bool(rig.step(float(t), [gpu(0, used=int(p / 100 * 80 * GiB))])) for t, p in enumerate(pct)
    ]
    assert fired == [False, False, False, False, False, False, True]


def test_hysteresis_message_and_na_clears() -> None:
    rig = Rig(make(HostCpuAbove, {"percent": 90, "clear": 70, "for": "1s"}))
    rig.step(0.0, host_sample=host(cpu=95.0))
    (first,) = rig.step(1.0, host_sample=host(cpu=95.0))
    assert first.message == "host CPU 95.0 % > 90 % for 1s"
    (held,) = rig.step(2.0, host_sample=host(cpu=75.0))
    assert held.message == "host CPU 85.0 % > 70 % (clear level; fired at > 90 % for 1s)"
    assert held.since_s == 0.0 and held.threshold == 90.0
    rig.step(3.0)  # no host sample this tick: the subject is missing, the streak breaks
    assert rig.step(4.0, host_sample=host(cpu=75.0)) == []  # 75 is no longer enough


def test_low_utilization_clear_is_above_the_threshold() -> None:
    det = make(LowUtilization, {"percent": 20, "clear": 30, "for": 0})
    rig = Rig(det)
    utils = [10.0, 25.0, 29.9, 30.0, 25.0, 19.0]
    fired = [bool(rig.step(float(t), [gpu(0, util=u)])) for t, u in enumerate(utils)]
    assert fired == [True, True, True, False, False, True]


# -- idle_gpu -------------------------------------------------------------------------


def test_idle_gpu_fires_for_the_idle_gpu_only_while_another_is_busy() -> None:
    rig = Rig(make(IdleGpu, {"percent": 10, "busy_percent": 50, "for": "3s"}))
    found = []
    for t in range(5):
        found = rig.step(float(t), [gpu(0, util=98.0), gpu(1, util=10.0), gpu(2, util=11.0)])
        assert bool(found) == (t >= 3)
    (finding,) = found  # GPU 2 at 11 % is not idle; 10 % is ("at or below")
    assert finding.detector == "idle_gpu" and finding.gpu_index == 1
    assert finding.subject == "gpu:GPU-0001" and finding.since_s == 0.0
    assert finding.message == (
        "GPU 1 utilization.gpu 10.0 % <= 10 % while GPU 0 is at 98.0 % >= 50 % for 3s"
    )


def test_idle_gpu_all_idle_is_not_a_placement_problem() -> None:
    rig = Rig(make(IdleGpu, {"for": 0}))
    assert rig.step(0.0, [gpu(0, util=0.0), gpu(1, util=0.0)]) == []  # the job is paused
    assert rig.step(1.0, [gpu(0, util=0.0)]) == []  # one GPU: never "another"
    found = rig.step(2.0, [gpu(0, util=50.0), gpu(1, util=0.0), gpu(2, util=50.0)])
    assert [f.gpu_index for f in found] == [1]  # busy is inclusive too


def test_idle_gpu_busy_gpu_itself_counts_the_runner_up() -> None:
    rig = Rig(make(IdleGpu, {"percent": 60, "busy_percent": 70, "for": 0}))
    found = rig.step(0.0, [gpu(0, util=55.0), gpu(1, util=80.0), gpu(2, util=30.0)])
    assert sorted(f.gpu_index for f in found) == [0, 2]  # type: ignore[type-var]
    found = rig.step(1.0, [gpu(0, util=55.0), gpu(1, util=60.0)])
    assert found == []  # nobody at 70 %: GPU 1 cannot be idle "while itself is busy"


def test_idle_gpu_streak_breaks_on_na_of_either_side() -> None:
    rig = Rig(make(IdleGpu, {"for": "2s"}))
    for t in range(2):
        rig.step(float(t), [gpu(0, util=99.0), gpu(1, util=0.0)])
    rig.step(2.0, [gpu(0, util=NA, error="GPU is lost"), gpu(1, util=0.0)])  # busy side unknown
    assert rig.step(3.0, [gpu(0, util=99.0), gpu(1, util=0.0)]) == []
    assert rig.step(4.0, [gpu(0, util=99.0), gpu(1, util=0.0)]) == []
    assert rig.step(5.0, [gpu(0, util=99.0), gpu(1, util=0.0)])
    rig.step(6.0, [gpu(0, util=99.0), gpu(1, util=NA)])  # idle side unknown: not 0 %
    assert rig.step(7.0, [gpu(0, util=99.0), gpu(1, util=0.0)]) == []


def test_idle_gpu_no_process_form() -> None:
    rig = Rig(make(IdleGpu, {"no_process": True, "for": "1s"}))
    # NVML lists no process anywhere (a container, a replayed trace): never fires
    for t in range(3):
        assert rig.step(float(t), [gpu(0, util=99.0), gpu(1, util=0.0)]) == []
    rig.step(3.0, [gpu(0, pids=[11, 12]), gpu(1)])
    (finding,) = rig.step(4.0, [gpu(0, pids=[11, 12]), gpu(1)])
    assert finding.gpu_index == 1 and finding.value == 0.0
    assert finding.message == "GPU 1 has no compute process while GPU 0 has 2 for 1s"
    # an NVML error on GPU 1 is not "no process"
    assert rig.step(5.0, [gpu(0, pids=[11]), gpu(1, util=NA, error="Unknown Error")]) == []


# -- event detectors ----------------------------------------------------------------------


def crash(
    job_name: str,
    kind: str | None,
    pid: int = 4242,
    gpu_index: int | None = 1,
    timestamp_s: float = 0.0,
) -> JobEvent:
    return JobEvent(
        timestamp_s=timestamp_s,
        job=job_name,
        kind="crash",
        pid=pid,
        crash_kind=kind,
        gpu_index=gpu_index,
        trial_number=17,
        message="device-side assert triggered",
    )


def trial(job_name: str, state: str, number: int = 0) -> JobEvent:
    return JobEvent(0.0, job_name, "trial", trial_number=number, trial_state=state)


def test_job_crashed_fires_once_per_matching_event() -> None:
    rig = Rig(make(JobCrashed, {"kind": ["cuda_assert", "cuda_oom"]}))
    events = [
        crash("hpo", "cuda_assert"),
        crash("hpo", "host_oom"),
        crash("b", "cuda_oom", 7, None),
    ]
    found = rig.step(10.0, events=events)
    assert [(f.job, f.subject) for f in found] == [("hpo", "job:hpo"), ("b", "job:b")]
    first = found[0]
    assert isinstance(first, EventFinding) and first.event == events[0]
    assert first.gpu_index == 1 and first.timestamp_s == first.since_s == 10.0
    assert first.message == (
        "job hpo worker pid 4242 crashed: cuda_assert on GPU 1 in trial 17 "
        "(device-side assert triggered)"
    )
    assert rig.step(11.0) == []  # no for:, no memory: the next tick is quiet


def test_job_crashed_any_and_unknown_kind_is_other() -> None:
    rig = Rig(make(JobCrashed, {"kind": "other"}), make(JobCrashed, {}))
    events = [crash("a", None, 1), crash("a", "segfault", 2), crash("a", "cuda_oom", 3)]
    found = rig.step(0.0, events=events)
    assert len(found) == 2 + 3  # kind other: the None and the unknown; any: all three
    ignored = [JobEvent(0.0, "a", "oom"), trial("a", "FAIL")]
    assert rig.step(1.0, events=ignored) == []


def test_job_crashed_reports_one_death_once() -> None:
    # The hook's exception and the supervisor's exit status both report pid 4242's death.
    rig = Rig(make(JobCrashed, {}))
    from_hook = crash("hpo", "cuda_assert", 4242, timestamp_s=100.0)
    from_supervisor = crash("hpo", "cuda_assert", 4242, timestamp_s=100.4)
    assert len(rig.step(100.0, events=[from_hook])) == 1
    assert rig.step(101.0, events=[from_supervisor]) == []
    # Another worker, or the same pid reused long after, is a new death.
    assert len(rig.step(102.0, events=[crash("hpo", "cuda_oom", 4243, timestamp_s=102.0)])) == 1
    assert len(rig.step(300.0, events=[crash("hpo", "other", 4242, timestamp_s=300.0)])) == 1


def test_trials_succeeded_in_row_counts_resets_and_restarts() -> None:
    det = make(TrialsSucceededInRow, {"count": 3})
    assert isinstance(det, TrialsSucceededInRow)
    rig = Rig(det)
    assert rig.step(0.0, events=[trial("a", "COMPLETE", 1), trial("a", "PRUNED", 2)]) == []
    assert rig.step(1.0, events=[trial("a", "FAIL", 3)]) == []  # a FAIL resets
    assert rig.step(2.0, events=[trial("a", "COMPLETE", i) for i in (4, 5)]) == []
    assert rig.step(3.0, events=[crash("a", "cuda_oom")]) == []  # so does a crash
    assert rig.step(4.0, events=[trial("b", "COMPLETE", 1), JobEvent(4.0, "a", "oom")]) == []
    found = rig.step(5.0, events=[trial("a", "COMPLETE", i) for i in range(6, 13)])
    # 7 clean trials in one tick: fires at the 3rd and the 6th, then counts 1 again
    assert len(found) == 2 and all(f.subject == "job:a" and f.value == 3 for f in found)
    assert (
        found[0].message == "job a: 3 trials in a row COMPLETE or PRUNED (last: trial 8 COMPLETE)"
    )
    assert det.counts() == {"a": 1, "b": 1}
    det.on_gap()  # a pause between snapshots loses no events: counts stay
    assert det.counts() == {"a": 1, "b": 1}
    det.reset()
    assert det.counts() == {}


def test_gap_breaks_window_streaks() -> None:
    det = make(LowUtilization, {"for": "2s"})
    rig = Rig(det)
    for t in range(3):
        rig.step(float(t), [gpu(0, util=0.0)])
    det.on_gap()
    assert det.streaks() == {}
    assert rig.step(3.0, [gpu(0, util=0.0)]) == []


# -- statistic: mean (one finding per sustained condition) ----------------------------

# A rank that idles while its peers compute, with a 2 s burst every 10 s (the 8 x H100
# trace's GPU 0): every-sample windows break at each burst; the window mean does not.
BURSTY = [90.0 if t % 10 in (8, 9) else 2.0 for t in range(60)]


def test_low_utilization_every_sample_splits_a_bursty_idle_stretch() -> None:
    rig = Rig(make(LowUtilization, {"percent": 20, "for": "5s"}))
    starts = 0
    firing = False
    for t, u in enumerate(BURSTY):
        now = bool(rig.step(float(t), [gpu(0, util=u)]))
        starts += now and not firing
        firing = now
    assert starts == 6  # one finding per 10 s cycle: the defect of issue 10


def test_low_utilization_mean_keeps_one_finding_through_bursts_and_clears_with_hysteresis() -> None:
    det = make(LowUtilization, {"percent": 20, "clear": 40, "for": "20s", "statistic": "mean"})
    rig = Rig(det)
    found: list[list[Finding]] = []
    for t, u in enumerate([*BURSTY, *[100.0] * 20]):
        found.append(rig.step(float(t), [gpu(0, util=u)]))
    firing = [bool(f) for f in found]
    assert firing[:19] == [False] * 19  # the window must span 20 s first
    starts = sum(1 for a, b in zip([False, *firing], firing, strict=False) if b and not a)
    assert starts == 1  # one finding from 19 s on, through every burst
    last = max(t for t, f in enumerate(firing) if f)
    assert 60 < last < 80  # cleared once the 20 s mean reached 40 % after training resumed
    held = found[last][0]
    assert held.since_s == 0.0 and held.value >= 20.0  # held above the threshold: hysteresis
    assert held.message.endswith("(clear level; fired at < 20 % (mean over 20s))")
    # 20 s window at 30 s: samples 10..30, four of them in bursts at 90 %
    assert found[30][0].message == "GPU 0 utilization.gpu 18.8 % < 20 % (mean over 20s)"


def test_idle_gpu_mean_names_the_gpu_and_its_peers_figures() -> None:
    det = make(
        IdleGpu,
        {"percent": 20, "clear": 30, "busy_percent": 50, "for": "20s", "statistic": "mean"},
    )
    rig = Rig(det)
    starts = 0
    firing = False
    at_30: list[Finding] = []
    for t, u in enumerate(BURSTY):
        found = rig.step(float(t), [gpu(0, util=u), gpu(1, util=97.0), gpu(2, util=99.0)])
        starts += bool(found) and not firing
        firing = bool(found)
        at_30 = found if t == 30 else at_30
    assert starts == 1 and firing
    (finding,) = at_30
    assert finding.gpu_index == 0 and finding.since_s == 0.0
    assert finding.message == (
        "GPU 0 utilization.gpu 18.8 % <= 20 % (mean over 20s) while 2 of its 2 peers are "
        "busy: mean 98.0 %, lowest 97.0 % >= 50 %"
    )


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"statistic": "median"}, "statistic"),
        ({"no_process": True, "statistic": "mean"}, "statistic"),
        ({"clear": 20}, "clear"),  # clear needs statistic: mean
        ({"statistic": "mean", "percent": 10, "clear": 5}, "clear"),
        ({"statistic": "mean", "busy_percent": 50, "clear": 60}, "clear"),
    ],
)
def test_idle_gpu_statistic_params_are_checked(raw: dict[str, object], key: str) -> None:
    with pytest.raises(Located) as info:
        IdleGpu.parse_params(raw, fail)
    assert info.value.key == key
