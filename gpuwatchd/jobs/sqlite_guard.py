"""A trigger that gives an Optuna SQLite storage the row lock Optuna assumes it has.

Optuna's ``Study._pop_waiting_trial_id`` (module ``optuna.study.study``) takes a WAITING
trial when ``RDBStorage.set_trial_state_values(trial_id, RUNNING)`` returns True. That reads the row
with ``with_for_update()`` (``optuna.storages._rdb.models.TrialModel.find_or_raise_by_id``:
"SQLite3 doesn't support this clause") and, on SQLite, outside any transaction (Python's
sqlite3 begins one at the first write), so two sessions that both read WAITING both write
RUNNING and both get True: two threads of ``study.optimize(n_jobs=2)``, or two workers, run
one enqueued trial twice (optuna/optuna#4002). Finishing a trial has the same gap.

Specification: docs/modules.md#gpuwatchdjobssqlite_guard
"""

from __future__ import annotations

from typing import Any

__all__ = ["TRIAL_STATE_GUARD", "guard_trial_states"]

TRIAL_STATE_GUARD = "gpuwatchd_trial_state_guard"
"""Name of the trigger on Optuna's ``trials`` table (``DROP TRIGGER`` it to remove it)."""

_GUARD_SQL = f"""\
CREATE TRIGGER {TRIAL_STATE_GUARD}
BEFORE UPDATE OF state ON trials FOR EACH ROW
WHEN (NEW.state = 'RUNNING' AND OLD.state <> 'WAITING')
  OR OLD.state IN ('COMPLETE', 'PRUNED', 'FAIL')
BEGIN
  SELECT RAISE(ABORT, 'gpuwatchd: trial state changed by another thread or process first');
END"""


def guard_trial_states(storage: object) -> bool:
    """Add :data:`TRIAL_STATE_GUARD` to an Optuna storage, if it is an SQLite ``RDBStorage``.

    The trigger aborts an update that sets RUNNING a trial that is no longer WAITING, or
    that writes the state of a finished trial (COMPLETE, PRUNED, FAIL): the second of two
    writers that read the same row. SQLite reports a constraint error, SQLAlchemy an
    ``IntegrityError``, and ``RDBStorage.set_trial_state_values`` returns False, as after
    PostgreSQL's or MySQL's row lock: the other one got the trial first. Nothing else
    changes. Idempotent: a trigger of that name with other SQL (another gpuwatchd
    version's) is replaced, one with the same SQL left alone.

    Args:
        storage: an Optuna storage; an ``RDBStorage``'s SQLAlchemy ``engine`` is used.

    Returns:
        True when the storage is SQLite and has the trigger now; False for other databases
        and storages without an engine (``JournalStorage``), left as they are.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database refused the write (e.g. "database is
        locked", a read-only file).
    """
    engine: Any = getattr(storage, "engine", None)
    if engine is None or engine.dialect.name != "sqlite":
        return False
    with engine.begin() as connection:
        present = connection.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = ?",
            (TRIAL_STATE_GUARD,),
        ).first()
        if present is None or present[0] != _GUARD_SQL:
            connection.exec_driver_sql(f"DROP TRIGGER IF EXISTS {TRIAL_STATE_GUARD}")
            connection.exec_driver_sql(_GUARD_SQL)
    return True
