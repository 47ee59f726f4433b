"""The action journal on a real SQLite file: WAL, write-ahead records, ordering, retention,
recovery after a killed daemon, corrupt and foreign files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gpuwatchd.errors import JournalError
from gpuwatchd.journal import (
    DEFAULT_RETENTION_S,
    JOURNAL_FILENAME,
    SCHEMA_VERSION,
    Journal,
    Outcome,
)
from gpuwatchd.model import Decision, Finding

T0 = 1_700_000_000.0
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"


def finding(
    detector: str = "low_utilization", subject: str = f"gpu:{GPU1}", t: float = T0
) -> Finding:
    return Finding(
        detector=detector,
        subject=subject,
        timestamp_s=t,
        since_s=t - 30.0,
        value=3.0,
        threshold=20.0,
        message="GPU 1 utilization 3.0 % < 20 % for 30s",
        gpu_uuid=GPU1,
        gpu_index=1,
    )


def decision(
    policy: str = "gpu-idle",
    action: str = "log",
    t: float = T0,
    job: str | None = None,
    params: dict[str, object] | None = None,
    dry_run: bool = False,
) -> Decision:
    return Decision(
        policy=policy,
        action=action,
        params=params if params is not None else {"message": "GPU idle", "level": "warning"},
        timestamp_s=t,
        findings=(finding(t=t),),
        job=job,
        gpu_uuid=GPU1,
        dry_run=dry_run,
        reason="GPU 1 utilization 3.0 % < 20 % for 30s",
    )


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / JOURNAL_FILENAME


def external(path: Path) -> sqlite3.Connection:
    """A second connection, as an operator's sqlite3 shell would open the file."""
    return sqlite3.connect(path, isolation_level=None)


def test_new_journal_is_wal_normal_and_versioned(path: Path) -> None:
    with Journal.open(path) as journal:
        assert journal.moved_aside is None
        db = journal._db
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        journal.record_tick(T0, [finding()])
        assert Path(str(path) + "-wal").exists()  # the commit went to the write-ahead log
    other = external(path)
    assert other.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    tables = {r[0] for r in other.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"findings", "decisions", "outcomes", "events"} <= tables
    # WAL mode is persistent in the file: every later connection uses it too.
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_quiet_tick_writes_nothing(path: Path) -> None:
    with Journal.open(path) as journal:
        journal.record_tick(T0, [finding()])
        watcher = external(path)
        before = watcher.execute("PRAGMA data_version").fetchone()[0]
        # The finding still holds and nothing is decided: nothing to write.
        assert journal.record_tick(T0 + 1, [finding(t=T0 + 1)]) == []
        # data_version changes when *another* connection commits (sqlite.org/pragma.html).
        assert watcher.execute("PRAGMA data_version").fetchone()[0] == before
        journal.record_tick(T0 + 2, [])  # it cleared
        assert watcher.execute("PRAGMA data_version").fetchone()[0] != before


def test_one_row_per_episode_and_ordered_stream(path: Path) -> None:
    f = finding()
    with Journal.open(path) as journal:
        journal.record_tick(T0, [f])
        # The same (detector, subject) reported again is not a new episode.
        journal.record_tick(T0 + 1, [f])
        ids = journal.record_tick(T0 + 2, [f], decisions=[decision(t=T0 + 2)])
        assert len(ids) == 1
        journal.record_outcome(ids[0], "logged", "", T0 + 2.5)
        journal.record_tick(T0 + 3, [])
        journal.record_tick(T0 + 4, [f])  # a second episode
        events = journal.events(since_s=0)
    kinds = [e["kind"] for e in events]
    assert kinds == ["finding_started", "decision", "outcome", "finding_cleared", "finding_started"]
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)
    assert len({e["id"] for e in events}) == len(events)
    first, dec, out, cleared, second = events
    assert first["finding_id"] == cleared["finding_id"] != second["finding_id"]
    assert first["detector"] == "low_utilization" and first["subject"] == f"gpu:{GPU1}"
    assert first["gpu_index"] == 1 and first["value"] == 3.0 and first["threshold"] == 20.0
    assert cleared["clear_reason"] == "condition" and cleared["time_s"] == T0 + 3
    assert dec["decision_id"] == ids[0] == out["decision_id"]
    assert dec["policy"] == "gpu-idle" and dec["action"] == "log"
    assert dec["params"] == {"message": "GPU idle", "level": "warning"}
    assert dec["findings"] == [
        {
            "detector": "low_utilization",
            "subject": f"gpu:{GPU1}",
            "value": 3.0,
            "threshold": 20.0,
        }
    ]
    assert dec["findings_count"] == 1 and dec["dry_run"] is False
    assert out["outcome"] == "logged" and out["time_s"] == T0 + 2.5


def test_events_tail_since_after_and_limit(path: Path) -> None:
    with Journal.open(path) as journal:
        for i in range(10):
            journal.record_tick(T0 + i, decisions=[decision(policy=f"p{i}", t=T0 + i)])
        tail = journal.events(limit=3)
        assert [e["policy"] for e in tail] == ["p7", "p8", "p9"]  # the latest, oldest first
        since = journal.events(since_s=T0 + 5, limit=3)
        assert [e["policy"] for e in since] == ["p5", "p6", "p7"]
        after = journal.events(after_id=since[-1]["id"], limit=100)
        assert [e["policy"] for e in after] == ["p8", "p9"]
        assert journal.events(after_id=journal.last_event_id()) == []
        assert journal.events(limit=0) == []


def test_decisions_round_trip_for_restore(path: Path) -> None:
    knob = decision(
        policy="starved",
        action="set_knob",
        t=T0 + 1,
        job="digits",
        params={"knob": "num_workers", "value": 8, "previous": 4},
    )
    dry = decision(t=T0 + 2, dry_run=True)
    with Journal.open(path) as journal:
        journal.record_tick(T0 + 1, decisions=[knob])
        journal.record_tick(T0 + 2, decisions=[dry], outcomes=[Outcome("dry-run")])
    with Journal.open(path) as journal:
        assert journal.decisions_since(T0) == [knob, dry]  # equal dataclasses, findings too
        assert journal.decisions_since(T0 + 1.5) == [dry]
        recent = journal.recent_decisions(10)
    assert [(r.decision.policy, r.outcome) for r in recent] == [
        ("starved", "pending"),
        ("gpu-idle", "dry-run"),
    ]


def test_latest_ladder_decision_is_kept_whatever_its_age(path: Path) -> None:
    lower = [
        decision(
            policy="vram-ladder",
            action="lower_parallelism",
            job="hpo",
            t=T0 + i,
            params={"workers": 3 - i},
        )
        for i in range(2)
    ]
    with Journal.open(path) as journal:
        journal.record_tick(T0, decisions=lower[:1])
        journal.record_tick(T0 + 1, decisions=lower[1:])
        journal.record_tick(T0 + 5, decisions=[decision(t=T0 + 5)])
        restored = journal.decisions_since(T0 + 4)
        assert [(d.action, d.params) for d in restored] == [
            ("lower_parallelism", {"workers": 2}),
            ("log", {"message": "GPU idle", "level": "warning"}),
        ]
        assert journal.decisions_since(T0 + 4, latest_of=()) == [decision(t=T0 + 5)]


def test_outcome_validation(path: Path) -> None:
    with Journal.open(path) as journal:
        (decision_id,) = journal.record_tick(T0, decisions=[decision()])
        with pytest.raises(ValueError):
            journal.record_outcome(decision_id, "pending")
        with pytest.raises(ValueError):
            journal.record_outcome(decision_id, "exploded")
        with pytest.raises(KeyError):
            journal.record_outcome(decision_id + 99, "applied")
        with pytest.raises(ValueError):
            journal.record_tick(T0, decisions=[decision()], outcomes=[])
        journal.record_outcome(decision_id, "refused", "bad_request: num_workers above 64")
        (entry,) = journal.journaled_since(0)
        assert entry.outcome == "refused" and "above 64" in entry.detail
        assert entry.finished_s == T0  # defaults to the decision's time


def test_recover_closes_what_a_killed_daemon_left_open(path: Path) -> None:
    with Journal.open(path) as journal:
        both = [finding(), finding("vram_above")]
        journal.record_tick(T0, both)
        journal.record_tick(
            T0 + 1,
            both,
            decisions=[
                decision(action="set_knob", job="digits", params={"knob": "num_workers"}),
                decision(),
            ],
            outcomes=[None, Outcome("logged", "", T0 + 1)],
        )
        # no close(): the process "dies" here; committed rows are in the file
    journal = Journal.open(path)
    try:
        recovery = journal.recover(T0 + 100)
        assert (recovery.findings_closed, recovery.decisions_unknown) == (2, 1)
        assert journal.recover(T0 + 101) == type(recovery)(0, 0)  # idempotent
        events = journal.events(since_s=T0 + 100)
        assert sorted(e["kind"] for e in events) == [
            "finding_cleared",
            "finding_cleared",
            "outcome",
        ]
        assert {e.get("clear_reason") for e in events if e["kind"] == "finding_cleared"} == {
            "stopped"
        }
        (unknown,) = [e for e in events if e["kind"] == "outcome"]
        assert unknown["outcome"] == "unknown" and "stopped" in unknown["detail"]
        # The same finding seen again after the restart starts a new episode.
        journal.record_tick(T0 + 110, [finding()])
        starts = [e for e in journal.events(since_s=0) if e["kind"] == "finding_started"]
        assert len(starts) == 3 and len({e["finding_id"] for e in starts}) == 3
    finally:
        journal.close()


def test_prune_keeps_recent_open_and_ladder_rows_and_ids_never_go_back(path: Path) -> None:
    day = 86400.0
    with Journal.open(path, retention_s=10 * day) as journal:
        old = T0 - 20 * day
        vram, idle = finding("vram_above"), finding()  # vram stays open: kept
        journal.record_tick(old, [vram, idle])
        (old_id,) = journal.record_tick(
            old, [vram, idle], decisions=[decision(t=old)], outcomes=[Outcome("logged", "", old)]
        )
        journal.record_tick(old + 1, [vram])  # idle cleared
        journal.record_tick(
            old + 1,
            [vram],
            decisions=[
                decision(policy="ladder", action="lower_parallelism", job="hpo", t=old, params={})
            ],
        )
        journal.record_tick(T0, [vram], decisions=[decision(t=T0)])
        highest = journal.last_event_id()
        deleted = journal.prune(T0)
        assert deleted > 0
        left = journal.events(since_s=0)
        assert [(e["kind"], e.get("policy")) for e in left] == [("decision", "gpu-idle")]
        kept = journal.journaled_since(0)
        assert [(d.decision.action, d.decision.timestamp_s) for d in kept] == [
            ("lower_parallelism", old),
            ("log", T0),
        ]
        assert old_id not in {d.id for d in kept}
        db = journal._db
        assert db.execute("SELECT count(*) FROM outcomes").fetchone()[0] == 0
        assert db.execute("SELECT detector FROM findings").fetchall() == [("vram_above",)]
        # AUTOINCREMENT: an after_id cursor stays valid, ids are never reused.
        journal.record_tick(T0 + 1, [vram, idle])
        assert journal.last_event_id() > highest
    assert DEFAULT_RETENTION_S == 30 * 86400


def test_corrupt_file_is_moved_aside_and_a_new_journal_starts(path: Path) -> None:
    garbage = b"this is not an SQLite database\n" * 200
    path.write_bytes(garbage)
    with Journal.open(path, now_s=T0) as journal:
        assert journal.moved_aside == path.with_name(f"{JOURNAL_FILENAME}.corrupt-20231114T221320Z")
        journal.record_tick(T0, [finding()])
        assert [e["kind"] for e in journal.events()] == ["finding_started"]
    assert journal.moved_aside.read_bytes() == garbage  # kept for a post-mortem


def test_damaged_pages_are_detected(path: Path) -> None:
    with Journal.open(path) as journal:
        for i in range(200):
            journal.record_tick(T0 + i, decisions=[decision(t=T0 + i)])
    size = path.stat().st_size
    assert size > 8 * 4096
    with path.open("r+b") as handle:  # scribble over pages in the middle (b-tree pages)
        handle.seek(4096 * 2)
        handle.write(b"\xa5" * 4096 * 4)
    with Journal.open(path, now_s=T0) as journal:
        assert journal.moved_aside is not None and journal.moved_aside.exists()
        assert journal.events() == []


def test_newer_schema_is_refused_and_left_alone(path: Path) -> None:
    db = external(path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    before = path.read_bytes()
    with pytest.raises(JournalError, match="schema version 99"):
        Journal.open(path)
    assert path.read_bytes() == before
    assert not list(path.parent.glob("*.corrupt-*"))


def test_unopenable_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match="cannot open the journal"):
        Journal.open(tmp_path / "missing" / JOURNAL_FILENAME)


def test_a_failed_write_raises_and_leaves_nothing_half_written(path: Path) -> None:
    with Journal.open(path) as journal:
        journal.record_tick(T0, [finding()])
        locker = external(path)
        locker.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        with pytest.raises(JournalError, match="locked"):
            journal.record_tick(T0 + 1, [], decisions=[decision(t=T0 + 1)])
        locker.execute("ROLLBACK")
        assert [e["kind"] for e in journal.events()] == ["finding_started"]
        # The journal's own view did not move either: the next tick records the clear.
        journal.record_tick(T0 + 2, [])
        assert [e["kind"] for e in journal.events()] == ["finding_started", "finding_cleared"]


def test_a_newer_dry_run_ladder_decision_never_pushes_out_the_real_position(path: Path) -> None:
    """The ladder position is the latest *non-dry-run* ladder decision of each job (a
    dry-run decision moves no ladder), whichever policy or action made it: prune and
    restore keep it, however old, and however many dry-run ones came after it."""
    day = 86400.0
    old = T0 - 20 * day

    def ladder(policy: str, action: str, to: int, t: float, dry: bool = False) -> Decision:
        return decision(policy, action, t, "hpo", {"job": "hpo", "to": to}, dry)

    real_raise = ladder("clean-raise", "raise_parallelism", 3, old)
    real_lower = ladder("vram-lower", "lower_parallelism", 2, old + 1)
    dry_lower = ladder("vram-lower", "lower_parallelism", 1, old + 2, dry=True)
    other_job = decision("vram-lower", "lower_parallelism", old, "other", {"to": 1})
    with Journal.open(path, retention_s=10 * day) as journal:
        for d in (real_raise, real_lower, dry_lower, other_job):
            journal.record_tick(d.timestamp_s, decisions=[d])
        assert journal.decisions_since(T0) == [real_lower, other_job]  # by id
        journal.prune(T0)
        kept = [j.decision for j in journal.journaled_since(0)]
    assert sorted(kept, key=lambda d: d.timestamp_s) == [other_job, real_lower]


def test_event_ids_continue_after_a_journal_replaced_for_corruption(path: Path) -> None:
    """A follower that read up to the old last id must see the new journal's events."""
    with Journal.open(path) as journal:
        for i in range(30):
            journal.record_tick(T0 + i, decisions=[decision(t=T0 + i)])
        old_last = journal.last_event_id()
    assert old_last >= 30
    with path.open("r+b") as handle:  # damage pages in the middle; the header still reads
        handle.seek(4096 * 2)
        handle.write(b"\xa5" * 4096)
    with Journal.open(path, now_s=T0 + 100) as journal:
        assert journal.moved_aside is not None
        journal.record_tick(T0 + 100, decisions=[decision(t=T0 + 100)])
        new = journal.events(after_id=old_last)
        assert new and all(e["id"] > old_last for e in new)
        assert journal.ids_continue_after is not None and journal.ids_continue_after >= old_last


def test_event_ids_continue_after_an_unreadable_journal_was_replaced(path: Path) -> None:
    with Journal.open(path) as journal:
        journal.record_tick(T0, decisions=[decision(t=T0)])
        old_last = journal.last_event_id()
    path.write_bytes(b"garbage, not SQLite\n" * 100)  # nothing of the old ids can be read
    with Journal.open(path, now_s=T0 + 1) as journal:
        journal.record_tick(T0 + 1, decisions=[decision(t=T0 + 1)])
        assert journal.events(after_id=old_last)  # ids continue after the time, in ms
        assert journal.ids_continue_after == int((T0 + 1) * 1000)


# -- every worker death is its own journal event (issue 10 item 5) ---------------------------

CRASH_POLICY = """\
policies:
  - name: crashes-logged
    when: {job_crashed: {kind: any}}
    do:
      - log: {message: "worker crashed"}
"""


def _crash_findings(engine: object, t: float, *pids: int) -> tuple[Finding, ...]:
    """The findings of one engine tick whose snapshot carries a crash event per pid."""
    from gpuwatchd.model import JobEvent, Snapshot
    from gpuwatchd.policy.engine import PolicyEngine

    assert isinstance(engine, PolicyEngine)
    events = tuple(JobEvent(t, "chaos", "crash", pid=pid, crash_kind="other") for pid in pids)
    return engine.step(Snapshot(t, (), None, events=events)).findings


def _started_messages(journal: Journal) -> list[str]:
    return [e["message"] for e in journal.events(since_s=0) if e["kind"] == "finding_started"]


def test_each_crash_of_one_job_starts_its_own_finding(tmp_path: Path) -> None:
    """Two deaths on one tick, then one on the next tick (the first episode still open):
    three ``finding_started``; the job's one subject used to merge them into one."""
    from gpuwatchd.policy.engine import PolicyEngine
    from gpuwatchd.policy.schema import parse_policies

    engine = PolicyEngine(parse_policies(CRASH_POLICY, "crash.yaml"))
    with Journal.open(tmp_path / JOURNAL_FILENAME) as journal:
        journal.record_tick(T0, _crash_findings(engine, T0, 101, 102))
        journal.record_tick(T0 + 0.25, _crash_findings(engine, T0 + 0.25, 103))
        journal.record_tick(T0 + 0.5, _crash_findings(engine, T0 + 0.5))
        started = _started_messages(journal)
    assert len(started) == 3, started
    for pid in (101, 102, 103):
        assert [m for m in started if f"pid {pid} crashed" in m], (pid, started)


def test_a_crash_after_a_restart_with_a_crash_episode_open_is_journaled(tmp_path: Path) -> None:
    """A daemon killed on the tick of a crash leaves that episode open; the next daemon's
    first crash of the same job is a new ``finding_started``, not the open episode."""
    from gpuwatchd.policy.engine import PolicyEngine
    from gpuwatchd.policy.schema import parse_policies

    path = tmp_path / JOURNAL_FILENAME
    first = Journal.open(path)
    first.record_tick(T0, _crash_findings(PolicyEngine(parse_policies(CRASH_POLICY, "c")), T0, 7))
    first._db.close()  # killed: nothing cleared, nothing closed cleanly
    engine = PolicyEngine(parse_policies(CRASH_POLICY, "c"))
    with Journal.open(path) as journal:
        journal.record_tick(T0 + 5, _crash_findings(engine, T0 + 5, 8))
        started = _started_messages(journal)
    assert [m for m in started if "pid 8 crashed" in m], started
