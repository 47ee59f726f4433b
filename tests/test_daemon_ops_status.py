"""The ``status`` op (gpuwatchd.daemon.ops.status) against a fake daemon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fake_daemon import FakeDaemon, call, policy_file
from gpuwatchd.control.protocol import MAX_LINE_BYTES, REPLY_BUDGET_BYTES, ErrorCode
from gpuwatchd.daemon.ops.status import TRUNCATED_PARTS
from gpuwatchd.errors import ProtocolError


def test_a_small_status_is_passed_whole(tmp_path: Path) -> None:
    status = {"ticks": 3, "decisions": [{"id": 1}], "findings": [{"detector": "x"}]}
    reply = call(FakeDaemon(policy_file(tmp_path), status=status), "status")
    assert reply == status | {"truncated": dict.fromkeys(TRUNCATED_PARTS, 0)}


def test_a_huge_status_drops_the_oldest_decisions_then_findings(tmp_path: Path) -> None:
    decisions = [{"id": i, "detail": "d" * 1000} for i in range(100)]
    findings = [{"n": i, "message": "f" * 1000} for i in range(100)]
    daemon = FakeDaemon(
        policy_file(tmp_path), status={"decisions": decisions, "findings": findings}
    )
    reply = call(daemon, "status")
    line = json.dumps({"id": 1, "ok": True, "result": reply}, separators=(",", ":"))
    assert REPLY_BUDGET_BYTES - 2000 < len(line.encode()) < MAX_LINE_BYTES
    assert reply["decisions"] == []  # every decision went before any finding
    kept = len(reply["findings"])
    assert reply["truncated"] == dict.fromkeys(TRUNCATED_PARTS, 0) | {
        "decisions": 100,
        "findings": 100 - kept,
    }
    assert reply["findings"] == findings[100 - kept :]  # the newest stay


def test_a_status_built_whole_is_cut_as_the_daemons_view_cuts_it(tmp_path: Path) -> None:
    # one place trims a status (gpuwatchd/daemon/ops/status.py): past the history, the
    # last jobs, then the policies' definitions (names kept), then the last managed jobs
    jobs = [{"name": f"job-{n:02d}", "pid": n, "note": "j" * 1000} for n in range(40)]
    policies = {"sources": ["p.yaml"], "policies": [{"name": "a", "when": "w" * 9000}]}
    managed = [{"job": f"m-{n:02d}", "note": "m" * 1000} for n in range(60)]
    status = {"decisions": [{"id": 1}], "findings": [], "jobs": jobs, "policies": policies}
    reply = call(FakeDaemon(policy_file(tmp_path), status=status | {"managed": managed}), "status")
    line = json.dumps({"id": 1, "ok": True, "result": reply}, separators=(",", ":"))
    assert len(line.encode()) < MAX_LINE_BYTES
    assert reply["decisions"] == [] and reply["jobs"] == []
    assert reply["policies"] == {"sources": ["p.yaml"], "policies": [{"name": "a"}]}
    kept = len(reply["managed"])
    assert 0 < kept < 60 and reply["managed"] == managed[:kept]  # the first stay
    assert reply["truncated"] == dict.fromkeys(TRUNCATED_PARTS, 0) | {
        "decisions": 1,
        "jobs": 40,
        "policies": 1,
        "managed": 60 - kept,
    }


def test_an_unknown_op_is_unknown_op(tmp_path: Path) -> None:
    with pytest.raises(ProtocolError) as info:
        call(FakeDaemon(policy_file(tmp_path)), "statuz")
    assert info.value.code == ErrorCode.UNKNOWN_OP


def test_full_must_be_a_boolean_and_reaches_the_daemon(tmp_path: Path) -> None:
    daemon = FakeDaemon(policy_file(tmp_path), status={"decisions": [], "findings": []})
    call(daemon, "status", {"full": True})
    call(daemon, "status")
    assert daemon.status_full == [True, False]
    with pytest.raises(ProtocolError) as info:
        call(daemon, "status", {"full": "yes"})
    assert info.value.code == ErrorCode.BAD_REQUEST
