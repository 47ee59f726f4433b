"""The ``events`` op (gpuwatchd.daemon.ops.events) against a fake daemon with a real journal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fake_daemon import FakeDaemon, call, policy_file
from gpuwatchd.control.protocol import ErrorCode
from gpuwatchd.daemon.ops.events import MAX_LIMIT
from gpuwatchd.errors import ProtocolError
from gpuwatchd.journal import Journal
from gpuwatchd.model import Finding

T0 = 1_700_000_000.0


def _finding(n: int, message: str = "idle") -> Finding:
    return Finding("low_utilization", f"gpu:GPU-{n}", T0 + n, T0 + n, 3.0, 20.0, message)


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    j = Journal.open(tmp_path / "journal.sqlite3", now_s=T0)
    for n in range(5):  # five findings start, one per tick
        j.record_tick(T0 + n, [_finding(m) for m in range(n + 1)])
    yield j
    j.close()


def test_the_tail_then_a_cursor(tmp_path: Path, journal: Journal) -> None:
    daemon = FakeDaemon(policy_file(tmp_path), journal=journal)
    tail = call(daemon, "events", {"limit": 2})
    assert [e["id"] for e in tail["events"]] == [4, 5] and tail["last_id"] == 5
    page = call(daemon, "events", {"after_id": 1, "limit": 2})
    assert [e["id"] for e in page["events"]] == [2, 3]
    assert page["more"] is True and page["last_id"] == 3
    rest = call(daemon, "events", {"after_id": 3})
    assert [e["id"] for e in rest["events"]] == [4, 5] and rest["more"] is False
    assert call(daemon, "events", {"after_id": 5}) == {"events": [], "last_id": 5, "more": False}


def test_a_reply_is_cut_to_fit_one_line(tmp_path: Path) -> None:
    j = Journal.open(tmp_path / "big.sqlite3", now_s=T0)
    try:
        j.record_tick(T0, [_finding(n, "x" * 3000) for n in range(40)])
        reply = call(FakeDaemon(policy_file(tmp_path), journal=j), "events", {"since_s": 0})
    finally:
        j.close()
    assert 0 < len(reply["events"]) < 40 and reply["more"] is True
    assert reply["last_id"] == reply["events"][-1]["id"]


@pytest.mark.parametrize(
    "params",
    [
        {"since_s": "yesterday"},
        {"since_s": True},
        {"after_id": -1},
        {"after_id": 1.5},
        {"limit": 0},
        {"limit": MAX_LIMIT + 1},
    ],
)
def test_bad_params_are_bad_request(
    tmp_path: Path, journal: Journal, params: dict[str, object]
) -> None:
    with pytest.raises(ProtocolError) as info:
        call(FakeDaemon(policy_file(tmp_path), journal=journal), "events", params)
    assert info.value.code == ErrorCode.BAD_REQUEST


def test_no_journal_is_internal(tmp_path: Path) -> None:
    with pytest.raises(ProtocolError) as info:
        call(FakeDaemon(policy_file(tmp_path)), "events")
    assert info.value.code == ErrorCode.INTERNAL
