"""Optuna storages named by one string: RDB URLs and Optuna's JournalStorage.

The config's ``optuna.storage``, ``gpuwatchctl study --storage`` and every function of
:mod:`gpuwatchd.jobs.study` take one *storage spec* (docs/studies.md, "Storages"):

- an SQLAlchemy URL for :class:`optuna.storages.RDBStorage` (``sqlite:////srv/hpo/optuna.db``,
  ``postgresql+psycopg2://user@/db?host=/run/postgresql``);
- ``journal://`` and a file path (``journal:///srv/hpo/optuna.log``, three slashes for an
  absolute path): ``JournalStorage(JournalFileBackend(path))``, the storage Optuna's docs
  recommend for several processes without a database;
- ``redis://`` or ``rediss://`` URLs (``redis://127.0.0.1:6379/0``):
  ``JournalStorage(JournalRedisBackend(url))``, as Optuna's own CLI reads them (SQLAlchemy
  has no Redis dialect, so they cannot be meant as RDB URLs); needs the ``redis`` package.

Parsing is pure; Optuna, SQLAlchemy and redis are imported only by :func:`open_storage`
and :func:`optuna_storage`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from gpuwatchd.errors import StudyError

if TYPE_CHECKING:  # pragma: no cover - typing only; optuna is imported lazily
    from optuna.storages import BaseStorage

__all__ = [
    "JOURNAL_PREFIX",
    "StorageKind",
    "StorageSpec",
    "open_storage",
    "optuna_storage",
    "parse_storage",
    "redact_url",
    "shared_path_problem",
    "sqlite_path",
]

JOURNAL_PREFIX: Final = "journal://"
"""A JournalStorage file: everything after this prefix is the file's path."""
_REDIS_SCHEMES: Final = ("redis", "rediss")
_FIRST_LINE_MAX: Final = 300

StorageKind = Literal["rdb", "journal_file", "journal_redis"]


@dataclass(frozen=True, slots=True)
class StorageSpec:
    """One Optuna storage, parsed from its spec (module docstring).

    ``text``: the spec as written. ``kind``: ``rdb``, ``journal_file`` or
    ``journal_redis``. ``path``: the SQLite database's path (as :func:`sqlite_path` reads
    it: ``""`` or ``":memory:"`` for an in-memory database) or the journal file's path;
    ``None`` for a database or Redis server.
    """

    text: str
    kind: StorageKind
    path: str | None = None

    @property
    def local_file(self) -> str | None:
        """The file on this machine that holds the studies (an SQLite database or a journal
        file, as written: maybe relative), or ``None`` (a server, an in-memory SQLite)."""
        if self.path in (None, "", ":memory:") or self.path.startswith("file:"):
            return None
        return self.path

    @property
    def label(self) -> str:
        """What people call this storage in messages: ``SQLite``, ``journal`` or ``storage``."""
        if self.kind == "journal_file":
            return "journal"
        return "SQLite" if self.path is not None else "storage"


def sqlite_path(url: str) -> str | None:
    """The database path of a ``sqlite://`` URL (as SQLAlchemy reads it: the part after
    ``sqlite:///``, absolute with a fourth slash), ``None`` for other URLs. Pure."""
    if not url.startswith("sqlite:"):
        return None
    rest = url[len("sqlite:") :]
    if not rest.startswith("//"):
        return ""
    rest = rest[2:]
    path = rest[1:] if rest.startswith("/") else rest
    return path.split("?", 1)[0]


def parse_storage(text: str) -> StorageSpec:
    """Parse a storage spec (module docstring). Pure: nothing is opened or checked on disk.

    Raises :class:`StudyError` for an empty spec, a ``journal:`` spec without a path
    after ``journal://``, and a string that is no URL at all (a bare file path: the
    message shows the ``journal://`` and ``sqlite:///`` forms of it). Relative paths are
    accepted here (``gpuwatchctl study`` resolves them in its working directory); see
    :func:`shared_path_problem` for the config's rule.
    """
    if not text:
        raise StudyError("the storage is empty: give a storage URL")
    if text.startswith("journal:"):
        if not text.startswith(JOURNAL_PREFIX) or len(text) == len(JOURNAL_PREFIX):
            raise StudyError(
                f"bad journal storage {text!r}: write journal:// and the file's path, "
                "e.g. journal:///srv/hpo/optuna.log (three slashes for an absolute path)"
            )
        return StorageSpec(text, "journal_file", text[len(JOURNAL_PREFIX) :])
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme in _REDIS_SCHEMES:
        return StorageSpec(text, "journal_redis")
    if text.startswith("sqlite:"):
        return StorageSpec(text, "rdb", sqlite_path(text))
    if not scheme:
        example = text if text.startswith("/") else f"/absolute/path/{os.path.basename(text)}"
        raise StudyError(
            f"not a storage URL: {text!r}; for Optuna's JournalStorage on a file write "
            f"journal://{example}, for an SQLite database sqlite:///{example}"
        )
    return StorageSpec(text, "rdb")


def shared_path_problem(spec: StorageSpec) -> str | None:
    """Why the file of ``spec`` cannot be shared by a job's workers and the daemon (a
    relative path: they resolve it in different directories), or ``None``."""
    path = spec.local_file
    if path is None or path.startswith("/"):
        return None
    name = path.rstrip("/").rsplit("/", 1)[-1]
    fix = (
        f"journal:///absolute/path/{name}"
        if spec.kind == "journal_file"
        else f"sqlite:////absolute/path/{name}"
    )
    return (
        f"the {spec.label} path {path!r} is relative (workers and the daemon resolve it "
        f"in different directories); write {fix}"
    )


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs, errors and output).

    A journal file's spec and any text without a user part (no ``@``) are shown as they
    are: file paths are not secrets. An unparsable URL with a user part shows its scheme
    only.
    """
    if url.startswith(JOURNAL_PREFIX) or "@" not in url:
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL: the password cannot be found in it
        return url.split(":", 1)[0] + ":..." if ":" in url else "<storage URL>"


def optuna_storage(storage: str) -> str | BaseStorage:
    """What to pass as ``storage=`` to :func:`optuna.create_study` or
    :func:`optuna.load_study` for the spec ``storage``: the URL itself for an RDB storage
    (Optuna creates its tables), else a :class:`~optuna.storages.JournalStorage` on the
    file (created when missing, as Optuna's ``JournalFileBackend`` does) or on Redis.

    Raises :class:`StudyError` for a bad spec, a missing ``redis`` package, a journal file
    that cannot be read or is not an Optuna journal, or an unreachable Redis server.
    """
    spec = parse_storage(storage)
    if spec.kind == "rdb":
        return spec.text
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalRedisBackend

    where = redact_url(spec.text)
    if spec.kind == "journal_file":
        assert spec.path is not None
        try:
            return optuna.storages.JournalStorage(JournalFileBackend(spec.path))
        except OSError as exc:
            raise StudyError(f"cannot open {where}: {exc.strerror or exc}") from None
        except (ValueError, KeyError) as exc:  # JSON, UTF-8 or a line without op_code
            raise StudyError(
                f"{where} is not an Optuna journal file ({_first_line(exc)})"
            ) from None
    try:
        import redis
    except ImportError:
        raise StudyError(
            f"cannot open {where}: Optuna's JournalRedisBackend needs the redis package, "
            "which is not installed (pip install redis)"
        ) from None
    try:
        with warnings.catch_warnings():  # JournalRedisBackend is "experimental" in Optuna
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.JournalStorage(JournalRedisBackend(spec.text))
    except (redis.RedisError, ValueError) as exc:
        raise StudyError(f"cannot open {where}: {_first_line(exc)}") from None


@contextlib.contextmanager
def open_storage(storage: str, **rdb_kwargs: Any) -> Iterator[BaseStorage]:
    """An Optuna storage on the spec ``storage``, closed at exit; never creates anything.

    An RDB URL gives an :class:`~optuna.storages.RDBStorage` (``rdb_kwargs``, e.g.
    ``heartbeat_interval``, go to it): a missing SQLite file, or a database without
    Optuna's tables (a wrong file, an empty PostgreSQL database), is refused instead of
    being turned into a storage. A journal spec gives a
    :class:`~optuna.storages.JournalStorage`: its file must exist.

    Raises :class:`StudyError` for a bad spec, a missing SQLite or journal file, an
    unknown or missing driver (``psycopg2``, ``redis``), a database or server that cannot
    be reached, one that is not an Optuna storage, ``rdb_kwargs`` for a journal (Optuna's
    JournalStorage records no heartbeats); and, from the ``with`` body, for a storage error
    (SQLAlchemy's, Optuna's ``StorageInternalError``, a journal's ``OSError`` or Redis
    error) while using it.
    """
    spec = parse_storage(storage)
    if spec.kind == "rdb":
        with _open_rdb(spec.text, **rdb_kwargs) as rdb:
            yield rdb
        return
    where = redact_url(spec.text)
    if rdb_kwargs:
        raise StudyError(
            f"{where}: Optuna's JournalStorage records no trial heartbeats (only RDBStorage "
            "does), so stale trials cannot be found in it; optuna.grace_period needs an RDB "
            "storage (SQLite or PostgreSQL)"
        )
    if spec.kind == "journal_file":
        assert spec.path is not None
        if not os.path.exists(spec.path):
            raise StudyError(f"no such journal file: {spec.path}")
        if not os.path.isfile(spec.path):
            raise StudyError(f"the journal storage {spec.path} is not a file")
    journal = optuna_storage(spec.text)
    assert not isinstance(journal, str)
    errors: tuple[type[BaseException], ...] = (OSError,)
    if spec.kind == "journal_redis":
        import redis

        errors = (OSError, redis.RedisError)
    try:
        yield journal
    except errors as exc:  # e.g. no right to create the journal's lock file beside it
        raise StudyError(f"{where}: {_first_line(exc)}") from None


@contextlib.contextmanager
def _open_rdb(url: str, **kwargs: Any) -> Iterator[BaseStorage]:
    """:func:`open_storage` for an RDB URL."""
    _check_url(url)
    import optuna
    import sqlalchemy
    import sqlalchemy.exc

    where = redact_url(url)
    try:
        engine = sqlalchemy.create_engine(url)
        try:
            with engine.connect() as connection:
                inspector = sqlalchemy.inspect(connection)
                is_optuna = all(inspector.has_table(t) for t in ("version_info", "studies"))
        finally:
            engine.dispose()
        if not is_optuna:
            raise StudyError(f"{where} is not an Optuna storage (no Optuna tables)")
        with warnings.catch_warnings():
            # heartbeat_interval is "experimental" in Optuna; we use it on purpose.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = optuna.storages.RDBStorage(url, skip_table_creation=True, **kwargs)
    except ImportError as exc:  # a missing DBAPI module (Optuna re-raises it as ImportError)
        cause = exc.__cause__ or exc
        raise StudyError(
            f"cannot open {where}: its database driver is not installed ({cause}); "
            "for PostgreSQL install psycopg2-binary and use postgresql+psycopg2://, "
            "or install psycopg (SQLAlchemy 2.1's default for postgresql://)"
        ) from None
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
        raise StudyError(f"cannot open {where}: {_first_line(exc)}") from None
    try:
        yield storage
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
        # e.g. SQLite's "database is locked" while workers write: a StudyError like the rest
        # (Optuna's StorageInternalError says only "an exception is raised during the
        # commit"; the database's own error is its cause)
        raise StudyError(f"{where}: {_first_line(exc.__cause__ or exc)}") from None
    finally:
        storage.remove_session()
        storage.engine.dispose()


def _check_url(url: str) -> None:
    """Refuse URLs that would silently create a new, empty SQLite database."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise StudyError(f"not a storage URL: {redact_url(url)!r} ({exc})") from None
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or database.startswith("file:"):
            return
        if not os.path.exists(database):
            raise StudyError(f"no such SQLite storage: {database}")


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when empty), at most 300 chars."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:_FIRST_LINE_MAX]
