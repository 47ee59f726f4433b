"""A managed job's Optuna study, created or loaded once by the daemon before its workers start.

Workers that start together on a fresh SQLite storage race to create Optuna's tables
(``IntegrityError: UNIQUE constraint failed: alembic_version.version_num``); the daemon
does it first, with ``load_if_exists=True`` (docs/managed-jobs.md, "Optuna studies").
Optuna is imported only when called.
"""

from __future__ import annotations

import contextlib
import os
import pwd
from typing import Final

from gpuwatchd.config import OptunaConfig
from gpuwatchd.errors import StudyError
from gpuwatchd.jobs.sqlite_guard import guard_trial_states
from gpuwatchd.jobs.storage import open_storage, optuna_storage, parse_storage

__all__ = ["ensure_study"]

_FIRST_LINE_MAX: Final = 300


def ensure_study(cfg: OptunaConfig, user: str | None = None) -> str:
    """Create ``cfg``'s study if missing (``direction`` from the config, else Optuna's
    default), else load it; return ``"created"`` or ``"loaded"``. Blocking (run it in a
    thread). ``cfg.storage`` is a storage spec (:mod:`gpuwatchd.jobs.storage`): an RDB
    URL or an Optuna journal. A new SQLite database or journal file is created only in an
    existing directory; when the daemon (root) creates it for a job with ``user``, the
    file is given to that user and its group: the job's workers write to it (created as
    root:gpuwatch 0640 under the unit's UMask=0027, every worker died with "attempt to
    write a readonly database").

    Raises :class:`~gpuwatchd.errors.StudyError` (first line of the cause) for a bad
    storage spec, a relative SQLite or journal path, a missing directory, a missing
    driver (``psycopg2``, ``redis``) or an unreachable database, or an existing study
    whose directions differ from the configured ``direction``. On SQLite it adds the
    trial-state guard (:func:`gpuwatchd.jobs.sqlite_guard.guard_trial_states`).
    """
    spec = parse_storage(cfg.storage)
    path = spec.local_file
    new_file: str | None = None
    if path is not None:
        new_file = None if os.path.exists(path) else path
        if not os.path.isabs(path):
            raise StudyError(
                f"{spec.label} storage path {path!r} is relative; give an absolute path"
            )
        directory = os.path.dirname(path)
        if not os.path.isdir(directory):
            raise StudyError(f"the {spec.label} storage's directory {directory} does not exist")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        storage = optuna_storage(cfg.storage)
        try:
            study = optuna.load_study(study_name=cfg.study, storage=storage)
            outcome = "loaded"
        except KeyError:  # no such study: Optuna's "Record does not exist."
            directions = (
                [optuna.study.StudyDirection[d.upper()] for d in cfg.directions]
                if cfg.directions
                else None
            )
            study = optuna.create_study(
                storage=storage,
                study_name=cfg.study,
                directions=directions,
                load_if_exists=True,
            )
            outcome = "created"
        if spec.kind == "rdb" and path is not None:
            # SQLite has no row lock: guard the trial states before any worker pops a
            # WAITING trial (Optuna's retries, enqueued ones), not after gpuwatchd's first.
            with open_storage(cfg.storage) as opened:
                guard_trial_states(opened)
    except StudyError:
        raise
    except ImportError as exc:
        raise StudyError(f"the storage's database driver is not installed: {exc}") from None
    except Exception as exc:  # SQLAlchemy's and Optuna's errors: say them in one line
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise StudyError(f"{type(exc).__name__}: {first}"[:_FIRST_LINE_MAX]) from None
    if new_file is not None and user is not None:
        _give_to(new_file, user)
    if cfg.directions:
        have = tuple(d.name.lower() for d in study.directions)
        if have != cfg.directions:
            raise StudyError(
                f"study {cfg.study!r} exists with direction {', '.join(have)}, "
                f"the config says {', '.join(cfg.directions)}"
            )
    return outcome


def _give_to(path: str, user: str) -> None:
    """chown ``path`` (and SQLite's ``-journal``/``-wal``/``-shm`` beside it) to ``user``
    and its primary group, mode 0660; quiet when not allowed or the user is unknown (the
    workers' deaths then say "readonly database")."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return
    for name in (path, f"{path}-journal", f"{path}-wal", f"{path}-shm"):
        with contextlib.suppress(OSError):
            os.chown(name, pw.pw_uid, pw.pw_gid)
            os.chmod(name, 0o660)
