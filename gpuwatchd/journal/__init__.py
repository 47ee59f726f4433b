"""The action journal: findings, decisions and outcomes in SQLite, durable across restarts.

``Journal`` (writer.py, reading in queries.py) over the schema of schema.py.
Specification: docs/modules.md#gpuwatchdjournal
"""

from __future__ import annotations

from gpuwatchd.journal.schema import (
    CLEARED_BY_CONDITION,
    CLEARED_BY_STOP,
    DEFAULT_RETENTION_S,
    EVENT_KINDS,
    JOURNAL_FILENAME,
    OUTCOMES,
    SCHEMA_VERSION,
    JournaledDecision,
    Outcome,
    Recovery,
)
from gpuwatchd.journal.writer import Journal

__all__ = [
    "CLEARED_BY_CONDITION",
    "CLEARED_BY_STOP",
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
