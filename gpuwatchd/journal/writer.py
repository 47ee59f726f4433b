"""The journal file: ``Journal`` opens it and records ticks, outcomes, recovery and pruning.

Specification: docs/modules.md#gpuwatchdjournal
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gpuwatchd.detectors import EventFinding
from gpuwatchd.errors import JournalError
from gpuwatchd.journal.connection import Transaction, open_moving_aside
from gpuwatchd.journal.queries import JournalQueries
from gpuwatchd.journal.rows import bounded_text, dumps_json, finding_dict
from gpuwatchd.journal.schema import (
    CLEARED_BY_CONDITION,
    CLEARED_BY_STOP,
    DECISION_COLUMNS,
    DEFAULT_RETENTION_S,
    OUTCOMES,
    Outcome,
    Recovery,
)
from gpuwatchd.model import Decision, Finding
from gpuwatchd.policy.actions import public_params
from gpuwatchd.policy.engine import LADDER_ACTIONS

if TYPE_CHECKING:
    import sqlite3  # the driver is imported in connection.py only


class Journal(JournalQueries):
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
        super().__init__(connection)
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
        self._event_serial = 0
        """Numbers the episodes of event findings (each is its own, see record_tick)."""

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
        connection, moved, floor = open_moving_aside(path, now_s)
        journal = cls(connection, Path(path), retention_s=retention_s, moved_aside=moved)
        journal.ids_continue_after = floor
        return journal

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

    def _transaction(self, what: str) -> Transaction:
        if self._db is None:
            raise JournalError("the journal is closed")
        return Transaction(self._db, what, self.path)

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
        failed is made good by the next one. An event finding
        (:class:`~gpuwatchd.detectors.EventFinding`: one worker crash, one run of clean
        trials) is one event, so always an episode of its own, started on its tick and
        cleared on the next: two crashes of one job on one tick or on consecutive ticks,
        or after a daemon killed with a crash episode open, are two ``finding_started``.
        ``outcomes`` (as long as ``decisions``, or None) gives the outcome of decisions
        known before acting (``logged``, ``dry-run``); None entries stay ``pending`` for
        :meth:`record_outcome`.

        One transaction; none at all when nothing starts, clears or is decided. Event
        order: clears, starts, then each decision and its outcome. Returns the
        decisions' ids. Raises JournalError (and writes nothing) when SQLite fails,
        ValueError for a bad ``outcomes``.
        """
        current: dict[tuple[str, str], Finding] = {}
        for one in findings:
            key = (one.detector, one.subject)
            if isinstance(one, EventFinding):
                self._event_serial += 1  # never the key of an open episode, nor of another
                key = (one.detector, f"{one.subject}\0event {self._event_serial}")
            current[key] = one
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
                self._close_finding(db, known_open[key], now_s, CLEARED_BY_CONDITION)
            for finding in started:
                f = finding_dict(finding)
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
                    f"INSERT INTO decisions ({DECISION_COLUMNS}) "
                    "VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        decision.timestamp_s,
                        decision.policy,
                        decision.action,
                        dumps_json(public_params(decision.action, decision.params)),
                        decision.job,
                        decision.gpu_uuid,
                        int(decision.dry_run),
                        bounded_text(decision.reason),
                        dumps_json([finding_dict(f) for f in decision.findings]),
                        outcome,
                        bounded_text(known.detail) if known is not None else "",
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
    def _close_finding(db: sqlite3.Connection, row_id: int, now_s: float, reason: str) -> None:
        """Mark finding ``row_id`` cleared at ``now_s`` for ``reason``, with its event row."""
        db.execute(
            "UPDATE findings SET cleared_s = ?, clear_reason = ? WHERE id = ?",
            (now_s, reason, row_id),
        )
        db.execute(
            "INSERT INTO events (time_s, kind, ref_id) VALUES (?, 'finding_cleared', ?)",
            (now_s, row_id),
        )

    @staticmethod
    def _insert_outcome(
        db: sqlite3.Connection, decision_id: int, outcome: Outcome, now_s: float
    ) -> None:
        finished = outcome.finished_s if outcome.finished_s is not None else now_s
        cursor = db.execute(
            "INSERT INTO outcomes (decision_id, outcome, detail, finished_s) VALUES (?, ?, ?, ?)",
            (decision_id, outcome.outcome, bounded_text(outcome.detail), finished),
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
                (outcome, bounded_text(detail), finished, decision_id),
            )
            self._insert_outcome(db, decision_id, Outcome(outcome, detail, finished), finished)

    def record_decision(self, decision: Decision) -> int:
        """Journal one decision made outside a tick (an operator's ``gpuwatchctl knob``) as
        ``pending``, with its ``decision`` event; returns its id. Open findings are left
        as they are. Raises JournalError when SQLite fails."""
        with self._transaction("record a decision") as db:
            cursor = db.execute(
                f"INSERT INTO decisions ({DECISION_COLUMNS}) "
                "VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', '', NULL)",
                (
                    decision.timestamp_s,
                    decision.policy,
                    decision.action,
                    dumps_json(dict(decision.params)),
                    decision.job,
                    decision.gpu_uuid,
                    int(decision.dry_run),
                    bounded_text(decision.reason),
                    dumps_json([finding_dict(f) for f in decision.findings]),
                ),
            )
            decision_id = int(cursor.lastrowid or 0)
            db.execute(
                "INSERT INTO events (time_s, kind, ref_id) VALUES (?, 'decision', ?)",
                (decision.timestamp_s, decision_id),
            )
        return decision_id

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
                self._close_finding(db, row_id, now_s, CLEARED_BY_STOP)
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
