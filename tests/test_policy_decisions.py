"""Tests of the set_knob action's arithmetic (gpuwatchd.policy.actions.set_knob): the new value."""

from __future__ import annotations

import pytest

from gpuwatchd.model import Knob, KnobValue
from gpuwatchd.policy.actions.set_knob import compute_knob_value


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
        # issue 10 item 2: a cut never raises, a raise never cuts; with nothing to move,
        # the value stays (so set_knob decides nothing)
        (Knob("w", 0, 0, 64), {"factor": 0.5, "min": 1}, 0),
        (Knob("w", 0, 0, 64), {"step": -1, "min": 1}, 0),
        (Knob("w", 20, 0, 64), {"factor": 2, "max": 16}, 20),
        (Knob("w", 20, 0, 64), {"step": 2, "max": 16}, 20),
    ],
)
def test_compute_knob_value(
    knob: Knob, params: dict[str, object], expected: KnobValue | None
) -> None:
    value = compute_knob_value(knob, params)
    assert value == expected
    assert type(value) is type(expected)
