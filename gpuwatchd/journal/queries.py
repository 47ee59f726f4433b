"""Reading the journal: decisions for the engine's restore, ``gpuwatchctl status`` and
the event stream of ``gpuwatchctl events``.

Specification: docs/modules.md#gpuwatchdjournal, docs/journal.md
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gpuwatchd.control.knobmemory import OPERATOR
from gpuwatchd.errors import JournalError
from gpuwatchd.journal.rows import decision_from_row, event_from_row
from gpuwatchd.journal.schema import DECISION_COLUMNS, EVENTS_SELECT, JournaledDecision
from gpuwatchd.model import Decision, KnobValue
from gpuwatchd.policy import action_names
from gpuwatchd.policy.engine import LADDER_ACTIONS

if TYPE_CHECKING:
    import sqlite3  # the driver is imported in connection.py only


class JournalQueries:
    """The reading side of :class:`~gpuwatchd.journal.Journal`: decisions and the event stream.

    ``_db`` is the open connection (None once closed: every query raises
    :class:`~gpuwatchd.errors.JournalError` then).
    """

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._db = connection

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
            f"SELECT {DECISION_COLUMNS} FROM decisions WHERE {where} ORDER BY id", args
        )
        return [decision_from_row(row) for row in rows]

    def finding_messages_since(self, detector: str, since_s: float) -> list[str]:
        """The messages of ``detector``'s findings started at or after ``since_s``
        (seconds, the daemon's clock), oldest first (e.g. whether a worker's crash was
        journaled before a daemon was killed)."""
        rows = self._require().execute(
            "SELECT message FROM findings WHERE detector = ? AND started_s >= ? ORDER BY id",
            (detector, since_s),
        )
        return [str(row[0]) for row in rows]

    def applied_knobs(self) -> list[tuple[str, str, KnobValue, str, float]]:
        """Every applied, not dry-run ``set_knob`` decision still in the journal, oldest
        first, as ``(job, knob, value, policy, finished_s)``: what the daemon's knob
        memory is rebuilt from at start (rows with malformed params are skipped)."""
        rows = self._require().execute(
            "SELECT job, params, policy, coalesce(finished_s, timestamp_s) FROM decisions "
            "WHERE action = ? AND outcome = 'applied' AND dry_run = 0 "
            "AND job IS NOT NULL ORDER BY id",
            (action_names.SET_KNOB,),
        )
        applied: list[tuple[str, str, KnobValue, str, float]] = []
        for job, params, policy, at_s in rows:
            try:
                parsed = json.loads(params)
            except ValueError:
                continue
            knob = parsed.get("knob") if isinstance(parsed, dict) else None
            value = parsed.get("value") if isinstance(parsed, dict) else None
            if not isinstance(knob, str) or not isinstance(value, (bool, int, float)):
                continue
            applied.append((str(job), knob, value, str(policy), float(at_s)))
        return applied

    def operator_knobs(self) -> list[tuple[str, str, KnobValue, int, float, float]]:
        """Every applied ``set_knob`` decision of policy ``operator`` whose params carry
        ``hold_s`` and ``by_uid``, oldest first, as ``(job, knob, value, by_uid,
        requested_s, hold_s)``: what the operator holds are rebuilt from at start
        (malformed rows are skipped)."""
        rows = self._require().execute(
            "SELECT job, params, timestamp_s FROM decisions "
            "WHERE action = ? AND policy = ? AND outcome = 'applied' "
            "AND dry_run = 0 AND job IS NOT NULL ORDER BY id",
            (action_names.SET_KNOB, OPERATOR),
        )
        held: list[tuple[str, str, KnobValue, int, float, float]] = []
        for job, params, at_s in rows:
            try:
                parsed = json.loads(params)
            except ValueError:
                continue
            if not isinstance(parsed, dict):
                continue
            knob, value = parsed.get("knob"), parsed.get("value")
            uid, hold_s = parsed.get("by_uid"), parsed.get("hold_s")
            if not isinstance(knob, str) or not isinstance(value, (bool, int, float)):
                continue
            if isinstance(uid, bool) or not isinstance(uid, int):
                continue
            if isinstance(hold_s, bool) or not isinstance(hold_s, (int, float)):
                continue
            held.append((str(job), knob, value, uid, float(at_s), float(hold_s)))
        return held

    def recent_decisions(self, limit: int) -> list[JournaledDecision]:
        """The last ``limit`` decisions, oldest first (``gpuwatchctl status`` after a restart)."""
        rows = self._require().execute(
            f"SELECT {DECISION_COLUMNS} FROM decisions ORDER BY id DESC LIMIT ?", (limit,)
        )
        return [decision_from_row(row) for row in reversed(rows.fetchall())]

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
        sql = EVENTS_SELECT + (" WHERE " + " AND ".join(where) if where else "")
        tail = not where
        sql += " ORDER BY e.id DESC LIMIT ?" if tail else " ORDER BY e.id LIMIT ?"
        rows = self._require().execute(sql, [*args, limit]).fetchall()
        if tail:
            rows.reverse()
        return [event_from_row(row) for row in rows]
