"""The action journal: findings, decisions and outcomes in SQLite, durable across restarts.

Specification: docs/modules.md#gpuwatchdjournal
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

from gpuwatchd.errors import JournalError
from gpuwatchd.model import Decision, Finding
from gpuwatchd.policy.engine import LADDER_ACTIONS

__all__ = [
    "DEFAULT_RETENTION_S",
    "EVENT_KINDS",
    "JOURNAL_FILENAME",
    "OUTCOMES",
    "SCHEMA_VERSION",
    "Journal",
    "JournaledDecision",
    "Outcome",
    "Recovery",
]

JOURNAL_FILENAME: Final = "journal.sqlite3"
SCHEMA_VERSION: Final = 2
"""``PRAGMA user_version`` of the schema this module writes (2: the indexes prune uses;
the schema script is idempotent, so a version-1 journal is upgraded in place)."""
DEFAULT_RETENTION_S: Final = 30 * 86400.0
"""Rows older than this are pruned (30 days: a month of HPO runs to look back on; the
daemon passes the config's ``journal_retention``, whose default is the same)."""
EVENT_KINDS: Final = ("finding_started", "finding_cleared", "decision", "outcome")
OUTCOMES: Final = ("pending", "applied", "refused", "failed", "logged", "dry-run", "unknown")
"""``pending`` until the actuator knows; ``unknown`` when the daemon stopped before it did."""
CLEARED_BY_CONDITION: Final = "condition"
"""``clear_reason`` of a finding whose condition stopped holding."""
CLEARED_BY_STOP: Final = "stopped"
"""``clear_reason`` of a finding still open when the daemon stopped (not observed since)."""

_MAX_TEXT: Final = 4000
"""Longest message/reason/detail stored (characters); longer ones are cut with ``…``."""
_MAX_EVENT_FINDINGS: Final = 16
"""Findings summarised in a ``decision`` event (``findings_count`` gives the total)."""
_BUSY_TIMEOUT_MS: Final = 100
"""How long a write waits for a lock held by another connection (e.g. an operator's
``sqlite3`` shell) before failing, so a tick is never stuck."""

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS findings (
    id INTEGER PRIMARY KEY,
    detector TEXT NOT NULL,
    subject TEXT NOT NULL,
    started_s REAL NOT NULL,
    since_s REAL NOT NULL,
    value REAL,
    threshold REAL,
    message TEXT NOT NULL,
    gpu_uuid TEXT,
    gpu_index INTEGER,
    job TEXT,
    cleared_s REAL,
    clear_reason TEXT
);
CREATE INDEX IF NOT EXISTS findings_open ON findings (detector, subject) WHERE cleared_s IS NULL;
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY,
    timestamp_s REAL NOT NULL,
    policy TEXT NOT NULL,
    action TEXT NOT NULL,
    params TEXT NOT NULL,
    job TEXT,
    gpu_uuid TEXT,
    dry_run INTEGER NOT NULL,
    reason TEXT NOT NULL,
    findings TEXT NOT NULL,
    outcome TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    finished_s REAL
);
CREATE INDEX IF NOT EXISTS decisions_time ON decisions (timestamp_s);
CREATE INDEX IF NOT EXISTS decisions_pending ON decisions (id) WHERE outcome = 'pending';
CREATE TABLE IF NOT EXISTS outcomes (
    id INTEGER PRIMARY KEY,
    decision_id INTEGER NOT NULL REFERENCES decisions (id),
    outcome TEXT NOT NULL,
    detail TEXT NOT NULL,
    finished_s REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS outcomes_decision ON outcomes (decision_id);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time_s REAL NOT NULL,
    kind TEXT NOT NULL,
    ref_id INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS events_time ON events (time_s);
CREATE INDEX IF NOT EXISTS events_ref ON events (kind, ref_id);
CREATE INDEX IF NOT EXISTS findings_cleared ON findings (cleared_s) WHERE cleared_s IS NOT NULL;
"""

_DECISION_COLUMNS: Final = (
    "id, timestamp_s, policy, action, params, job, gpu_uuid, dry_run, reason, findings, "
    "outcome, detail, finished_s"
)

_EVENTS_SELECT: Final = """
SELECT e.id, e.time_s, e.kind,
       f.id, f.detector, f.subject, f.gpu_uuid, f.gpu_index, f.job, f.value, f.threshold,
       f.message, f.since_s, f.clear_reason,
       d.id, d.policy, d.action, d.params, d.job, d.gpu_uuid, d.dry_run, d.reason, d.findings,
       o.outcome, o.detail
FROM events AS e
LEFT JOIN findings AS f
       ON e.kind IN ('finding_started', 'finding_cleared') AND f.id = e.ref_id
LEFT JOIN outcomes AS o ON e.kind = 'outcome' AND o.id = e.ref_id
LEFT JOIN decisions AS d
       ON d.id = CASE e.kind WHEN 'decision' THEN e.ref_id WHEN 'outcome' THEN o.decision_id END
"""

_CORRUPT_NAMES: Final = frozenset({"SQLITE_CORRUPT", "SQLITE_NOTADB"})


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a decision: one of :data:`OUTCOMES` (not ``pending``), detail, when."""

    outcome: str
    detail: str = ""
    finished_s: float | None = None


@dataclass(frozen=True, slots=True)
class JournaledDecision:
    """A decision read back from the journal with its id and latest outcome."""

    id: int
    decision: Decision
    outcome: str
    detail: str
    finished_s: float | None


@dataclass(frozen=True, slots=True)
class Recovery:
    """What :meth:`Journal.recover` found left open by a daemon that stopped."""

    findings_closed: int
    decisions_unknown: int


def _text(value: str | None) -> str:
    text = value or ""
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 1] + "…"


def _number(value: object) -> float | None:
    """A finite float for SQLite, or None (NA, NaN and inf are not numbers we keep)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _json_default(value: object) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return None if str(value) == "N/A" else str(value)


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, default=_json_default)


def _finding_dict(finding: Finding) -> dict[str, Any]:
    return {
        "detector": finding.detector,
        "subject": finding.subject,
        "timestamp_s": finding.timestamp_s,
        "since_s": finding.since_s,
        "value": _number(finding.value),
        "threshold": _number(finding.threshold),
        "message": _text(finding.message),
        "gpu_uuid": finding.gpu_uuid,
        "gpu_index": finding.gpu_index,
        "job": finding.job,
    }


def _finding_from(d: Mapping[str, Any]) -> Finding:
    value, threshold = d.get("value"), d.get("threshold")
    return Finding(
        detector=str(d["detector"]),
        subject=str(d["subject"]),
        timestamp_s=float(d["timestamp_s"]),
        since_s=float(d["since_s"]),
        value=float(value) if value is not None else math.nan,
        threshold=float(threshold) if threshold is not None else math.nan,
        message=str(d.get("message", "")),
        gpu_uuid=d.get("gpu_uuid"),
        gpu_index=d.get("gpu_index"),
        job=d.get("job"),
    )


def _decision_from(row: Sequence[Any]) -> JournaledDecision:
    (id_, ts, policy, action, params, job, gpu, dry, reason, findings, outcome, detail, fin) = row
    decision = Decision(
        policy=policy,
        action=action,
        params=json.loads(params),
        timestamp_s=ts,
        findings=tuple(_finding_from(f) for f in json.loads(findings)),
        job=job,
        gpu_uuid=gpu,
        dry_run=bool(dry),
        reason=reason,
    )
    return JournaledDecision(id_, decision, outcome, detail, fin)


def _is_corruption(exc: sqlite3.DatabaseError) -> bool:
    name = getattr(exc, "sqlite_errorname", None)  # Python >= 3.11
    if name is not None:
        return name in _CORRUPT_NAMES
    return not isinstance(exc, sqlite3.OperationalError)


def _continue_ids(db: sqlite3.Connection, old: Path, *, stamp_s: float | None) -> int:
    """Make the new journal's event ids continue after the old one's (the README promises
    ids are never reused: a follower resumes with ``after_id``). The old maximum is read
    from the file moved aside at ``old`` when SQLite still can; else ids continue after
    the time of the replacement in milliseconds (``stamp_s``, default now), above any id
    one journal reaches. Returns the id the new ids continue after."""
    highest: int | None = None
    try:
        old_db = sqlite3.connect(f"{old.resolve().as_uri()}?mode=ro", uri=True)
        try:
            (largest,) = old_db.execute("SELECT MAX(id) FROM events").fetchone()
            sequence = old_db.execute(
                "SELECT MAX(seq) FROM sqlite_sequence WHERE name = 'events'"
            ).fetchone()[0]
        finally:
            old_db.close()
        highest = max(int(largest or 0), int(sequence or 0))
    except (sqlite3.Error, TypeError, ValueError):
        highest = None
    if highest is None:
        now = stamp_s if stamp_s is not None else datetime.now(timezone.utc).timestamp()
        highest = int(now * 1000)
    db.execute("BEGIN IMMEDIATE")
    db.execute("DELETE FROM sqlite_sequence WHERE name = 'events'")
    db.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('events', ?)", (highest,))
    db.execute("COMMIT")
    return highest


def _utc_stamp(now_s: float) -> str:
    return datetime.fromtimestamp(now_s, timezone.utc).strftime("%Y%m%dT%H%M%SZ")


class _Corrupt(Exception):
    """Internal: the file is not a usable SQLite database."""


class Journal:
    """An open journal file. Create with :meth:`open`; close with :meth:`close`.

    ``retention_s`` (seconds) is what :meth:`prune` keeps. All ``*_s`` arguments are
    seconds on the daemon's clock (Unix time). Methods raise
    :class:`~gpuwatchd.errors.JournalError` when SQLite fails (disk full, I/O error,
    a lock held too long); nothing half-written stays (each call is one transaction).
    """

    def __init__(
        self,
        connection: sqlite3.Connection,
        path: Path,
        *,
        retention_s: float,
        moved_aside: Path | None,
    ) -> None:
        self._db = connection
        self.path = path
        self.retention_s = retention_s
        self.moved_aside = moved_aside
        """Where a corrupt journal found by :meth:`open` was moved, else None."""
        self.ids_continue_after: int | None = None
        """With :attr:`moved_aside`: the event id the new journal's ids continue after."""
        self._open: dict[tuple[str, str], int] = {
            (detector, subject): id_
            for id_, detector, subject in connection.execute(
                "SELECT id, detector, subject FROM findings WHERE cleared_s IS NULL"
            )
        }

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        now_s: float | None = None,
    ) -> Journal:
        """Open (or create) the journal at ``path``; its directory must exist.

        A corrupt file is moved aside to ``<path>.corrupt-<UTC time of now_s>`` and a new
        journal is created (see :attr:`moved_aside`; the caller logs it). Raises
        :class:`~gpuwatchd.errors.JournalError` when the file cannot be opened (missing
        directory, permissions, locked) or was written by a newer schema.
        """
        if retention_s <= 0:
            raise ValueError("retention_s must be positive")
        target = Path(path)
        moved: Path | None = None
        floor = 0
        try:
            connection = cls._connect(target)
        except _Corrupt as exc:
            stamp = _utc_stamp(
                now_s if now_s is not None else datetime.now(timezone.utc).timestamp()
            )
            moved = target.with_name(f"{target.name}.corrupt-{stamp}")
            try:
                for suffix in ("", "-wal", "-shm"):
                    source = Path(str(target) + suffix)
                    if source.exists():
                        source.rename(str(moved) + suffix)
            except OSError as move_exc:
                raise JournalError(
                    f"journal {target} is corrupt ({exc}) and cannot be moved aside: {move_exc}"
                ) from move_exc
            try:
                connection = cls._connect(target)
            except _Corrupt as again:  # pragma: no cover - a fresh file cannot be corrupt
                raise JournalError(f"cannot create a new journal at {target}: {again}") from None
            floor = _continue_ids(connection, moved, stamp_s=now_s)
        journal = cls(connection, target, retention_s=retention_s, moved_aside=moved)
        journal.ids_continue_after = floor if moved is not None else None
        return journal

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(path, isolation_level=None, timeout=_BUSY_TIMEOUT_MS / 1000)
        except sqlite3.Error as exc:
            raise JournalError(f"cannot open the journal {path}: {exc}") from None
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise JournalError(
                    f"the journal {path} has schema version {version}, newer than this "
                    f"gpuwatchd's {SCHEMA_VERSION}: upgrade gpuwatchd or move the file away"
                )
            check = [row[0] for row in db.execute("PRAGMA quick_check")]
            if check != ["ok"]:
                raise _Corrupt("; ".join(str(c) for c in check[:3]))
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise JournalError(f"cannot put the journal {path} in WAL mode (got {mode!r})")
            db.execute("PRAGMA synchronous=NORMAL")
            if version < SCHEMA_VERSION:
                db.execute("BEGIN IMMEDIATE")
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                db.execute("COMMIT")
        except (JournalError, _Corrupt):
            db.close()
            raise
        except sqlite3.DatabaseError as exc:
            db.close()
            if _is_corruption(exc):
                raise _Corrupt(str(exc)) from None
            raise JournalError(f"cannot open the journal {path}: {exc}") from None
        return db

    def close(self) -> None:
        """Close the file (idempotent). SQLite checkpoints the WAL on the last close."""
        db = self._db
        if db is not None:
            db.close()
            self._db = None  # type: ignore[assignment]

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ------------------------------------------------------------------------------

    def _transaction(self, what: str) -> _Tx:
        if self._db is None:
            raise JournalError("the journal is closed")
        return _Tx(self._db, what, self.path)

    def record_tick(
        self,
        now_s: float,
        findings: Iterable[Finding] = (),
        decisions: Sequence[Decision] = (),
        outcomes: Sequence[Outcome | None] | None = None,
    ) -> list[int]:
        """Record one tick: its findings' starts and clears, and its decisions.

        ``findings``: *every* finding of the tick (``StepResult.findings``). The journal
        compares their ``(detector, subject)`` keys with the episodes it has open: a new
        key starts an episode (a ``findings`` row), an open key that is missing clears
        it. Because the comparison is with what was *committed*, a tick whose write
        failed is made good by the next one. ``outcomes`` (as long as ``decisions``, or
        None) gives the outcome of decisions known before acting (``logged``,
        ``dry-run``); None entries stay ``pending`` for :meth:`record_outcome`.

        One transaction; none at all when nothing starts, clears or is decided. Event
        order: clears, starts, then each decision and its outcome. Returns the
        decisions' ids. Raises JournalError (and writes nothing) when SQLite fails,
        ValueError for a bad ``outcomes``.
        """
        current = {(f.detector, f.subject): f for f in findings}
        known_open = self._open
        started = [f for key, f in current.items() if key not in known_open]
        cleared = [key for key in known_open if key not in current]
        if not (started or cleared or decisions):
            return []
        if outcomes is not None and len(outcomes) != len(decisions):
            raise ValueError("outcomes must be as long as decisions")
        ids: list[int] = []
        opened: dict[tuple[str, str], int] = {}
        with self._transaction("record a tick") as db:
            for key in cleared:
                row_id = known_open[key]
                db.execute(
                    "UPDATE findings SET cleared_s = ?, clear_reason = ? WHERE id = ?",
                    (now_s, CLEARED_BY_CONDITION, row_id),
                )
                db.execute(
                    "INSERT INTO events (time_s, kind, ref_id) VALUES (?, 'finding_cleared', ?)",
                    (now_s, row_id),
                )
            for finding in started:
                f = _finding_dict(finding)
                cursor = db.execute(
                    "INSERT INTO findings (detector, subject, started_s, since_s, value, "
                    "threshold, message, gpu_uuid, gpu_index, job) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        f["detector"],
                        f["subject"],
                        now_s,
                        f["since_s"],
                        f["value"],
                        f["threshold"],
                        f["message"],
                        f["gpu_uuid"],
                        f["gpu_index"],
                        f["job"],
                    ),
                )
                row_id = int(cursor.lastrowid or 0)
                db.execute(
                    "INSERT INTO events (time_s, kind, ref_id) VALUES (?, 'finding_started', ?)",
                    (now_s, row_id),
                )
                opened[(finding.detector, finding.subject)] = row_id
            for i, decision in enumerate(decisions):
                known = outcomes[i] if outcomes is not None else None
                outcome = known.outcome if known is not None else "pending"
                if outcome not in OUTCOMES:
                    raise ValueError(f"unknown outcome {outcome!r}")
                cursor = db.execute(
                    f"INSERT INTO decisions ({_DECISION_COLUMNS}) "
                    "VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        decision.timestamp_s,
                        decision.policy,
                        decision.action,
                        _dumps(dict(decision.params)),
                        decision.job,
                        decision.gpu_uuid,
                        int(decision.dry_run),
                        _text(decision.reason),
                        _dumps([_finding_dict(f) for f in decision.findings]),
                        outcome,
                        _text(known.detail) if known is not None else "",
                        known.finished_s if known is not None else None,
                    ),
                )
                decision_id = int(cursor.lastrowid or 0)
                ids.append(decision_id)
                db.execute(
                    "INSERT INTO events (time_s, kind, ref_id) VALUES (?, 'decision', ?)",
                    (decision.timestamp_s, decision_id),
                )
                if known is not None and outcome != "pending":
                    self._insert_outcome(db, decision_id, known, now_s)
        for key in cleared:
            del known_open[key]
        known_open.update(opened)
        return ids

    @staticmethod
    def _insert_outcome(
        db: sqlite3.Connection, decision_id: int, outcome: Outcome, now_s: float
    ) -> None:
        finished = outcome.finished_s if outcome.finished_s is not None else now_s
        cursor = db.execute(
            "INSERT INTO outcomes (decision_id, outcome, detail, finished_s) VALUES (?, ?, ?, ?)",
            (decision_id, outcome.outcome, _text(outcome.detail), finished),
        )
        db.execute(
            "INSERT INTO events (time_s, kind, ref_id) VALUES (?, 'outcome', ?)",
            (finished, int(cursor.lastrowid or 0)),
        )

    def record_outcome(
        self, decision_id: int, outcome: str, detail: str = "", finished_s: float | None = None
    ) -> None:
        """Record the outcome of decision ``decision_id`` (one transaction).

        ``outcome`` is one of :data:`OUTCOMES` other than ``pending``; ``finished_s``
        defaults to the decision's own time. Raises KeyError for an unknown id,
        ValueError for an unknown outcome, JournalError when SQLite fails.
        """
        if outcome not in OUTCOMES or outcome == "pending":
            raise ValueError(f"not a final outcome: {outcome!r}")
        with self._transaction("record an outcome") as db:
            row = db.execute(
                "SELECT timestamp_s FROM decisions WHERE id = ?", (decision_id,)
            ).fetchone()
            if row is None:
                raise KeyError(decision_id)
            finished = finished_s if finished_s is not None else float(row[0])
            db.execute(
                "UPDATE decisions SET outcome = ?, detail = ?, finished_s = ? WHERE id = ?",
                (outcome, _text(detail), finished, decision_id),
            )
            self._insert_outcome(db, decision_id, Outcome(outcome, detail, finished), finished)

    def recover(self, now_s: float) -> Recovery:
        """Close what is open because the daemon stops or stopped.

        The daemon calls it at a clean stop (``now_s`` = the stop) and at start, before
        the first tick (``now_s`` = the start: when a killed daemon's leftovers are
        found). Findings still open are cleared at ``now_s`` with ``clear_reason``
        ``stopped`` (nobody watched them since; the next daemon's windows start empty,
        so a condition that still holds starts a new episode after its ``for:``).
        Decisions still ``pending`` (e.g. a ``set_knob`` the job had not acknowledged)
        get the outcome ``unknown``. One transaction, none when nothing is open.
        """
        pending = [
            row[0]
            for row in self._require().execute("SELECT id FROM decisions WHERE outcome = 'pending'")
        ]
        open_ids = sorted(self._open.values())
        if not pending and not open_ids:
            return Recovery(0, 0)
        detail = "the daemon stopped before the outcome was known"
        with self._transaction("recover") as db:
            for row_id in open_ids:
                db.execute(
                    "UPDATE findings SET cleared_s = ?, clear_reason = ? WHERE id = ?",
                    (now_s, CLEARED_BY_STOP, row_id),
                )
                db.execute(
                    "INSERT INTO events (time_s, kind, ref_id) VALUES (?, 'finding_cleared', ?)",
                    (now_s, row_id),
                )
            for decision_id in pending:
                db.execute(
                    "UPDATE decisions SET outcome = 'unknown', detail = ?, finished_s = ? "
                    "WHERE id = ?",
                    (detail, now_s, decision_id),
                )
                self._insert_outcome(db, decision_id, Outcome("unknown", detail, now_s), now_s)
        self._open.clear()
        return Recovery(len(open_ids), len(pending))

    def prune(self, now_s: float) -> int:
        """Delete rows older than the retention (relative to ``now_s``); return events deleted.

        Kept whatever their age: findings still open, and each job's latest non-dry-run
        decision among the engine's ladder actions
        (:data:`gpuwatchd.policy.engine.LADDER_ACTIONS`: its ``to`` is the ladder
        position :meth:`PolicyEngine.restore` replays; a dry-run decision moves no
        ladder, so a newer dry-run one must not push the real one out).
        One transaction.
        """
        cutoff = now_s - self.retention_s
        ladder = ", ".join("?" for _ in LADDER_ACTIONS)
        with self._transaction("prune") as db:
            db.execute(
                "CREATE TEMP TABLE IF NOT EXISTS doomed (id INTEGER PRIMARY KEY)",
            )
            db.execute("DELETE FROM doomed")
            db.execute(
                "INSERT INTO doomed SELECT id FROM decisions WHERE timestamp_s < ? "
                f"AND id NOT IN (SELECT max(id) FROM decisions WHERE action IN ({ladder}) "
                "AND dry_run = 0 GROUP BY job)",
                (cutoff, *LADDER_ACTIONS),
            )
            deleted = 0
            deleted += db.execute(
                "DELETE FROM events WHERE kind = 'outcome' AND ref_id IN "
                "(SELECT id FROM outcomes WHERE decision_id IN (SELECT id FROM doomed))"
            ).rowcount
            deleted += db.execute(
                "DELETE FROM events WHERE kind = 'decision' AND ref_id IN (SELECT id FROM doomed)"
            ).rowcount
            db.execute("DELETE FROM outcomes WHERE decision_id IN (SELECT id FROM doomed)")
            db.execute("DELETE FROM decisions WHERE id IN (SELECT id FROM doomed)")
            deleted += db.execute(
                "DELETE FROM events WHERE kind IN ('finding_started', 'finding_cleared') "
                "AND ref_id IN (SELECT id FROM findings WHERE cleared_s < ?)",
                (cutoff,),
            ).rowcount
            db.execute("DELETE FROM findings WHERE cleared_s < ?", (cutoff,))
            deleted += db.execute("DELETE FROM events WHERE time_s < ?", (cutoff,)).rowcount
            db.execute("DELETE FROM doomed")
        return max(deleted, 0)

    # -- reading ------------------------------------------------------------------------------

    def _require(self) -> sqlite3.Connection:
        if self._db is None:
            raise JournalError("the journal is closed")
        return self._db

    def decisions_since(
        self, since_s: float, *, latest_of: Iterable[str] = LADDER_ACTIONS
    ) -> list[Decision]:
        """Decisions at or after ``since_s``, oldest first (for ``PolicyEngine.restore``).

        Also, whatever its age, each job's latest non-dry-run decision whose action is in
        ``latest_of`` (default: the ladder actions, whose last real step is the ladder's
        position). Dry-run decisions within the horizon are included: they start
        cooldowns too.
        """
        return [j.decision for j in self.journaled_since(since_s, latest_of=latest_of)]

    def journaled_since(
        self, since_s: float, *, latest_of: Iterable[str] = ()
    ) -> list[JournaledDecision]:
        """:meth:`decisions_since` with ids and outcomes."""
        actions = tuple(latest_of)
        where = "timestamp_s >= ?"
        args: list[Any] = [since_s]
        if actions:
            marks = ", ".join("?" for _ in actions)
            where += (
                f" OR id IN (SELECT max(id) FROM decisions WHERE action IN ({marks}) "
                "AND dry_run = 0 GROUP BY job)"
            )
            args.extend(actions)
        rows = self._require().execute(
            f"SELECT {_DECISION_COLUMNS} FROM decisions WHERE {where} ORDER BY id", args
        )
        return [_decision_from(row) for row in rows]

    def recent_decisions(self, limit: int) -> list[JournaledDecision]:
        """The last ``limit`` decisions, oldest first (``gpuwatchctl status`` after a restart)."""
        rows = self._require().execute(
            f"SELECT {_DECISION_COLUMNS} FROM decisions ORDER BY id DESC LIMIT ?", (limit,)
        )
        return [_decision_from(row) for row in reversed(rows.fetchall())]

    def last_event_id(self) -> int:
        """The id of the newest event (0 for an empty journal): a cursor for "from now on"."""
        row = self._require().execute("SELECT max(id) FROM events").fetchone()
        return int(row[0] or 0)

    def events(
        self, since_s: float | None = None, after_id: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """The event stream, ordered by id (= the order things were recorded).

        With ``since_s`` and/or ``after_id``: the first ``limit`` events with
        ``time_s >= since_s`` and ``id > after_id``. With neither: the *last* ``limit``
        events (like ``tail``). Each event is a JSON-able dict with ``id``, ``time_s``
        and ``kind`` (:data:`EVENT_KINDS`) and the keys of its kind (docs/journal.md).
        """
        if limit <= 0:
            return []
        where: list[str] = []
        args: list[Any] = []
        if since_s is not None:
            where.append("e.time_s >= ?")
            args.append(since_s)
        if after_id is not None:
            where.append("e.id > ?")
            args.append(after_id)
        sql = _EVENTS_SELECT + (" WHERE " + " AND ".join(where) if where else "")
        tail = not where
        sql += " ORDER BY e.id DESC LIMIT ?" if tail else " ORDER BY e.id LIMIT ?"
        rows = self._require().execute(sql, [*args, limit]).fetchall()
        if tail:
            rows.reverse()
        return [_event_from(row) for row in rows]


def _gpu_index_of(findings: list[dict[str, Any]], gpu_uuid: str | None) -> int | None:
    if gpu_uuid is None:
        return None
    for finding in findings:
        if finding.get("gpu_uuid") == gpu_uuid and finding.get("gpu_index") is not None:
            return int(finding["gpu_index"])
    return None


def _event_from(row: Sequence[Any]) -> dict[str, Any]:
    """One event dict; a row pruned from under its event gives null values, never a gap
    (a follower's ``after_id`` cursor must always move on)."""
    (eid, time_s, kind, fid, detector, subject, f_gpu, gpu_index, f_job, value, threshold) = row[
        :11
    ]
    (message, since_s, clear_reason, did, policy, action, params, d_job, d_gpu, dry_run) = row[
        11:21
    ]
    reason, findings, outcome, detail = row[21:25]
    event: dict[str, Any] = {"id": eid, "time_s": time_s, "kind": kind}
    if kind in ("finding_started", "finding_cleared"):
        event.update(
            finding_id=fid,
            detector=detector,
            subject=subject,
            gpu_index=gpu_index,
            gpu_uuid=f_gpu,
            job=f_job,
            value=value,
            threshold=threshold,
            message=message,
            since_s=since_s,
        )
        if kind == "finding_cleared":
            event["clear_reason"] = clear_reason
        return event
    summary: list[dict[str, Any]] = json.loads(findings) if findings else []
    event.update(
        decision_id=did,
        policy=policy,
        action=action,
        job=d_job,
        gpu_uuid=d_gpu,
        gpu_index=_gpu_index_of(summary, d_gpu),
    )
    if kind == "decision":
        event.update(
            params=json.loads(params) if params else None,
            dry_run=bool(dry_run) if dry_run is not None else None,
            reason=reason,
            findings=[
                {k: f.get(k) for k in ("detector", "subject", "value", "threshold")}
                for f in summary[:_MAX_EVENT_FINDINGS]
            ],
            findings_count=len(summary),
        )
        return event
    event.update(outcome=outcome, detail=detail)
    return event


class _Tx:
    """``with`` block: ``BEGIN IMMEDIATE`` … ``COMMIT``, or ``ROLLBACK`` and JournalError."""

    def __init__(self, db: sqlite3.Connection, what: str, path: Path) -> None:
        self._db, self._what, self._path = db, what, path

    def __enter__(self) -> sqlite3.Connection:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise JournalError(f"cannot {self._what} in {self._path}: {exc}") from None
        return self._db

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc_type is None:
            try:
                self._db.execute("COMMIT")
                return
            except sqlite3.Error as commit_exc:
                self._rollback()
                raise JournalError(f"cannot {self._what} in {self._path}: {commit_exc}") from None
        self._rollback()
        if isinstance(exc, sqlite3.Error):
            raise JournalError(f"cannot {self._what} in {self._path}: {exc}") from None

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("ROLLBACK")
