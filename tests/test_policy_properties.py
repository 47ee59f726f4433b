"""Property tests (hypothesis) of the policy engine's guarantees.

Random scenarios (host CPU, two GPUs' utilization and memory, attached jobs, crash and
trial events, uneven tick spacing) run through random policies covering every action;
the guarantees of docs/design.md / issue 3 must hold for all of them:

* a condition shorter than its ``for:`` never fires (with and without hysteresis, with
  gaps longer than ``max_gap_s``);
* two decisions of one policy for one target never fall within its cooldown;
* a rate limit is never exceeded;
* a ladder never passes its floor or ceiling, and moves one consistent position;
* the same snapshots through fresh engines give the same decisions;
* ``restore(decisions)`` and continuing gives the decisions of never stopping.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatchd.model import (
    Decision,
    GpuSample,
    HostSample,
    JobEvent,
    JobInfo,
    Knob,
    Snapshot,
)
from gpuwatchd.policy.engine import LADDER_ACTIONS, PolicyEngine, cooldown_targets
from gpuwatchd.policy.schema import PolicySet, parse_policies

GiB = 2**30
FAST = settings(max_examples=60, deadline=None)
JOBS = ("a", "b")


@dataclass(frozen=True)
class Tick:
    dt: float
    cpu: float
    utils: tuple[float, float]
    vram_pct: tuple[float, float]
    attached: tuple[str, ...]
    crashes: tuple[tuple[str, str], ...]
    trials: tuple[tuple[str, str], ...]


ticks = st.builds(
    Tick,
    dt=st.sampled_from([0.5, 1.0, 1.0, 1.0, 2.0, 7.0]),
    cpu=st.sampled_from([10.0, 60.0, 80.0, 95.0, 99.0]),
    utils=st.tuples(st.sampled_from([0.0, 5.0, 60.0, 99.0]), st.sampled_from([0.0, 99.0])),
    vram_pct=st.tuples(st.sampled_from([50.0, 92.0, 97.0]), st.sampled_from([50.0, 97.0])),
    attached=st.sampled_from([(), ("a",), ("b",), ("a", "b")]),
    crashes=st.one_of(  # rare: a crash resets the clean-trial counts
        st.just(()),
        st.just(()),
        st.just(()),
        st.tuples(
            st.tuples(st.sampled_from(JOBS), st.sampled_from(["cuda_assert", "cuda_oom", "other"]))
        ),
    ),
    trials=st.lists(
        st.tuples(st.sampled_from(JOBS), st.sampled_from(["COMPLETE", "PRUNED", "FAIL"])),
        max_size=3,
    ).map(tuple),
)
scenarios = st.lists(ticks, min_size=1, max_size=60)


def snapshots(scenario: Sequence[Tick]) -> list[Snapshot]:
    out = []
    t = 1000.0
    for i, tick in enumerate(scenario):
        t += tick.dt
        gpus = tuple(
            GpuSample(
                uuid=f"GPU-{g}",
                index=g,
                name="H100",
                timestamp_s=t,
                utilization_gpu_pct=tick.utils[g],
                memory_used_bytes=int(tick.vram_pct[g] / 100 * 80 * GiB),
                memory_total_bytes=80 * GiB,
            )
            for g in range(2)
        )
        jobs = tuple(
            JobInfo(
                name=name,
                pid=100 + k,
                connected_at_s=0.0,
                cuda_devices=(str(k),),
                knobs={"num_workers": Knob("num_workers", 4 + k, 0, 16)},
            )
            for k, name in enumerate(JOBS)
            if name in tick.attached
        )
        events = tuple(
            JobEvent(t, job, "crash", pid=200 + i, crash_kind=kind, gpu_index=0)
            for job, kind in tick.crashes
        ) + tuple(
            JobEvent(t, job, "trial", trial_number=i, trial_state=state)
            for job, state in tick.trials
        )
        host = HostSample(t, tick.cpu, 16, 10 * GiB, 100 * GiB)
        out.append(Snapshot(t, gpus, host, jobs, events=events))
    return out


@dataclass(frozen=True)
class Knobs:
    """The random parts of the policies under test."""

    for_s: float
    clear: bool
    cooldown_s: float
    limit_max: int
    limit_per_s: float
    floor: int
    ceiling: int
    workers: int
    min_workers: int
    count: int


knob_sets = st.builds(
    Knobs,
    for_s=st.sampled_from([0.0, 2.0, 5.0]),
    clear=st.booleans(),
    cooldown_s=st.sampled_from([0.0, 3.0, 10.0]),
    limit_max=st.integers(1, 3),
    limit_per_s=st.sampled_from([5.0, 20.0]),
    floor=st.integers(1, 4),
    ceiling=st.integers(1, 6),
    workers=st.integers(1, 5),
    min_workers=st.integers(1, 5),
    count=st.integers(1, 3),
).filter(lambda k: k.min_workers <= k.workers)


def policy_text(k: Knobs, *, stateless: bool = False) -> str:
    """Policies covering every action; ``stateless``: only for: 0 and event-free state."""
    for_s = 0.0 if stateless else k.for_s
    clear = ", clear: 70" if k.clear and not stateless else ""
    trials = (
        ""
        if stateless
        else f"""\
  - name: raise
    when: {{trials_succeeded_in_row: {{count: {k.count}}}}}
    do:
      - raise_parallelism: {{step: 1, ceiling: {k.ceiling}}}
      - log
    cooldown: {k.cooldown_s}s
"""
    )
    return f"""\
policies:
  - name: hot
    when: {{host_cpu_above: {{percent: 90{clear}, for: {for_s}s}}}}
    do:
      - set_knob: {{knob: num_workers, factor: 0.5, min: 1}}
      - exec: {{argv: [echo, "{{subject}}"]}}
      - log: {{level: warning}}
    cooldown: {k.cooldown_s}s
    limit: {{max: {k.limit_max}, per: {k.limit_per_s}s}}
  - name: vram
    when: {{vram_above: {{percent: 95, for: {for_s}s}}}}
    do:
      - lower_parallelism: {{step: 2, floor: {k.floor}, mode: now}}
      - log
    cooldown: {k.cooldown_s}s
    limit: {{max: {k.limit_max}, per: {k.limit_per_s}s}}
  - name: idle
    when: {{low_utilization: {{percent: 20, for: {for_s}s}}}}
    do: [log]
    cooldown: {k.cooldown_s}s
  - name: place
    when: {{idle_gpu: {{percent: 10, busy_percent: 50, for: {for_s}s}}}}
    do:
      - place_on_idle_gpu: {{}}
      - exec: {{argv: [echo, "{{gpu_index}}"]}}
    cooldown: {k.cooldown_s}s
  - name: crash
    when: {{job_crashed: {{kind: [cuda_assert, cuda_oom]}}}}
    do:
      - restart_worker
      - restart_study: {{max_retries: 1}}
    cooldown: {k.cooldown_s}s
    limit: {{max: {k.limit_max}, per: {k.limit_per_s}s}}
{trials}"""


def engine_for(k: Knobs, **kw: object) -> PolicyEngine:
    return PolicyEngine(
        parse_policies(policy_text(k, **kw), "p.yaml"),  # type: ignore[arg-type]
        managed_jobs={"a": (k.workers, k.min_workers), "b": (3, 1)},
        max_gap_s=3.0,
    )


def run_all(engine: PolicyEngine, snaps: Sequence[Snapshot]) -> list[Decision]:
    return [d for s in snaps for d in engine.step(s).decisions]


def key(d: Decision) -> tuple[object, ...]:
    """A decision without its findings (whose since_s depends on when streaks began)."""
    return (d.policy, d.action, dict(d.params), d.timestamp_s, d.job, d.gpu_uuid, d.dry_run)


@FAST
@given(scenario=scenarios, k=knob_sets)
def test_a_condition_shorter_than_its_for_never_fires(scenario: list[Tick], k: Knobs) -> None:
    policies: PolicySet = parse_policies(policy_text(k), "p.yaml")
    engine = PolicyEngine(policies, max_gap_s=3.0)
    snaps = snapshots(scenario)
    clear = 70.0 if k.clear else 90.0
    for i, s in enumerate(snaps):
        for f in engine.step(s).findings:
            if f.detector != "host_cpu_above":
                continue
            # the streak [since_s, now]: samples unbroken (no gap > max_gap_s), every one
            # above clear, the first for_s of it above the threshold, and it spans for_s
            assert s.timestamp_s - f.since_s >= k.for_s - 1e-9
            streak = [x for x in snaps[: i + 1] if x.timestamp_s >= f.since_s]
            assert streak[0].timestamp_s == f.since_s
            times = [x.timestamp_s for x in streak]
            assert all(b - a <= 3.0 for a, b in itertools.pairwise(times))
            cpus = [x.host.cpu_pct for x in streak if x.host is not None]
            assert all(c > clear for c in cpus)
            first = [x.host.cpu_pct for x in streak if x.timestamp_s - f.since_s <= k.for_s]
            assert all(c > 90.0 for c in first if c is not None)


@FAST
@given(scenario=scenarios, k=knob_sets)
def test_cooldown_and_rate_limit_are_never_broken(scenario: list[Tick], k: Knobs) -> None:
    policies = parse_policies(policy_text(k), "p.yaml")
    decisions = run_all(engine_for(k), snapshots(scenario))
    by_target: dict[tuple[str, str], list[float]] = defaultdict(list)
    firings: dict[str, list[float]] = defaultdict(list)
    for d in decisions:
        for target in cooldown_targets(d):
            by_target[d.policy, target].append(d.timestamp_s)
        if not firings[d.policy] or firings[d.policy][-1] != d.timestamp_s:
            firings[d.policy].append(d.timestamp_s)
    for (name, _target), times in by_target.items():
        cooldown = policies.get(name).cooldown_s  # type: ignore[union-attr]
        distinct = sorted(set(times))
        assert all(b - a >= cooldown for a, b in itertools.pairwise(distinct))
    for name, times in firings.items():
        limit = policies.get(name).limit  # type: ignore[union-attr]
        if limit is None:
            continue
        for t in times:
            assert sum(1 for u in times if t <= u < t + limit.per_s) <= limit.max


@FAST
@given(scenario=scenarios, k=knob_sets, paused_at=st.integers(0, 60))
def test_a_ladder_never_passes_its_floor_or_ceiling(
    scenario: list[Tick], k: Knobs, paused_at: int
) -> None:
    engine = engine_for(k)
    # start job a at the bottom of its ladder (a journaled cut), so raises happen too
    cut = {"job": "a", "from": k.workers, "to": k.min_workers, "mode": "now"}
    engine.restore([Decision("vram", "lower_parallelism", cut, 0.0, (), job="a")])
    position = {"a": k.min_workers, "b": 3}
    bounds = {"a": (k.min_workers, k.workers), "b": (1, 3)}
    for i, s in enumerate(snapshots(scenario)):
        engine.paused = i >= paused_at  # dry-run decisions must not move the ladder
        for d in engine.step(s).decisions:
            if d.action not in LADDER_ACTIONS:
                continue
            job = str(d.job)
            low, high = bounds[job]
            frm, to = d.params["from"], d.params["to"]
            assert isinstance(frm, int) and isinstance(to, int)
            assert frm == position[job]
            if d.action == "lower_parallelism":
                assert max(k.floor, low) <= to < frm
            else:
                assert frm < to <= min(k.ceiling, high)
            assert low <= to <= high
            if not d.dry_run:
                position[job] = to
        assert all(engine.parallelism(job) == position[job] for job in position)


@FAST
@given(scenario=scenarios, k=knob_sets)
def test_the_same_snapshots_give_the_same_decisions(scenario: list[Tick], k: Knobs) -> None:
    snaps = snapshots(scenario)
    first = run_all(engine_for(k), snaps)
    second = run_all(engine_for(k), snaps)
    assert first == second  # findings included: nothing depends on the wall clock or ids


@FAST
@given(scenario=scenarios, k=knob_sets, cut=st.integers(0, 60))
def test_restore_then_continue_equals_never_stopping(
    scenario: list[Tick], k: Knobs, cut: int
) -> None:
    """Conditions with for: 0 and no counters, so the only state is cooldowns, limits and
    ladders: exactly what restore() rebuilds from the decisions."""
    snaps = snapshots(scenario)
    cut = min(cut, len(snaps))
    never_stopped = engine_for(k, stateless=True)
    expected = [key(d) for d in run_all(never_stopped, snaps)[:]]
    before = engine_for(k, stateless=True)
    journal = run_all(before, snaps[:cut])
    after = engine_for(k, stateless=True)
    after.restore(journal)
    continued = run_all(after, snaps[cut:])
    assert [key(d) for d in journal] + [key(d) for d in continued] == expected
    for job in ("a", "b"):
        assert after.parallelism(job) == never_stopped.parallelism(job)
