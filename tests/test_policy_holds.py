"""Operator holds (gpuwatchd.policy.holds) with a fake clock, and the parts that
consult them: the actuator refuses a knob decision on a held knob, naming the operator,
and the tuner neither opens a session on one nor goes on with one an operator took."""

from __future__ import annotations

import calendar

import pytest

from gpuwatchd.actuators import Actuator
from gpuwatchd.control.protocol import Reply
from gpuwatchd.logs import get_logger
from gpuwatchd.model import Decision
from gpuwatchd.policy.holds import DEFAULT_HOLD_S, MAX_HOLD_S, KnobHolds
from gpuwatchd.policy.tuner import LoaderTuner
from test_tuner import SimJob, drive, moves, peak_at, start

T0 = float(calendar.timegm((2026, 11, 27, 18, 12, 7, 0, 0, 0)))  # 18:12:07 UTC


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_hold_is_in_force_until_it_expires() -> None:
    clock = Clock()
    holds = KnobHolds(clock)
    held = holds.hold("digits", "num_workers", 2, uid=0, hold_s=DEFAULT_HOLD_S)
    assert held is not None and held.until_s == T0 + 1800
    assert held.describe() == (
        "operator override: num_workers=2 by uid 0 (gpuwatchctl knob) until 18:42:07 UTC"
    )
    assert holds.active("digits", "prefetch_factor") is None
    assert holds.active("other", "num_workers") is None
    assert holds.active(None, "num_workers") is None
    clock.now = T0 + 1799.9
    assert holds.active("digits", "num_workers") is held
    assert holds.in_force() == [held]
    clock.now = T0 + 1800
    assert holds.active("digits", "num_workers") is None
    assert holds.in_force() == []


def test_a_later_hold_replaces_and_zero_clears() -> None:
    clock = Clock()
    holds = KnobHolds(clock)
    holds.hold("digits", "num_workers", 2, uid=0, hold_s=60)
    later = holds.hold("digits", "num_workers", 4, uid=1000, hold_s=10)
    assert holds.active("digits", "num_workers") is later
    assert later is not None and (later.value, later.uid, later.until_s) == (4, 1000, T0 + 10)
    assert holds.hold("digits", "num_workers", 4, uid=0, hold_s=0) is None
    assert holds.in_force() == []
    holds.hold("digits", "persistent_workers", True, uid=0, hold_s=5)
    assert "persistent_workers=true" in holds.in_force()[0].describe()
    holds.clear("digits", "persistent_workers")
    assert holds.in_force() == []


@pytest.mark.parametrize("hold_s", [-1, MAX_HOLD_S + 1, True, "30m", None])
def test_a_hold_outside_zero_to_24h_is_refused(hold_s: object) -> None:
    with pytest.raises(ValueError, match="hold_s"):
        KnobHolds(Clock()).hold("j", "k", 1, uid=0, hold_s=hold_s)  # type: ignore[arg-type]


def test_restore_keeps_the_last_hold_still_in_force() -> None:
    holds = KnobHolds(Clock())
    holds.restore(
        [
            ("a", "num_workers", 2, 0, T0 - 100, 60),  # over before now
            ("b", "num_workers", 2, 0, T0 - 100, 600),
            ("b", "num_workers", 3, 7, T0 - 50, 600),  # replaces the one above
            ("c", "num_workers", 2, 0, T0 - 10, 600),
            ("c", "num_workers", 2, 0, T0 - 5, 0),  # --hold 0 ended it
            ("d", "num_workers", 2, 0, T0, 10**9),  # malformed: skipped
        ]
    )
    (held,) = holds.in_force()
    assert (held.job, held.value, held.uid, held.until_s) == ("b", 3, 7, T0 + 550)


class Unused:
    async def send_command(self, *args: object, **kw: object) -> list[Reply]:
        raise AssertionError("a held knob's decision must not be sent")


def knob_decision(action: str, value: int, previous: int = 3) -> Decision:
    params = {"knob": "num_workers", "value": value, "previous": previous}
    return Decision("pin", action, params, T0, (), job="digits")


def test_the_actuator_refuses_a_policy_move_of_a_held_knob_naming_the_operator() -> None:
    clock = Clock()
    holds = KnobHolds(clock)
    holds.hold("digits", "num_workers", 2, uid=0, hold_s=60)
    actuator = Actuator(Unused(), get_logger("test"), clock, holds=holds)
    for action in ("set_knob", "tune_loader"):
        record = actuator.plan(knob_decision(action, 1))
        assert (record.outcome, record.detail) == (
            "refused",
            "operator override: num_workers=2 by uid 0 (gpuwatchctl knob) until 18:13:07 UTC",
        )
        actuator.start(record)  # logged, nothing sent
    other = Decision("pin", "set_knob", {"knob": "prefetch_factor", "value": 4}, T0, (), "digits")
    assert actuator.plan(other).outcome == "pending"
    clock.now = T0 + 60
    assert actuator.plan(knob_decision("set_knob", 1)).outcome == "pending"


def test_the_tuner_opens_no_session_on_a_held_knob() -> None:
    clock = Clock(0.0)
    holds = KnobHolds(clock)
    holds.hold("a", "num_workers", 1, uid=0, hold_s=60)
    tuner = LoaderTuner(holds)
    with pytest.raises(AssertionError):
        start(tuner, SimJob("a", 1, peak_at(4)))
    assert tuner.sessions == {}
    clock.now = 60.0
    start(tuner, SimJob("a", 1, peak_at(4)))
    assert tuner.sessions == {"a": "tuning"}


def test_the_tuner_stops_a_session_an_operator_takes_over_and_says_so() -> None:
    clock = Clock(0.0)
    holds = KnobHolds(clock)
    tuner = LoaderTuner(holds)
    job = SimJob("a", 1, peak_at(8))
    start(tuner, job)
    steps = drive(tuner, [job], 20.0)
    assert moves(steps)[0] == (1, 2, "start")
    clock.now = 20.0
    holds.hold("a", "num_workers", job.workers, uid=0, hold_s=60)
    after = drive(tuner, [job], 10.0, t0=20.0)
    assert moves(after) == [(job.workers, job.workers, "override")]  # a hold: nothing sent
    assert after[0].message.startswith("tuning num_workers stopped: operator override: ")
    assert tuner.sessions == {}
