"""Opening the journal's SQLite file (WAL, schema upgrade, corrupt files moved aside)
and its transactions.

Specification: docs/modules.md#gpuwatchdjournal
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from datetime import datetime, timezone
from pathlib import Path
from typing import Final

from gpuwatchd.errors import JournalError
from gpuwatchd.journal.schema import BUSY_TIMEOUT_MS, SCHEMA, SCHEMA_VERSION

_CORRUPT_NAMES: Final = frozenset({"SQLITE_CORRUPT", "SQLITE_NOTADB"})


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


def open_moving_aside(
    path: str | os.PathLike[str], now_s: float | None
) -> tuple[sqlite3.Connection, Path | None, int | None]:
    """Connect to the journal at ``path``; a corrupt file is moved aside first.

    Returns the connection, where the corrupt file went (None: it was fine) and the
    event id the new journal's ids continue after (None: not replaced). See
    :meth:`~gpuwatchd.journal.Journal.open` for the errors.
    """
    target = Path(path)
    moved: Path | None = None
    try:
        connection = _connect(target)
    except _Corrupt as exc:
        stamp = _utc_stamp(now_s if now_s is not None else datetime.now(timezone.utc).timestamp())
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
            connection = _connect(target)
        except _Corrupt as again:  # pragma: no cover - a fresh file cannot be corrupt
            raise JournalError(f"cannot create a new journal at {target}: {again}") from None
        return connection, moved, _continue_ids(connection, moved, stamp_s=now_s)
    return connection, moved, None


def _connect(path: Path) -> sqlite3.Connection:
    try:
        db = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
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
            for statement in SCHEMA.split(";"):
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


class Transaction:
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
