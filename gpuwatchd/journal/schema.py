"""The journal's SQLite schema, its vocabulary (event kinds, outcomes) and record types.

Specification: docs/modules.md#gpuwatchdjournal; the columns: docs/journal.md
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gpuwatchd.model import Decision

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

MAX_TEXT: Final = 4000
"""Longest message/reason/detail stored (characters); longer ones are cut with ``…``."""
MAX_EVENT_FINDINGS: Final = 16
"""Findings summarised in a ``decision`` event (``findings_count`` gives the total)."""
BUSY_TIMEOUT_MS: Final = 100
"""How long a write waits for a lock held by another connection (e.g. an operator's
``sqlite3`` shell) before failing, so a tick is never stuck."""

SCHEMA: Final = """
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
"""The journal's tables and indexes (``CREATE ... IF NOT EXISTS``; docs/journal.md)."""

DECISION_COLUMNS: Final = (
    "id, timestamp_s, policy, action, params, job, gpu_uuid, dry_run, reason, findings, "
    "outcome, detail, finished_s"
)
"""The ``decisions`` columns :func:`gpuwatchd.journal.rows.decision_from_row` reads, in order."""

EVENTS_SELECT: Final = """
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
"""One ``events`` row with its finding, decision and outcome joined (25 columns, in the
order :func:`gpuwatchd.journal.rows.event_from_row` reads)."""


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
