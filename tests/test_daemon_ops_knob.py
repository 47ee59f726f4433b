"""The ``knob`` op (gpuwatchd.daemon.ops.knob) against a fake daemon and a fake job side."""

from __future__ import annotations

from pathlib import Path

import pytest

from fake_daemon import FakeCommander, FakeDaemon, call, policy_file
from gpuwatchd.control.protocol import ErrorCode, Reply
from gpuwatchd.errors import ControlError, ProtocolError
from gpuwatchd.policy.holds import KnobHolds

APPLIED = Reply("c-1", ok=True, result={"applied": True})


def test_an_applied_knob(tmp_path: Path) -> None:
    commander = FakeCommander([APPLIED])
    daemon = FakeDaemon(policy_file(tmp_path), commander=commander)
    daemon.knob_holds = KnobHolds(lambda: 1000.0)
    reply = call(daemon, "knob", {"job": "digits", "knob": "num_workers", "value": 2})
    assert reply == {
        "job": "digits",
        "knob": "num_workers",
        "value": 2,
        "state": "applied",
        "decision_id": 1,
        "hold_until_s": 2800.0,  # held against policies for 30 minutes by default
    }
    assert commander.sent == [("digits", "set_knob", {"knob": "num_workers", "value": 2})]
    # journaled as an operator's decision, with its outcome
    (record,) = daemon.decisions
    assert (record.decision.policy, record.decision.action) == ("operator", "set_knob")
    assert record.decision.params == {
        "knob": "num_workers",
        "value": 2,
        "hold_s": 1800.0,
        "by_uid": record.decision.params["by_uid"],
    }
    assert daemon.finished == [record] and record.outcome == "applied"
    held = daemon.knob_holds.active("digits", "num_workers")
    assert held is not None and (held.value, held.until_s) == (2, 2800.0)


def test_hold_s_sets_the_hold_and_zero_ends_it(tmp_path: Path) -> None:
    daemon = FakeDaemon(policy_file(tmp_path), commander=FakeCommander([APPLIED]))
    daemon.knob_holds = KnobHolds(lambda: 1000.0)
    params = {"job": "digits", "knob": "num_workers", "value": 2, "hold_s": 60}
    assert call(daemon, "knob", params)["hold_until_s"] == 1060.0
    assert daemon.knob_holds.active("digits", "num_workers") is not None
    reply = call(daemon, "knob", params | {"value": 3, "hold_s": 0})
    assert reply["hold_until_s"] is None
    assert daemon.knob_holds.active("digits", "num_workers") is None


def test_a_refused_request_ends_its_hold(tmp_path: Path) -> None:
    refused = Reply("c-1", ok=False, error_code="bad_request", error_message="out of range")
    daemon = FakeDaemon(policy_file(tmp_path), commander=FakeCommander([refused]))
    with pytest.raises(ProtocolError):
        call(daemon, "knob", {"job": "digits", "knob": "k", "value": 10**6})
    assert daemon.knob_holds.in_force() == []


def test_a_knob_not_applied_within_wait_s_is_pending(tmp_path: Path) -> None:
    daemon = FakeDaemon(policy_file(tmp_path), commander=FakeCommander([APPLIED], delay_s=5))
    reply = call(daemon, "knob", {"job": "digits", "knob": "k", "value": 1, "wait_s": 0})
    assert reply["state"] == "pending"


def test_a_refusal_carries_the_jobs_code_once_with_its_reason(tmp_path: Path) -> None:
    refused = Reply("c-1", ok=False, error_code="bad_request", error_message="out of range")
    daemon = FakeDaemon(policy_file(tmp_path), commander=FakeCommander([APPLIED, refused]))
    with pytest.raises(ProtocolError) as info:
        call(daemon, "knob", {"job": "digits", "knob": "k", "value": 10**6})
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert info.value.message == "out of range"  # printed as "bad_request: out of range"
    assert daemon.finished[0].outcome == "refused"
    assert daemon.finished[0].detail == "request c-1: bad_request: out of range"


def test_refusals_with_different_codes_are_conflict(tmp_path: Path) -> None:
    refused = [
        Reply("c-1", ok=False, error_code="bad_request", error_message="out of range"),
        Reply("c-2", ok=False, error_code="conflict", error_message="superseded"),
    ]
    daemon = FakeDaemon(policy_file(tmp_path), commander=FakeCommander(refused))
    with pytest.raises(ProtocolError) as info:
        call(daemon, "knob", {"job": "digits", "knob": "k", "value": 10**6})
    assert (info.value.code, info.value.message) == (
        ErrorCode.CONFLICT,
        "out of range; superseded",
    )


def test_a_job_not_attached_keeps_the_servers_code(tmp_path: Path) -> None:
    missing = ControlError(ErrorCode.NOT_FOUND, "no job 'x' is attached")
    daemon = FakeDaemon(policy_file(tmp_path), commander=FakeCommander([], error=missing))
    with pytest.raises(ProtocolError) as info:
        call(daemon, "knob", {"job": "x", "knob": "k", "value": 1})
    assert (info.value.code, info.value.message) == (ErrorCode.NOT_FOUND, missing.message)


@pytest.mark.parametrize(
    "params",
    [
        {"knob": "k", "value": 1},
        {"job": "digits", "knob": 3, "value": 1},
        {"job": "digits", "knob": "k"},
        {"job": "digits", "knob": "k", "value": [1]},
        {"job": "digits", "knob": "k", "value": 1, "wait_s": 601},
        {"job": "digits", "knob": "k", "value": 1, "wait_s": True},
        {"job": "digits", "knob": "k", "value": 1, "hold_s": 86401},
        {"job": "digits", "knob": "k", "value": 1, "hold_s": -1},
        {"job": "digits", "knob": "k", "value": 1, "hold_s": "30m"},
    ],
)
def test_bad_params_are_bad_request(tmp_path: Path, params: dict[str, object]) -> None:
    commander = FakeCommander([APPLIED])
    with pytest.raises(ProtocolError) as info:
        call(FakeDaemon(policy_file(tmp_path), commander=commander), "knob", params)
    assert info.value.code == ErrorCode.BAD_REQUEST and commander.sent == []


def test_no_control_server_is_internal(tmp_path: Path) -> None:
    with pytest.raises(ProtocolError) as info:
        call(FakeDaemon(policy_file(tmp_path)), "knob", {"job": "j", "knob": "k", "value": 1})
    assert info.value.code == ErrorCode.INTERNAL
