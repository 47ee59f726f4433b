"""The ``tune_loader`` action (gpuwatchd/policy/actions/tune_loader.py): a firing opens a
tuning session; the tuner's moves are carried out as knob commands, its holds logged."""

from __future__ import annotations

from action_fakes import NOW, attached, carry, firing, gpu_group
from fake_daemon import FakeCommander
from gpuwatchd.control.protocol import Reply
from gpuwatchd.model import Knob
from gpuwatchd.policy.actions import tune_loader
from gpuwatchd.policy.tuner import TunerStep


def step(value: int, previous: int, dry_run: bool = False) -> TunerStep:
    return TunerStep(
        "a", "p", "num_workers", value, previous, None, None, "start", "moved", dry_run, "idle"
    )


def test_a_firing_opens_a_session_and_decides_nothing_itself() -> None:
    job = attached("a", {"num_workers": Knob("num_workers", 2, 0, 8)})
    fired, params = firing("tune_loader: {max: 8}", jobs=(job,))
    assert tune_loader.decide(fired, params, [gpu_group(0)]) == []
    assert fired.tuner.sessions == {"a": "tuning"}


def test_a_move_is_sent_to_the_job_and_a_hold_only_logged() -> None:
    move = tune_loader.decision_of(step(4, 2), NOW, dry_run=False)
    assert (move.action, move.job, move.params["value"], move.dry_run) == (
        "tune_loader",
        "a",
        4,
        False,
    )
    commander = FakeCommander([Reply(3, True, {})])
    assert carry(move, commander=commander).outcome == "applied"
    assert commander.sent == [("a", "set_knob", {"knob": "num_workers", "value": 4})]
    assert tune_loader.decision_of(step(4, 4), NOW, dry_run=True).dry_run  # paused engine
    assert tune_loader.decision_of(step(4, 4, dry_run=True), NOW, dry_run=False).dry_run
    held = tune_loader.decision_of(step(4, 4), NOW, dry_run=False)
    assert carry(held, commander=FakeCommander([])).outcome == "logged"
