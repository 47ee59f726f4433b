"""The loader tuner (``tune_loader``) on scripted throughput series: no sockets, no timing.

A simulated job runs at the samples/s its ``num_workers`` gives in a script, applies a knob
change at its next epoch like the hook does, and reports every half second.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gpuwatchd.model import HostSample, JobInfo, JobReport, Knob, Snapshot
from gpuwatchd.policy.engine import PolicyEngine
from gpuwatchd.policy.schema import parse_policies
from gpuwatchd.policy.tuner import LoaderTuner, TunerStep, TuneSettings
from gpuwatchd.policyfiles import default_policy_path, load_policies

BATCH = 32
EPOCH_STEPS = 20
TICK_S = 0.5


class SimJob:
    """A job whose throughput (samples/s) is ``rate(num_workers)``."""

    def __init__(self, name: str, workers: int, rate: Callable[[int], float], hi: int = 64):
        self.name, self.workers, self.rate, self.hi = name, workers, rate, hi
        self.pending: int | None = None
        self.steps = 0.0
        self.applied_at: float | None = None
        self.wait = 0.1  # data-wait fraction reported

    def advance(self, t: float) -> None:
        before = int(self.steps) // EPOCH_STEPS
        self.steps += self.rate(self.workers) * TICK_S / BATCH
        if int(self.steps) // EPOCH_STEPS > before and self.pending is not None:
            self.workers, self.pending, self.applied_at = self.pending, None, t

    def info(self, t: float) -> JobInfo:
        rate = self.rate(self.workers)
        report = JobReport(
            t, int(self.steps), int(self.steps) // EPOCH_STEPS, BATCH / rate, 0.0, self.wait, rate
        )
        knob = Knob("num_workers", self.workers, 0, self.hi, applied_at_s=self.applied_at)
        return JobInfo(self.name, 1, 0.0, knobs={"num_workers": knob}, last_report=report)


def host(t: float, cpu: float = 50.0, cores: int = 16) -> HostSample:
    return HostSample(t, cpu, cores, 1 << 30, 1 << 34)


def drive(
    tuner: LoaderTuner,
    jobs: list[SimJob],
    seconds: float,
    t0: float = 0.0,
    cpu: Callable[[float], float] = lambda t: 50.0,
    cores: int = 16,
) -> list[TunerStep]:
    """Run ``seconds`` of simulated time; apply each move at the job's next epoch."""
    out: list[TunerStep] = []
    t = t0
    while t < t0 + seconds:
        t += TICK_S
        for job in jobs:
            job.advance(t)
        snap = Snapshot(t, (), host(t, cpu(t), cores), tuple(j.info(t) for j in jobs))
        for step in tuner.step(snap):
            out.append(step)
            job = next(j for j in jobs if j.name == step.job)
            if step.value != step.previous:
                job.pending = step.value
    return out


def start(tuner: LoaderTuner, job: SimJob, saturated: bool = False, **kw: object) -> None:
    settings = TuneSettings.from_params({"knob": "num_workers", **kw})
    assert tuner.start(
        job.info(0.0), settings, policy="p", dry_run=False, reason="test", saturated=saturated
    )


def peak_at(best: int, table: Mapping[int, float] | None = None) -> Callable[[int], float]:
    return lambda w: (table or {}).get(w, 1000.0 - 100.0 * abs(w - best))


def moves(steps: list[TunerStep]) -> list[tuple[int, int, str]]:
    return [(s.previous, s.value, s.verdict) for s in steps]


def test_climbs_while_it_helps_and_backs_off_a_worse_step() -> None:
    tuner = LoaderTuner()
    job = SimJob("a", 1, peak_at(4))
    start(tuner, job)
    steps = drive(tuner, [job], 120.0)
    assert moves(steps) == [(1, 2, "start"), (2, 4, "better"), (4, 8, "better"), (8, 4, "worse")]
    assert job.workers == 4 and tuner.sessions == {"a": "holding"}
    last = steps[-1]  # the outcome of the worse step is measured, not guessed
    assert last.samples_per_s_before is not None and last.samples_per_s_after is not None
    assert last.samples_per_s_after < last.samples_per_s_before
    assert abs(last.samples_per_s_after - 600.0) < 30.0  # 8 workers in the script
    assert abs(last.samples_per_s_before - 1000.0) < 30.0  # 4 workers
    assert "samples/s by num_workers: 1: " in last.message


def test_goes_down_on_a_saturated_host_and_turns_after_a_worse_first_step() -> None:
    tuner = LoaderTuner()
    job = SimJob("a", 8, peak_at(2))
    start(tuner, job, saturated=True)
    assert moves(drive(tuner, [job], 120.0)) == [
        (8, 4, "start"),
        (4, 2, "better"),
        (2, 1, "better"),
        (1, 2, "worse"),
    ]
    assert job.workers == 2
    tuner = LoaderTuner()
    job = SimJob("b", 2, peak_at(4))  # down is worse first: it turns around
    start(tuner, job, direction="down")
    steps = moves(drive(tuner, [job], 120.0))
    # the worse first step is checked one further (1 -> 0), then it turns around
    assert steps[:3] == [(2, 1, "start"), (1, 0, "further"), (0, 4, "worse")]
    assert job.workers == 4


def test_a_worse_first_step_is_checked_one_step_further() -> None:
    # bench/efficacy.py's job on 2 cores: 1 worker is slower than both 0 and 2
    tuner = LoaderTuner()
    job = SimJob("a", 0, lambda w: {0: 3100.0, 1: 2650.0, 2: 4450.0}.get(w, 1000.0))
    start(tuner, job, direction="up")
    steps = drive(tuner, [job], 120.0, cores=2)
    assert moves(steps) == [(0, 1, "start"), (1, 2, "further"), (2, 2, "bound")]
    assert job.workers == 2 and tuner.sessions == {"a": "holding"}


def test_a_first_worker_that_gains_nothing_is_looked_past() -> None:
    # the battery's data-starved CUDA job on an H100 (docs/gpu-check.md): one worker
    # decodes as fast as the training process did; several decode in parallel
    tuner = LoaderTuner()
    table = {0: 426.0, 1: 426.0, 2: 700.0}
    job = SimJob("a", 0, lambda w: table.get(w, 1356.0))
    start(tuner, job, direction="up")
    steps = drive(tuner, [job], 200.0)
    assert moves(steps) == [
        (0, 1, "start"),
        (1, 2, "further"),
        (2, 4, "better"),
        (4, 8, "better"),
        (8, 4, "plateau"),
    ]
    assert job.workers == 4


def test_stops_on_a_plateau_and_keeps_the_cheaper_setting() -> None:
    tuner = LoaderTuner()
    job = SimJob("a", 2, lambda w: 1000.0 if w >= 2 else 500.0)
    start(tuner, job, direction="up")
    steps = drive(tuner, [job], 120.0)
    assert moves(steps) == [(2, 4, "start"), (4, 2, "plateau")]
    assert job.workers == 2  # the gain of 4 workers was within the noise margin


def test_respects_bounds_and_the_hosts_cores() -> None:
    tuner = LoaderTuner()
    job = SimJob("a", 1, lambda w: 100.0 * (w + 1))  # more is always better
    start(tuner, job, max=6)
    drive(tuner, [job], 200.0)
    assert job.workers == 6  # the action's max
    tuner = LoaderTuner()
    job = SimJob("b", 1, lambda w: 100.0 * (w + 1))
    start(tuner, job, step=1)
    drive(tuner, [job], 200.0, cores=3)
    assert job.workers == 3  # no more workers than logical CPUs
    tuner = LoaderTuner()
    job = SimJob("c", 12, lambda w: 100.0 * (w + 1))
    start(tuner, job)
    first = drive(tuner, [job], 30.0, cores=4)[0]
    assert (first.previous, first.value, first.verdict) == (12, 4, "bound")
    assert first.samples_per_s_before is None  # out of bounds: moved without measuring


def test_jobs_share_the_cores_fairly() -> None:
    tuner = LoaderTuner()
    a = SimJob("a", 1, lambda w: 100.0 * (w + 1))
    b = SimJob("b", 1, lambda w: 100.0 * (w + 1))
    start(tuner, a)
    start(tuner, b)
    drive(tuner, [a, b], 200.0, cores=8)
    assert (a.workers, b.workers) == (4, 4)


def test_restarts_when_another_job_attaches_or_the_host_saturates() -> None:
    tuner = LoaderTuner()
    a = SimJob("a", 1, lambda w: 100.0 * (w + 1))
    start(tuner, a)
    drive(tuner, [a], 120.0, cores=8)
    assert a.workers == 8 and tuner.sessions == {"a": "holding"}
    b = SimJob("b", 1, lambda w: 100.0 * (w + 1))
    start(tuner, b)  # a second job is tuned on the host: a's share is 4 cores now
    steps = drive(tuner, [a, b], 120.0, t0=120.0, cores=8)
    assert any(s.job == "a" and s.value < s.previous for s in steps)
    assert a.workers == 4
    tuner = LoaderTuner()
    c = SimJob("c", 1, peak_at(4))
    start(tuner, c)
    drive(tuner, [c], 120.0)
    assert c.workers == 4
    # the host saturates (another load): c's rate now peaks at 2 workers
    c.rate = peak_at(2)
    steps = drive(tuner, [c], 120.0, t0=120.0, cpu=lambda t: 95.0)
    assert steps and steps[0].verdict == "start" and steps[0].value < 4
    assert c.workers == 2


def test_holds_after_taking_back_a_step_whose_own_load_changed_the_saturation() -> None:
    # bench/efficacy.py on 2 cores: 2 workers saturate the host, 1 does not and is slower.
    # The saturation measured while the worse step ran is not the held setting's: holding
    # at 2 must not count the host's return to saturation as a changed situation.
    tuner = LoaderTuner()
    job = SimJob("a", 2, lambda w: {1: 2650.0, 2: 4450.0}.get(w, 1000.0))
    start(tuner, job, saturated=True, direction="down", min=0)
    steps = drive(tuner, [job], 300.0, cpu=lambda t: 100.0 if job.workers >= 2 else 60.0, cores=2)
    assert moves(steps) == [(2, 1, "start"), (1, 0, "further"), (0, 2, "worse")]
    assert job.workers == 2 and tuner.sessions == {"a": "holding"}


def test_restarts_when_throughput_drops() -> None:
    tuner = LoaderTuner()
    job = SimJob("a", 1, peak_at(4))
    start(tuner, job)
    drive(tuner, [job], 120.0)
    assert job.workers == 4
    job.rate = peak_at(8)  # the workload changed: 4 workers now give far less
    steps = drive(tuner, [job], 200.0, t0=120.0)
    assert steps and job.workers == 8


def test_engine_reports_tuning_in_dry_run_without_waiting_for_it() -> None:
    text = """\
policies:
  - name: host-oversubscribed
    when:
      host_cpu_above: {percent: 90, for: 2s}
    do:
      - tune_loader: {knob: num_workers, min: 0, measure: 2s}
"""
    engine = PolicyEngine(parse_policies(text, "t.yaml"), dry_run=True)
    job = SimJob("a", 8, peak_at(2))
    decisions = []
    t = 0.0
    while t < 60:
        t += TICK_S
        job.advance(t)
        result = engine.step(Snapshot(t, (), host(t, 95.0, 16), (job.info(t),)))
        decisions.extend(result.decisions)
    assert [(d.action, d.params["previous"], d.params["value"]) for d in decisions] == [
        ("tune_loader", 8, 4)
    ]
    assert decisions[0].dry_run and job.workers == 8


class SimJob2(SimJob):
    """A job with num_workers and prefetch_factor; ``rate2(workers, prefetch)``."""

    def __init__(self, workers: int, prefetch: int, rate2: Callable[[int, int], float]):
        super().__init__("a", workers, lambda w: rate2(w, self.prefetch))
        self.prefetch = prefetch
        self.pending_prefetch: int | None = None

    def advance(self, t: float) -> None:
        before = int(self.steps) // EPOCH_STEPS
        super().advance(t)
        if int(self.steps) // EPOCH_STEPS > before and self.pending_prefetch is not None:
            self.prefetch, self.pending_prefetch, self.applied_at = self.pending_prefetch, None, t

    def info(self, t: float) -> JobInfo:
        base = super().info(t)
        knobs = dict(base.knobs, prefetch_factor=Knob("prefetch_factor", self.prefetch, 1, 64))
        return JobInfo(self.name, 1, 0.0, knobs=knobs, last_report=base.last_report)


def test_tunes_prefetch_factor_once_num_workers_holds() -> None:
    tuner = LoaderTuner()
    job = SimJob2(1, 1, lambda w, p: 1000.0 - 100.0 * abs(w - 4) - 100.0 * abs(p - 4))
    start(tuner, job, then=["prefetch_factor"])
    out: list[tuple[str, int, int, str]] = []
    t = 0.0
    while t < 400.0:
        t += TICK_S
        job.advance(t)
        snap = Snapshot(t, (), host(t), (job.info(t),))
        for step in tuner.step(snap):
            out.append((step.knob, step.previous, step.value, step.verdict))
            if step.knob == "prefetch_factor":
                job.pending_prefetch = step.value
            elif step.value != step.previous:
                job.pending = step.value
    assert out[:4] == [
        ("num_workers", 1, 2, "start"),
        ("num_workers", 2, 4, "better"),
        ("num_workers", 4, 8, "better"),
        ("num_workers", 8, 4, "worse"),
    ]
    assert [o[0] for o in out[4:]] == ["prefetch_factor"] * len(out[4:]) and out[4:]
    assert (job.workers, job.prefetch) == (4, 4)


def test_gives_up_on_a_job_that_never_applies_its_change() -> None:
    tuner = LoaderTuner()
    job = SimJob("a", 1, peak_at(4))
    start(tuner, job)
    t = 0.0
    steps: list[TunerStep] = []
    while t < 700.0:  # the job ignores every change (e.g. it refuses it)
        t += TICK_S
        job.advance(t)
        steps.extend(tuner.step(Snapshot(t, (), host(t), (job.info(t),))))
    assert moves(steps) == [(1, 2, "start")]
    assert tuner.sessions == {}  # dropped after APPLY_TIMEOUT_S; a new firing starts afresh


def test_default_policies_starved_and_oversubscribed_job_is_tuned_down() -> None:
    """8 workers on 2 saturated cores, the job also waiting on its loader: both default
    rules fire; data-starved has nothing to raise (already above the host's share), so the
    host-oversubscribed tuner owns the job and brings it to its measured best."""
    engine = PolicyEngine(load_policies([default_policy_path()]))
    job = SimJob("a", 8, peak_at(2))
    job.wait = 0.9
    out = []
    t = 0.0
    while t < 120.0:
        t += TICK_S
        job.advance(t)
        for d in engine.step(Snapshot(t, (), host(t, 99.0, 2), (job.info(t),))).decisions:
            if d.action == "tune_loader":
                out.append((d.policy, d.params["previous"], d.params["value"]))
                if d.params["value"] != d.params["previous"]:
                    job.pending = int(d.params["value"])  # type: ignore[call-overload]
    assert out[0] == ("host-oversubscribed", 8, 2)
    assert {p for p, _, _ in out} == {"host-oversubscribed"} and job.workers == 2
