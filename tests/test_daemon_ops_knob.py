"""The ``knob`` op (gpuwatchd.daemon.ops.knob) against a fake daemon and a fake job side."""

from __future__ import annotations

from pathlib import Path

import pytest

from fake_daemon import FakeCommander, FakeDaemon, call, policy_file
from gpuwatchd.control.protocol import ErrorCode, Reply
from gpuwatchd.errors import ControlError, ProtocolError

APPLIED = Reply("c-1", ok=True, result={"applied": True})


def test_an_applied_knob(tmp_path: Path) -> None:
    commander = FakeCommander([APPLIED])
    daemon = FakeDaemon(policy_file(tmp_path), commander=commander)
    reply = call(daemon, "knob", {"job": "digits", "knob": "num_workers", "value": 2})
    assert reply == {
        "job": "digits",
        "knob": "num_workers",
        "value": 2,
        "state": "applied",
        "decision_id": 1,
    }
    assert commander.sent == [("digits", "set_knob", {"knob": "num_workers", "value": 2})]
    # journaled as an operator's decision, with its outcome
    (record,) = daemon.decisions
    assert (record.decision.policy, record.decision.action) == ("operator", "set_knob")
    assert record.decision.params == {"knob": "num_workers", "value": 2}
    assert daemon.finished == [record] and record.outcome == "applied"


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
