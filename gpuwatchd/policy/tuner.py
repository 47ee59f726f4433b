"""Closed-loop tuning of a live job's DataLoader knob (``tune_loader``): pure, clock injected.

One :class:`LoaderTuner` per engine (per host) owns every tuning session, so two policies
never fight over one job. Specification: docs/tuning.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gpuwatchd.model import JobInfo, Knob, Snapshot
from gpuwatchd.policy.holds import KnobHolds

__all__ = [
    "APPLY_TIMEOUT_S",
    "DROP_NOISES",
    "SATURATED_CPU_PCT",
    "SATURATION_CHANGE_S",
    "LoaderTuner",
    "TuneSettings",
    "TunerStep",
]

SATURATED_CPU_PCT: Final = 90.0
"""Host CPU (percent of all logical CPUs) at or above which the host counts as saturated:
the tuner's ``auto`` direction is then down, and a held job whose host saturates (or
stops being saturated) is tuned again. The same figure as the default host-oversubscribed
rule (policies/default.yaml)."""


SATURATION_CHANGE_S: Final = 10.0
"""How long the host's saturation must differ from when a job's tuning came to hold
before it is tuned again: a shared host hovering at 90 % would otherwise restart it on
every crossing."""
APPLY_TIMEOUT_S: Final = 600.0
"""How long a session waits for the job to apply a change (the actuator's own ack timeout:
a job applies DataLoader knobs at its next epoch) before it gives up on the job."""
DROP_NOISES: Final = 4.0
"""A held setting's throughput must fall by more than this many noise margins (20 % with
the default 5 %) to tune again: the windows of a busy host vary by more than one margin."""


@dataclass(frozen=True, slots=True)
class TuneSettings:
    """A ``tune_loader`` action's params (docs/tuning.md).

    ``knob``: the int knob tuned; ``min``/``max``: bounds (None: the knob's own, and the
    host's fair share of cores caps ``max`` for ``num_workers``); ``factor`` (> 1) or
    ``step`` (>= 1): how far one move goes; ``settle_epochs``: epochs skipped after a
    change before measuring; ``measure_s``: seconds of throughput measured per setting
    (at least one epoch boundary); ``noise``: relative gain (0.05 = 5 %) below which two
    settings count as equal; ``direction``: ``up``, ``down`` or ``auto`` (down when the
    host is saturated, else up); ``then``: knobs tuned next, one after the other, each
    once the previous one holds (upwards, within the knob's own bounds).
    """

    knob: str = "num_workers"
    min: int | None = None
    max: int | None = None
    factor: float | None = 2.0
    step: int | None = None
    settle_epochs: int = 1
    measure_s: float = 5.0
    noise: float = 0.05
    direction: str = "auto"
    then: tuple[str, ...] = ()

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> TuneSettings:
        """Build from parsed action params (missing keys take the defaults above)."""
        step = params.get("step")
        return cls(
            knob=str(params.get("knob", "num_workers")),
            min=None if params.get("min") is None else int(params["min"]),
            max=None if params.get("max") is None else int(params["max"]),
            factor=None if step is not None else float(params.get("factor", 2.0)),
            step=None if step is None else int(step),
            settle_epochs=int(params.get("settle_epochs", 1)),
            measure_s=float(params.get("measure", 5.0)),
            noise=float(params.get("noise", 0.05)),
            direction=str(params.get("direction", "auto")),
            then=tuple(params.get("then", ())),
        )

    def next_knob(self) -> TuneSettings | None:
        """The settings for the first of ``then`` (None when there is none)."""
        if not self.then:
            return None
        return TuneSettings(
            knob=self.then[0],
            factor=self.factor,
            step=self.step,
            settle_epochs=self.settle_epochs,
            measure_s=self.measure_s,
            noise=self.noise,
            direction="up",
            then=self.then[1:],
        )


@dataclass(frozen=True, slots=True)
class TunerStep:
    """One tuning decision for ``job``: set ``knob`` from ``previous`` to ``value``
    (equal: hold). ``samples_per_s_before``: the throughput measured at the best setting
    so far (before this comparison), ``samples_per_s_after``: at the setting just measured
    (None for the first move); ``verdict``: ``start``, ``better``, ``further`` (a worse
    first step: one more step the same way is measured before turning), ``worse``,
    ``plateau``, ``bound`` or ``restart``; ``message``: one line for the journal."""

    job: str
    policy: str
    knob: str
    value: int
    previous: int
    samples_per_s_before: float | None
    samples_per_s_after: float | None
    verdict: str
    message: str
    dry_run: bool
    reason: str


@dataclass(slots=True)
class _Measure:
    """Throughput of one setting: from the first report after the settle epochs on."""

    value: int
    settle_until_epoch: int | None = None
    t0: float | None = None
    steps0: int = 0
    epoch0: int = 0


@dataclass(slots=True)
class _Session:
    policy: str
    settings: TuneSettings
    dry_run: bool
    reason: str
    direction: int
    best_value: int
    best_rate: float | None = None
    measuring: _Measure | None = None
    expected: int | None = None
    expected_since: float = 0.0
    moved: bool = False
    holding: bool = False
    hold_rate: float | None = None
    hold_jobs: frozenset[str] = frozenset()
    hold_saturated: bool | None = False
    """The host's saturation while the held setting runs; None until that is measured (a
    hold that takes a step back was decided under the worse step's load)."""
    flipped_at: float | None = None
    """Since when the host's saturation differs from the held state (None: it does not)."""
    tried_other_way: bool = False
    looked_further: bool = False
    measured: dict[int, float] = field(default_factory=dict)
    first: TuneSettings | None = None
    """The settings the session started with (a restart tunes their knob again)."""


class LoaderTuner:
    """Hill-climbs one int knob per job (docs/tuning.md); no I/O, time from snapshots.

    :meth:`start` opens a session for a job (no-op while one runs); :meth:`step` advances
    every session with a snapshot and returns the decisions to carry out. A held job is
    tuned again when the set of tuned jobs on the host changes, the host saturation flips
    for :data:`SATURATION_CHANGE_S`, or its throughput falls by more than
    :data:`DROP_NOISES` noise margins; a restart moves down on
    a saturated host, else up.

    ``holds`` are the operator's overrides (:mod:`gpuwatchd.policy.holds`): no session
    opens on a held knob, and a session whose knob an operator takes over ends with one
    hold step of verdict ``override`` naming the operator (nothing is sent to the job).
    """

    def __init__(self, holds: KnobHolds | None = None) -> None:
        self._sessions: dict[str, _Session] = {}
        self._holds = holds

    @property
    def sessions(self) -> Mapping[str, str]:
        """Job name -> ``tuning`` or ``holding`` (status, tests)."""
        return {n: "holding" if s.holding else "tuning" for n, s in self._sessions.items()}

    def tuning(self, job: str) -> bool:
        """Whether ``job``'s knob is owned by a session that is still moving it."""
        session = self._sessions.get(job)
        return session is not None and not session.holding

    def start(
        self,
        job: JobInfo,
        settings: TuneSettings,
        *,
        policy: str,
        dry_run: bool,
        reason: str,
        saturated: bool,
        cores: int | None = None,
    ) -> bool:
        """Open a session for ``job`` (True) unless one exists, it lacks the int knob, or
        there is no room to move (``cores``: the host's logical CPUs, for the fair share)."""
        if job.name in self._sessions:
            return False
        if self._holds is not None and self._holds.active(job.name, settings.knob):
            return False  # an operator holds the knob: no session fights it
        knob = job.knobs.get(settings.knob)
        if knob is None or isinstance(knob.value, bool) or not isinstance(knob.value, int):
            return False
        direction = {"up": 1, "down": -1}.get(settings.direction, -1 if saturated else 1)
        low = self._low(settings, knob)
        high = self._high(settings, knob, cores, len(self._sessions) + 1)
        if (direction < 0 and knob.value <= low) or (direction > 0 and knob.value >= high):
            return False  # nothing to cut (or to raise): no session, no decision
        session = _Session(policy, settings, dry_run, reason, direction, knob.value)
        session.measuring = _Measure(knob.value, settle_until_epoch=None)
        self._sessions[job.name] = session
        return True

    def forget(self, job: str) -> None:
        """Drop ``job``'s session (it detached)."""
        self._sessions.pop(job, None)

    def reset(self) -> None:
        """Drop every session."""
        self._sessions.clear()

    # -- stepping -----------------------------------------------------------------------

    def step(self, snapshot: Snapshot) -> list[TunerStep]:
        """Advance every session with ``snapshot``; return the moves and holds decided."""
        now = snapshot.timestamp_s
        jobs = {j.name: j for j in snapshot.jobs}
        for name in [n for n in self._sessions if n not in jobs]:
            del self._sessions[name]
        tuned = frozenset(self._sessions)
        host = snapshot.host
        saturated = host is not None and host.cpu_pct >= SATURATED_CPU_PCT
        cores = host.cpu_count if host is not None else None
        out: list[TunerStep] = []
        for name, session in list(self._sessions.items()):
            job = jobs[name]
            knob = job.knobs.get(session.settings.knob)
            if knob is None or not isinstance(knob.value, int) or isinstance(knob.value, bool):
                del self._sessions[name]
                continue
            held = self._holds.active(name, knob.name) if self._holds is not None else None
            if held is not None:  # an operator took the knob over: stop, and say so
                del self._sessions[name]
                out.append(self._stopped(name, session, knob.value, held.describe()))
                continue
            high = self._high(session.settings, knob, cores, len(tuned))
            if session.expected is not None and session.expected_since == 0.0:
                session.expected_since = now
            if (
                session.expected is not None
                and knob.value != session.expected
                and now - session.expected_since > APPLY_TIMEOUT_S
            ):
                del self._sessions[name]  # the job refused or never applied it: stop here
                continue
            if session.expected is None:
                session.expected_since = 0.0
            if session.holding and session.expected is not None:
                if knob.value == session.expected:  # the step back is applied
                    session.expected = None
                    session.measuring = _Measure(knob.value)
                continue
            if session.holding and self._then(session, job):
                continue
            if session.holding:
                if self._changed(session, job, knob, tuned, saturated, now):
                    current = job.knobs.get(session.settings.knob)
                    if current is None or not isinstance(current.value, int):
                        del self._sessions[name]
                        continue
                    self._restart(session, current.value, saturated)
                continue
            step = self._advance(name, session, job, knob, high, now)
            if step is not None:
                out.append(step)
                if session.holding:
                    session.hold_jobs = tuned
                    session.hold_saturated = saturated if session.expected is None else None
        return out

    @staticmethod
    def _stopped(name: str, session: _Session, value: int, why: str) -> TunerStep:
        """The step that ends ``session`` under an operator override: a hold at the
        job's present ``value`` (nothing is sent), verdict ``override``."""
        return TunerStep(
            job=name,
            policy=session.policy,
            knob=session.settings.knob,
            value=value,
            previous=value,
            samples_per_s_before=session.best_rate,
            samples_per_s_after=None,
            verdict="override",
            message=f"tuning {session.settings.knob} stopped: {why}",
            dry_run=session.dry_run,
            reason=session.reason,
        )

    @staticmethod
    def _high(settings: TuneSettings, knob: Knob, cores: int | None, jobs: int) -> int:
        highs = [h for h in (settings.max, knob.max) if isinstance(h, int) and h is not True]
        if cores is not None and settings.knob == "num_workers":
            highs.append(max(1, cores // max(1, jobs)))  # fair share of the host's cores
        return min(highs) if highs else 1 << 30

    @staticmethod
    def _low(settings: TuneSettings, knob: Knob) -> int:
        lows = [lo for lo in (settings.min, knob.min) if isinstance(lo, int) and lo is not True]
        return max(lows) if lows else 0

    def _next_value(self, session: _Session, value: int, low: int, high: int) -> int:
        s = session.settings
        if s.step is not None:
            new = value + session.direction * s.step
        else:
            factor = s.factor or 2.0
            new = (
                math.floor(value * factor + 0.5)
                if session.direction > 0
                else math.floor(value / factor + 0.5)
            )
            if new == value:
                new = value + session.direction
        return min(max(new, low), high)

    def _measure(self, m: _Measure, job: JobInfo, session: _Session, now: float) -> float | None:
        report = job.last_report
        if report is None:
            return None
        if m.settle_until_epoch is None:
            m.settle_until_epoch = report.epoch + session.settings.settle_epochs
        if report.epoch < m.settle_until_epoch:
            return None
        if m.t0 is None:
            m.t0, m.steps0, m.epoch0 = report.timestamp_s, report.steps, report.epoch
            return None
        elapsed = report.timestamp_s - m.t0
        if elapsed < session.settings.measure_s or report.epoch <= m.epoch0:
            return None
        batch = report.samples_per_s * report.step_time_s
        return (report.steps - m.steps0) / elapsed * (batch if batch > 0 else 1.0)

    def _advance(
        self, name: str, session: _Session, job: JobInfo, knob: Knob, high: int, now: float
    ) -> TunerStep | None:
        value = knob.value
        assert isinstance(value, int)
        low = self._low(session.settings, knob)
        if session.expected is not None:
            if value != session.expected:
                return None  # the change is not applied yet (the job applies it per epoch)
            session.expected = None
            session.measuring = _Measure(value)
        if session.best_rate is None and not low <= value <= high:
            # outside the bounds (e.g. more workers than the host's share of cores): not a
            # candidate, so there is nothing to measure first
            target = min(max(value, low), high)
            session.best_value = target
            return self._move(name, session, value, target, None, None, "bound")
        m = session.measuring
        if m is None or m.value != value:
            session.measuring = m = _Measure(value)  # changed by someone else: measure anew
        rate = self._measure(m, job, session, now)
        if rate is None:
            return None
        session.measured[value] = rate
        before = session.best_rate
        noise = session.settings.noise
        if before is None:  # the baseline at the session's start
            session.best_rate, session.best_value = rate, value
            target = self._next_value(session, value, low, high)
            if target == value:  # at the bound already: nothing to try, nothing to say
                del self._sessions[name]
                return None
            return self._move(name, session, value, target, rate, None, "start")
        best = session.best_value
        if rate > before * (1.0 + noise):
            session.best_rate, session.best_value = rate, value
            target = self._next_value(session, value, low, high)
            if target == value:
                return self._hold(name, session, value, value, before, rate, "bound")
            session.moved = True
            return self._move(name, session, value, target, before, rate, "better")
        if rate < before * (1.0 - noise):
            if not session.moved and not session.looked_further:
                # A worse first step is checked one step further before turning back:
                # throughput need not be unimodal at the small end (num_workers=1 moves the
                # loading out of the main process without any parallelism, and is often
                # slower than both 0 and 2: bench/efficacy.py on 2 cores).
                session.looked_further = True
                target = self._next_value(session, value, low, high)
                if target not in (best, value) and target not in session.measured:
                    return self._move(name, session, value, target, before, rate, "further")
            if not session.moved and not session.tried_other_way:
                session.tried_other_way = True  # the first step was worse: try the other way
                session.direction = -session.direction
                target = self._next_value(session, best, low, high)
                if target not in (best, value) and target not in session.measured:
                    return self._move(name, session, value, target, before, rate, "worse")
            return self._hold(name, session, value, best, before, rate, "worse")
        # within the noise margin: a plateau; keep the cheaper (lower) setting
        if (
            not session.moved
            and not session.looked_further
            and session.settings.knob == "num_workers"
            and (best, value) == (0, 1)
        ):
            # 0 -> 1 worker only moves the loading out of the training process, with no
            # parallelism: equal throughput says nothing of 2 or more. Seen on an H100
            # (docs/gpu-check.md): 0 and 1 worker 426 samples/s, 4 workers 1356.
            session.looked_further = True
            target = self._next_value(session, value, low, high)
            if target not in (best, value) and target not in session.measured:
                return self._move(name, session, value, target, before, rate, "further")
        keep = min(value, best)
        if keep == value:
            session.best_rate, session.best_value = rate, value
        return self._hold(name, session, value, keep, before, rate, "plateau")

    def _move(
        self,
        name: str,
        session: _Session,
        value: int,
        target: int,
        before: float | None,
        after: float | None,
        verdict: str,
    ) -> TunerStep:
        session.expected = target
        session.measuring = None
        if session.dry_run:  # nothing will change: report the first move and stop there
            session.holding, session.expected = True, None
        return self._emit(name, session, value, target, before, after, verdict)

    def _hold(
        self,
        name: str,
        session: _Session,
        value: int,
        keep: int,
        before: float | None,
        after: float | None,
        verdict: str,
    ) -> TunerStep:
        session.holding = True
        session.hold_rate = session.measured.get(keep)
        session.measuring = _Measure(keep)
        session.expected = keep if keep != value and not session.dry_run else None
        return self._emit(name, session, value, keep, before, after, verdict)

    def _emit(
        self,
        name: str,
        session: _Session,
        value: int,
        target: int,
        before: float | None,
        after: float | None,
        verdict: str,
    ) -> TunerStep:
        knob = session.settings.knob
        measured = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(session.measured.items()))
        what = "hold" if target == value else f"{value} -> {target}"
        message = f"tune {knob} {what} ({verdict}); " + (
            f"samples/s by {knob}: {measured}" if measured else "nothing measured yet"
        )
        return TunerStep(
            name,
            session.policy,
            knob,
            target,
            value,
            before,
            after,
            verdict,
            message,
            session.dry_run,
            session.reason,
        )

    def _changed(
        self,
        session: _Session,
        job: JobInfo,
        knob: Knob,
        tuned: frozenset[str],
        saturated: bool,
        now: float,
    ) -> bool:
        if session.dry_run:
            return False  # nothing was applied: the decision stands until the policy fires anew
        if session.hold_saturated is None or saturated == session.hold_saturated:
            session.flipped_at = None
        elif session.flipped_at is None:
            session.flipped_at = now
        flipped = session.flipped_at is not None and now - session.flipped_at >= SATURATION_CHANGE_S
        if tuned != session.hold_jobs or flipped:
            if session.first is not None:  # tune from the first knob again
                session.settings, session.first = session.first, None
            return True
        m = session.measuring
        if m is None or m.value != knob.value:
            return knob.value != session.best_value
        rate = self._measure(m, job, session, now)
        if rate is None:
            return False
        if session.hold_saturated is None:
            session.hold_saturated = saturated  # measured under the held setting's own load
        session.measuring = _Measure(int(knob.value), settle_until_epoch=0)
        held = session.hold_rate
        return held is not None and rate < held * (1.0 - DROP_NOISES * session.settings.noise)

    def _then(self, session: _Session, job: JobInfo) -> bool:
        """Move a held session on to its next knob (``then``); True when it did."""
        if session.dry_run:
            return False
        nxt = session.settings.next_knob()
        while nxt is not None:
            knob = job.knobs.get(nxt.knob)
            workers = job.knobs.get("num_workers")
            usable = (
                knob is not None
                and isinstance(knob.value, int)
                and not isinstance(knob.value, bool)
                # prefetch_factor only acts with worker processes (DataLoader refuses it without)
                and not (
                    nxt.knob == "prefetch_factor" and workers is not None and not workers.value
                )
            )
            if usable and knob is not None and isinstance(knob.value, int):
                if session.first is None:
                    session.first = session.settings
                session.settings = nxt
                self._restart(session, knob.value, saturated=False)
                return True
            nxt = nxt.next_knob()
        return False

    def _restart(self, session: _Session, value: int, saturated: bool) -> None:
        session.direction = -1 if saturated else 1  # the situation changed: auto
        session.best_value, session.best_rate = value, None
        session.measuring = _Measure(value)
        session.expected = None
        session.moved = session.holding = session.tried_other_way = False
        session.looked_further = False
        session.measured.clear()
        session.reason = "restart: " + session.reason.removeprefix("restart: ")
