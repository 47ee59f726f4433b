"""The ``set_knob`` action (gpuwatchd/policy/actions/set_knob.py): the jobs a firing
concerns, the new value, and the command to the job with its outcomes."""

from __future__ import annotations

from action_fakes import NOW, attached, carry, finding, firing, gpu_group
from fake_daemon import FakeCommander
from gpuwatchd.control.protocol import Reply
from gpuwatchd.model import Knob
from gpuwatchd.policy.actions import set_knob
from gpuwatchd.policy.holds import KnobHolds

WORKERS = {"num_workers": Knob("num_workers", 4, 0, 16)}


def test_set_knob_halves_the_knob_of_the_job_on_the_findings_gpu_only() -> None:
    on_gpu0 = attached("a", WORKERS, ("0",))
    on_gpu1 = attached("b", WORKERS, ("1",))
    fired, params = firing("set_knob: {knob: num_workers, factor: 0.5}", jobs=(on_gpu0, on_gpu1))
    (decision,) = set_knob.decide(fired, params, [gpu_group(0, finding(gpu_index=0))])
    assert (decision.job, dict(decision.params)) == (
        "a",
        {"knob": "num_workers", "value": 2, "previous": 4},
    )


def test_set_knob_is_sent_to_the_job_and_its_reply_is_the_outcome() -> None:
    fired, params = firing(
        "set_knob: {knob: num_workers, value: 2}", jobs=(attached("a", WORKERS),)
    )
    (decision,) = set_knob.decide(fired, params, [gpu_group(0)])
    ok = FakeCommander([Reply(7, True, {})])
    record = carry(decision, commander=ok)
    assert (record.outcome, record.detail) == ("applied", "request 7")
    assert ok.sent == [("a", "set_knob", {"knob": "num_workers", "value": 2})]
    said_no = FakeCommander([Reply(8, False, None, "bad_request", "knob is read-only")])
    assert carry(decision, commander=said_no).outcome == "refused"
    gone = FakeCommander([Reply(9, False, None, "not_found", "disconnected")])
    assert carry(decision, commander=gone).outcome == "failed"


def test_set_knob_on_a_knob_an_operator_holds_is_refused_naming_the_operator() -> None:
    fired, params = firing(
        "set_knob: {knob: num_workers, value: 2}", jobs=(attached("a", WORKERS),)
    )
    (decision,) = set_knob.decide(fired, params, [gpu_group(0)])
    holds = KnobHolds(lambda: NOW)
    holds.hold("a", "num_workers", 8, uid=0, hold_s=600)
    commander = FakeCommander([])
    record = carry(decision, commander=commander, holds=holds)
    assert record.outcome == "refused" and "operator override: num_workers=8" in record.detail
    assert commander.sent == []
