"""Optuna study recovery and statistics: the daemon's only door to Optuna.

Specification: docs/modules.md#gpuwatchdstudy
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from gpuwatchd.control.protocol import TRIAL_ATTR_WORKER_ID
from gpuwatchd.errors import StudyError

if TYPE_CHECKING:  # pragma: no cover - typing only; optuna is imported lazily
    from optuna.storages import RDBStorage
    from optuna.trial import FrozenTrial

__all__ = [
    "ATTR_FAILED_REASON",
    "ATTR_MAX_RETRIES",
    "ATTR_PARENT",
    "ATTR_RETRY",
    "ATTR_RETRY_OF",
    "ATTR_RETRY_REASON",
    "ATTR_WORKER_ID",
    "DEFAULT_GRACE_PERIOD_S",
    "STATES",
    "SYSTEM_ATTR_FAILED_TRIAL",
    "SYSTEM_ATTR_RETRY_HISTORY",
    "TRIAL_STATE_GUARD",
    "RequeueOutcome",
    "RequeueResult",
    "RetryMaker",
    "fail_and_requeue",
    "fail_stale_trials",
    "redact_url",
    "study_stats",
    "trials_of_worker",
]

ATTR_RETRY_OF = "gpuwatchd:retry_of"
"""User attr of a retry: number of the original trial of its chain."""
ATTR_PARENT = "gpuwatchd:parent"
"""User attr of a retry: number of the failed trial it replaces."""
ATTR_RETRY = "gpuwatchd:retry"
"""User attr of a retry: its 1-based position in the chain."""
ATTR_RETRY_REASON = "gpuwatchd:retry_reason"
"""User attr of a retry: why its parent was failed."""
ATTR_MAX_RETRIES = "gpuwatchd:max_retries"
"""User attr of a retry: the ``max_retries`` in force when it was enqueued."""
ATTR_FAILED_REASON = "gpuwatchd:failed_reason"
"""User attr of a trial gpuwatchd moved from RUNNING to FAIL: why."""
ATTR_WORKER_ID = TRIAL_ATTR_WORKER_ID
"""User attr the hook writes at a trial's start in a managed worker: the worker launch's id."""
SYSTEM_ATTR_FAILED_TRIAL = "failed_trial"
"""Optuna's system attr of a retry (``optuna.storages.RetryFailedTrialCallback``): number of
the original trial of its chain; ``RetryFailedTrialCallback.retried_trial_number`` reads it."""
SYSTEM_ATTR_RETRY_HISTORY = "retry_history"
"""Optuna's system attr of a retry: the numbers of the trials of its chain before it, original
first, its parent last; ``RetryFailedTrialCallback.retry_history`` reads it."""
TRIAL_STATE_GUARD = "gpuwatchd_trial_state_guard"
"""Name of the SQLite trigger :func:`fail_and_requeue` adds to an SQLite storage's ``trials``
table: an update that sets a trial RUNNING that is no longer WAITING, or that changes the state
of a finished trial, fails as a constraint error (see :func:`fail_and_requeue`)."""

STATES = ("RUNNING", "WAITING", "COMPLETE", "PRUNED", "FAIL")
"""Optuna's :class:`~optuna.trial.TrialState` names, in the order ``study_stats`` reports them."""

DEFAULT_GRACE_PERIOD_S = 120
"""Heartbeat age after which a RUNNING trial is stale (Optuna's ``RDBStorage`` docs pair
``heartbeat_interval=60`` with ``grace_period=120``; Optuna's own default is twice the
interval, which the checker does not know)."""

RequeueOutcome = Literal[
    "requeued", "already_requeued", "retries_exhausted", "not_running", "not_found"
]

RetryMaker = Literal["gpuwatchd", "optuna"]
"""Who made a retry: gpuwatchd (:func:`fail_and_requeue`, :func:`fail_stale_trials`) or
Optuna's ``RetryFailedTrialCallback`` (run by a worker's heartbeat check)."""


@dataclasses.dataclass(frozen=True)
class RequeueResult:
    """What :func:`fail_and_requeue` did with one trial.

    ``outcome``:

    - ``requeued``: a WAITING retry with the trial's params was enqueued (``requeued_as``);
    - ``already_requeued``: a retry of this trial existed already (``requeued_as``), made by
      gpuwatchd or by Optuna's ``RetryFailedTrialCallback`` (``retried_by``); nothing new;
    - ``retries_exhausted``: the trial is FAIL and its chain has ``max_retries`` retries;
    - ``not_running``: the trial is COMPLETE, PRUNED or WAITING and was left alone;
    - ``not_found``: the study has no trial with that number.

    ``state_before`` is the Optuna state name seen before this call (None when not
    found); ``failed_now`` is True when this call moved it from RUNNING to FAIL.
    ``retry`` is the chain position of ``requeued_as`` (None without one), counting the
    retries of both makers; ``retried_by`` says who made ``requeued_as`` (None without one).
    ``params`` are the params (re-)enqueued, or the trial's params otherwise.
    """

    trial_number: int
    outcome: RequeueOutcome
    state_before: str | None
    failed_now: bool
    requeued_as: int | None = None
    retry: int | None = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    retried_by: RetryMaker | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the same keys as the fields."""
        return dataclasses.asdict(self)


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs, errors and output)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL has no password we can find: show its scheme only
        return url.split(":", 1)[0] + ":..." if ":" in url else "<storage URL>"


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


@contextlib.contextmanager
def _open_storage(url: str, **kwargs: Any) -> Iterator[RDBStorage]:
    """An Optuna :class:`~optuna.storages.RDBStorage` on ``url``, disposed at exit.

    Never creates anything: a database without Optuna's tables (a wrong file, an
    empty PostgreSQL database) is refused instead of being turned into a storage.

    Raises :class:`StudyError` for a missing SQLite file, an unknown or missing
    database driver (e.g. ``psycopg2`` not installed), a database that cannot be
    reached, or one that is not an Optuna storage; and, from the ``with`` body, for a
    storage error (SQLAlchemy's or Optuna's ``StorageInternalError``) while using it.
    """
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
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise StudyError(f"cannot open {where}: {first}") from None
    try:
        yield storage
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
        # e.g. SQLite's "database is locked" while workers write: a StudyError like the rest
        # (Optuna's StorageInternalError says only "an exception is raised during the
        # commit"; the database's own error is its cause)
        text = str(exc.__cause__ or exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise StudyError(f"{where}: {first}") from None
    finally:
        storage.remove_session()
        storage.engine.dispose()


def _study_id(storage: RDBStorage, url: str, study_name: str) -> int:
    try:
        return storage.get_study_id_from_name(study_name)
    except KeyError:
        raise StudyError(f"no study {study_name!r} in {redact_url(url)}") from None


def _link(trial: FrozenTrial) -> tuple[int, RetryMaker] | None:
    """(parent trial number, maker) of a retry; None for a trial that is not one.

    Optuna's ``RetryFailedTrialCallback`` writes ``retry_history`` (the parent last) and
    copies the failed trial's user attrs, so a retry whose ``gpuwatchd:parent`` is the last
    of its ``retry_history`` is gpuwatchd's, one with another (copied) or none is Optuna's.
    A gpuwatchd retry enqueued before gpuwatchd wrote the system attrs has only
    ``gpuwatchd:parent``.
    """
    history = trial.system_attrs.get(SYSTEM_ATTR_RETRY_HISTORY)
    own = trial.user_attrs.get(ATTR_PARENT)
    parent: object
    if isinstance(history, list) and history:
        parent = history[-1]
        maker: RetryMaker = "gpuwatchd" if own == parent else "optuna"
    else:
        parent, maker = own, "gpuwatchd"
    if isinstance(parent, int) and not isinstance(parent, bool) and parent != trial.number:
        return parent, maker
    return None


class _Chains:
    """The retry chains of one study's trials, whoever made the retries.

    Each retry links to its parent (:func:`_link`); a chain is followed through the links,
    so a chain mixing gpuwatchd's and Optuna's retries is one chain.
    """

    def __init__(self, trials: Iterable[FrozenTrial]) -> None:
        self._links: dict[int, tuple[int, RetryMaker]] = {}
        self._first_retry: dict[int, int] = {}
        for trial in sorted(trials, key=lambda t: t.number):
            self.add(trial)

    def add(self, trial: FrozenTrial) -> None:
        """Record ``trial`` (newer than every trial added before: a trial's first retry is
        the first one added)."""
        link = _link(trial)
        if link is not None:
            self._links[trial.number] = link
            self._first_retry.setdefault(link[0], trial.number)

    def is_retry(self, number: int) -> bool:
        """Whether trial ``number`` is a retry."""
        return number in self._links

    def maker(self, number: int) -> RetryMaker | None:
        """Who made retry ``number`` (None: not a retry)."""
        link = self._links.get(number)
        return None if link is None else link[1]

    def parent(self, number: int) -> int | None:
        """The trial retry ``number`` replaces (None: not a retry)."""
        link = self._links.get(number)
        return None if link is None else link[0]

    def retry_of(self, number: int) -> int | None:
        """The first retry made of trial ``number``, by either maker (None: none)."""
        return self._first_retry.get(number)

    def history(self, number: int) -> list[int]:
        """The trials of ``number``'s chain before it, original first (``[]``: not a retry)."""
        chain: list[int] = []
        parent = self.parent(number)
        while parent is not None and parent != number and parent not in chain:  # no loops
            chain.append(parent)
            parent = self.parent(parent)
        return chain[::-1]


def _params_of(trial: FrozenTrial) -> dict[str, Any]:
    """The params to retry with: enqueued (fixed) params, overlaid by those already suggested.

    A worker that died before suggesting every param leaves the rest to the sampler.
    """
    fixed = trial.system_attrs.get("fixed_params") or {}
    return {**dict(fixed), **trial.params}


def fail_and_requeue(
    storage_url: str,
    study_name: str,
    trial_numbers: Sequence[int],
    *,
    max_retries: int,
    reason: str,
) -> list[RequeueResult]:
    """Fail the RUNNING trials ``trial_numbers`` of a crashed worker and enqueue them again.

    For each trial number, in order: a RUNNING trial gets ``gpuwatchd:failed_reason =
    reason`` and is moved to ``FAIL`` (Optuna's ``set_trial_state_values``, which locks
    the row: if the worker finished it meanwhile, its COMPLETE/PRUNED/FAIL state wins and
    is left as it is). A trial that is FAIL — now or before (Optuna fails a trial whose
    objective raised before the process died) — is enqueued again with its params, unless
    a retry of it exists already, gpuwatchd's or one Optuna's ``RetryFailedTrialCallback``
    made when a worker's heartbeat check failed it (``already_requeued``: never two retries
    of one failure), or its chain already holds ``max_retries`` retries (of either maker).
    COMPLETE, PRUNED and WAITING trials are left alone. Other trials of the study (other
    workers, other machines sharing the storage) are never touched.

    The retry is created in one write, a WAITING trial as ``Study.enqueue_trial`` makes
    (the params in its ``fixed_params`` system attr), with the ``gpuwatchd:*`` lineage user
    attrs and Optuna's own system attrs as ``RetryFailedTrialCallback`` writes them:
    ``failed_trial`` (the original trial of the chain) and ``retry_history`` (the chain's
    trials before the retry, original first), so ``RetryFailedTrialCallback.
    retried_trial_number(trial)`` and ``retry_history(trial)`` work on it (checkpoint
    resume as in optuna-examples' ``pytorch/pytorch_checkpoint.py``), and Optuna's callback
    counts gpuwatchd's retries in its own ``max_retry``.

    On SQLite, Optuna's row lock is a no-op (SQLite has no ``SELECT ... FOR UPDATE``), so
    two threads of one worker (``optimize(n_jobs=2)``) or two workers can both pop the same
    WAITING trial and run it twice (``ValueError: Cannot tell a COMPLETE trial.``). Before
    it writes, this adds the trigger :data:`TRIAL_STATE_GUARD` to an SQLite storage (once;
    ``DROP TRIGGER gpuwatchd_trial_state_guard`` removes it), which turns the losing update
    into the constraint error Optuna already reads as "another one got it first"; likewise
    a second write of a finished trial's state (two heartbeat checks failing one stale
    trial, or gpuwatchd failing a trial its worker completes at that moment: the first wins).

    Two processes recovering the *same* trial at the same time could both enqueue it;
    gpuwatchd avoids that by letting only the daemon that supervises a worker recover it.

    Args:
        storage_url: Optuna RDB storage URL.
        study_name: the study's name.
        trial_numbers: Optuna trial numbers (``trial.number``), not storage trial ids.
        max_retries: how many retries a chain may have (0: fail, never re-enqueue).
        reason: recorded in the attrs, e.g. ``cuda_assert``, ``cuda_oom``, ``stopped``.

    Returns:
        One :class:`RequeueResult` per trial number, in the same order.

    Raises:
        StudyError: bad URL, unreachable storage, or no such study.
        ValueError: ``max_retries`` < 0.
    """
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, not {max_retries}")
    with _open_storage(storage_url) as storage:
        study_id = _study_id(storage, storage_url, study_name)
        _guard_trial_states(storage)
        chains = _Chains(storage.get_all_trials(study_id, deepcopy=False))
        results = []
        for number in trial_numbers:
            results.append(
                _fail_and_requeue_one(
                    storage,
                    study_id,
                    number,
                    chains,
                    max_retries=max_retries,
                    reason=reason,
                    mark_running=True,
                )
            )
        return results


_GUARD_SQL = f"""\
CREATE TRIGGER {TRIAL_STATE_GUARD}
BEFORE UPDATE OF state ON trials FOR EACH ROW
WHEN (NEW.state = 'RUNNING' AND OLD.state <> 'WAITING')
  OR OLD.state IN ('COMPLETE', 'PRUNED', 'FAIL')
BEGIN
  SELECT RAISE(ABORT, 'gpuwatchd: trial state changed by another thread or process first');
END"""


def _guard_trial_states(storage: RDBStorage) -> bool:
    """Add :data:`TRIAL_STATE_GUARD` to an SQLite storage if missing; True if it has it.

    Optuna's ``_pop_waiting_trial_id`` (optuna/study/study.py) takes a WAITING trial when
    ``RDBStorage.set_trial_state_values(id, RUNNING)`` returns True; that reads the row
    with ``with_for_update()`` (optuna/storages/_rdb/models.py ``TrialModel.
    find_or_raise_by_id``: "SQLite3 doesn't support this clause") and, on SQLite, outside
    any transaction (pysqlite begins one at the first write), so two sessions that read
    WAITING both write RUNNING and both return True. With the trigger the second write
    aborts; SQLite reports a constraint error, SQLAlchemy an ``IntegrityError``, and
    ``set_trial_state_values`` returns False, as with the row lock of PostgreSQL or MySQL.
    Finished states are guarded likewise (the first of two finishers wins). Other
    storages are left as they are (False).
    """
    engine = getattr(storage, "engine", None)
    if engine is None or engine.dialect.name != "sqlite":
        return False
    with engine.begin() as connection:
        present = connection.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = ?",
            (TRIAL_STATE_GUARD,),
        ).first()
        if present is None or present[0] != _GUARD_SQL:  # missing, or another version's
            connection.exec_driver_sql(f"DROP TRIGGER IF EXISTS {TRIAL_STATE_GUARD}")
            connection.exec_driver_sql(_GUARD_SQL)
    return True


def _fail_and_requeue_one(
    storage: RDBStorage,
    study_id: int,
    number: int,
    chains: _Chains,
    *,
    max_retries: int,
    reason: str,
    mark_running: bool,
    state_before: str | None = None,
) -> RequeueResult:
    import optuna
    from optuna.trial import TrialState

    try:
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
    except KeyError:
        return RequeueResult(number, "not_found", None, False)
    trial = storage.get_trial(trial_id)
    if state_before is None:
        state_before = trial.state.name
    failed_now = False
    if trial.state == TrialState.RUNNING and mark_running:
        try:
            storage.set_trial_user_attr(trial_id, ATTR_FAILED_REASON, reason)
            failed_now = storage.set_trial_state_values(trial_id, TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # the worker finished it first; its state stands
        trial = storage.get_trial(trial_id)
    params = _params_of(trial)
    if trial.state != TrialState.FAIL:
        return RequeueResult(number, "not_running", state_before, failed_now, params=params)
    existing = chains.retry_of(number)
    if existing is not None:
        return RequeueResult(
            number,
            "already_requeued",
            state_before,
            failed_now,
            requeued_as=existing,
            retry=len(chains.history(existing)),
            params=params,
            retried_by=chains.maker(existing),
        )
    history = [*chains.history(number), number]
    position = len(history)
    if position > max_retries:
        return RequeueResult(number, "retries_exhausted", state_before, failed_now, params=params)
    template = optuna.trial.create_trial(
        state=TrialState.WAITING,
        system_attrs={
            "fixed_params": params,  # as Study.enqueue_trial stores them
            SYSTEM_ATTR_FAILED_TRIAL: history[0],
            SYSTEM_ATTR_RETRY_HISTORY: history,
        },
        user_attrs={
            ATTR_RETRY_OF: history[0],
            ATTR_PARENT: number,
            ATTR_RETRY: position,
            ATTR_RETRY_REASON: reason,
            ATTR_MAX_RETRIES: max_retries,
        },
    )
    child = storage.get_trial(storage.create_new_trial(study_id, template_trial=template))
    chains.add(child)
    return RequeueResult(
        number,
        "requeued",
        state_before,
        failed_now,
        requeued_as=child.number,
        retry=position,
        params=params,
        retried_by="gpuwatchd",
    )


def trials_of_worker(storage_url: str, study_name: str, worker_id: str) -> tuple[int, ...] | None:
    """The trials worker launch ``worker_id`` left behind when it died, newest last.

    The trials are those whose ``gpuwatchd:worker_id`` user attr is ``worker_id`` (the
    hook writes it when each trial starts). A worker runs its trials one after another
    (``study.optimize`` with ``n_jobs=1``, Optuna's default), so the trials it died in
    are the ones still ``RUNNING`` (several with ``n_jobs > 1``) or, when none is, its
    newest trial if that one is ``FAIL`` (the objective raised and Optuna failed the
    trial before the process ended). An older FAIL trial is one the worker survived
    (e.g. ``catch=`` in ``optimize``) and is not returned. A retry Optuna's
    ``RetryFailedTrialCallback`` made of the worker's trial carries the worker's id as a
    copy of its parent's user attrs until it runs; it is not the worker's.

    Returns:
        The trial numbers, ascending; ``()`` when the worker's trials all ended
        otherwise (it died between trials); ``None`` when no trial of the study names
        ``worker_id`` (the worker died before its first trial, or runs without the hook).

    Raises:
        StudyError: bad URL, unreachable storage, or no such study.
    """
    from optuna.trial import TrialState

    with _open_storage(storage_url) as storage:
        study_id = _study_id(storage, storage_url, study_name)
        trials = storage.get_all_trials(study_id, deepcopy=False)
    chains = _Chains(trials)
    by_number = {trial.number: trial for trial in trials}

    def copied(trial: FrozenTrial) -> bool:
        # Optuna's RetryFailedTrialCallback copies the failed trial's user attrs, the dead
        # worker's id with them, into its WAITING retry; the hook overwrites it at the start.
        number = chains.parent(trial.number)
        parent = None if number is None else by_number.get(number)
        return (
            chains.maker(trial.number) == "optuna"
            and parent is not None
            and parent.user_attrs.get(ATTR_WORKER_ID) == worker_id
        )

    mine = [t for t in trials if t.user_attrs.get(ATTR_WORKER_ID) == worker_id and not copied(t)]
    if not mine:
        return None
    running = sorted(t.number for t in mine if t.state == TrialState.RUNNING)
    if running:
        return tuple(running)
    newest = max(mine, key=lambda t: t.number)
    return (newest.number,) if newest.state == TrialState.FAIL else ()


def fail_stale_trials(
    storage_url: str,
    study_name: str,
    *,
    max_retries: int,
    grace_period_s: int = DEFAULT_GRACE_PERIOD_S,
    reason: str = "heartbeat_stale",
) -> list[RequeueResult]:
    """Fail RUNNING trials whose heartbeat stopped; enqueue them as :func:`fail_and_requeue` does.

    For workers that vanished without the hook naming their trial. Works only for
    workers that record heartbeats: their storage must be
    ``optuna.storages.RDBStorage(url, heartbeat_interval=H)`` with ``H`` well under
    ``grace_period_s`` (trials without any heartbeat are never stale). Uses Optuna's
    :func:`optuna.storages.fail_stale_trials`, whose row lock makes each stale trial
    fail in exactly one caller (on SQLite through :data:`TRIAL_STATE_GUARD`, added here as
    :func:`fail_and_requeue` adds it); only the trials *this* call failed are re-enqueued
    (Optuna workers with heartbeats run the same check at each trial start and
    handle what they fail with their own ``heartbeat_stale_trial_callback``, e.g.
    ``RetryFailedTrialCallback``; a trial gpuwatchd failed is no longer RUNNING, so
    their check never retries it a second time).

    Args:
        storage_url: Optuna RDB storage URL.
        study_name: the study's name.
        max_retries: as in :func:`fail_and_requeue`.
        grace_period_s: seconds (an integer, as Optuna's ``grace_period``) without a
            heartbeat after which a RUNNING trial is stale; the database's clock decides.
        reason: recorded as ``gpuwatchd:retry_reason`` of the retries.

    Returns:
        One :class:`RequeueResult` per trial this call failed (``trial_number`` is the
        failed trial; ``state_before`` is ``RUNNING``), in trial-number order.

    Raises:
        StudyError: bad URL, unreachable storage, or no such study.
        ValueError: ``max_retries`` < 0 or ``grace_period_s`` < 1.
    """
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, not {max_retries}")
    if grace_period_s < 1:
        raise ValueError(f"grace_period_s must be >= 1, not {grace_period_s}")
    import optuna

    failed: list[int] = []

    def collect(_study: optuna.Study, trial: FrozenTrial) -> None:
        failed.append(trial.number)

    # Optuna 4.9 renamed failed_trial_callback to heartbeat_stale_trial_callback.
    params = inspect.signature(optuna.storages.RDBStorage).parameters
    callback_kw = (
        "heartbeat_stale_trial_callback"
        if "heartbeat_stale_trial_callback" in params
        else "failed_trial_callback"
    )
    kwargs: dict[str, Any] = {
        "heartbeat_interval": grace_period_s,  # only switches the check on; we send no beats
        "grace_period": grace_period_s,
        callback_kw: collect,
    }
    with _open_storage(storage_url, **kwargs) as storage:
        study_id = _study_id(storage, storage_url, study_name)
        _guard_trial_states(storage)
        study = optuna.load_study(study_name=study_name, storage=storage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        chains = _Chains(storage.get_all_trials(study_id, deepcopy=False))
        return [
            _fail_and_requeue_one(
                storage,
                study_id,
                number,
                chains,
                max_retries=max_retries,
                reason=reason,
                mark_running=False,
                state_before="RUNNING",
            )
            for number in sorted(failed)
        ]


def _timestamp(value: datetime | None) -> float | None:
    # Naive datetimes (Optuna's datetime.now()) are local time, as time.time() compares.
    return None if value is None else value.timestamp()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def study_stats(
    storage_url: str, study_name: str | None = None, *, now_s: float | None = None
) -> dict[str, Any]:
    """Statistics of one study, or of every study in the storage when ``study_name`` is None.

    The stable shape (``gpuwatchctl study --json``; all times in seconds, timestamps
    since the Unix epoch, percentages 0-100)::

        {"storage": URL (password hidden), "generated_at_s": float,
         "studies": [{
            "study": str, "directions": ["minimize" | "maximize", ...], "trials": int,
            "states": {STATE: {"count": int, "pct": float, "mean_duration_s": float | None}}
                      for STATE in RUNNING, WAITING, COMPLETE, PRUNED, FAIL,
            "pruned_pct": float | None,      # PRUNED / (COMPLETE + PRUNED)
            "retries": {"retry_trials": int,    # retry trials, gpuwatchd's and Optuna's
                        "retried_trials": int,  # distinct original trials retried
                        "max_retry": int,       # longest chain (0: none)
                        "by_state": {STATE: int},
                        "made_by": {"gpuwatchd": int, "optuna": int}},
            "trials_per_hour": {"overall": float | None,   # finished / span hours
                                "last_hour": int},         # finished in the last 3600 s
            "first_start_s": float | None, "last_complete_s": float | None,
            "best_value": float | None, "best_trial": int | None}]}

    A retry is a trial gpuwatchd enqueued for a failed one (:func:`fail_and_requeue`) or
    one Optuna's ``RetryFailedTrialCallback`` made (its ``retry_history`` system attr);
    ``made_by`` counts them per maker, and a chain mixing both counts as one chain.
    "Finished" means COMPLETE, PRUNED or FAIL. ``mean_duration_s`` is over the trials of
    that state with both a start and a completion time (None for RUNNING and WAITING).
    The span runs from the first trial start to the last completion. ``best_*`` are
    None for multi-objective studies and studies without a COMPLETE trial.

    Args:
        storage_url: Optuna RDB storage URL.
        study_name: one study, or None for all (sorted by name).
        now_s: "now" for ``last_hour`` (default :func:`time.time`).

    Raises:
        StudyError: bad URL, unreachable storage, or no such study.
    """
    now = time.time() if now_s is None else now_s
    with _open_storage(storage_url) as storage:
        if study_name is None:
            studies = sorted(storage.get_all_studies(), key=lambda s: s.study_name)
            chosen = [(s.study_name, s._study_id) for s in studies]
        else:
            chosen = [(study_name, _study_id(storage, storage_url, study_name))]
        out = []
        for name, study_id in chosen:
            directions = [d.name.lower() for d in storage.get_study_directions(study_id)]
            trials = storage.get_all_trials(study_id, deepcopy=False)
            out.append(_stats_of(name, directions, trials, now))
    return {"storage": redact_url(storage_url), "generated_at_s": now, "studies": out}


def _stats_of(
    name: str, directions: list[str], trials: Sequence[FrozenTrial], now_s: float
) -> dict[str, Any]:
    """The per-study dict of :func:`study_stats`."""
    total = len(trials)
    counts = dict.fromkeys(STATES, 0)
    durations: dict[str, list[float]] = {state: [] for state in STATES}
    for trial in trials:
        state = trial.state.name
        counts[state] = counts.get(state, 0) + 1
        start, complete = _timestamp(trial.datetime_start), _timestamp(trial.datetime_complete)
        if start is not None and complete is not None:
            durations.setdefault(state, []).append(complete - start)
    states = {
        state: {
            "count": counts[state],
            "pct": 100.0 * counts[state] / total if total else 0.0,
            "mean_duration_s": _mean(durations[state]),
        }
        for state in counts
    }
    decided = counts["COMPLETE"] + counts["PRUNED"]
    finished = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED", "FAIL")]
    starts = [s for t in trials if (s := _timestamp(t.datetime_start)) is not None]
    completes = [c for t in finished if (c := _timestamp(t.datetime_complete)) is not None]
    first_start = min(starts) if starts else None
    last_complete = max(completes) if completes else None
    overall = None
    if first_start is not None and last_complete is not None and last_complete > first_start:
        overall = len(finished) / ((last_complete - first_start) / 3600.0)
    chains = _Chains(trials)
    retry_trials = [t for t in trials if chains.is_retry(t.number)]
    by_state = dict.fromkeys(STATES, 0)
    made_by: dict[str, int] = {"gpuwatchd": 0, "optuna": 0}
    histories = []
    for trial in retry_trials:
        by_state[trial.state.name] = by_state.get(trial.state.name, 0) + 1
        made_by[chains.maker(trial.number) or "gpuwatchd"] += 1
        histories.append(chains.history(trial.number))
    best_value: float | None = None
    best_trial: int | None = None
    if len(directions) == 1:
        valued = [
            (float(t.value), t.number)
            for t in trials
            if t.state.name == "COMPLETE" and t.value is not None
        ]
        if valued:
            sign = 1.0 if directions[0] == "minimize" else -1.0
            best_value, best_trial = min(valued, key=lambda vn: (sign * vn[0], vn[1]))
    return {
        "study": name,
        "directions": directions,
        "trials": total,
        "states": states,
        "pruned_pct": 100.0 * counts["PRUNED"] / decided if decided else None,
        "retries": {
            "retry_trials": len(retry_trials),
            "retried_trials": len({history[0] for history in histories}),
            "max_retry": max((len(history) for history in histories), default=0),
            "by_state": by_state,
            "made_by": made_by,
        },
        "trials_per_hour": {
            "overall": overall,
            "last_hour": sum(1 for c in completes if now_s - 3600.0 <= c <= now_s),
        },
        "first_start_s": first_start,
        "last_complete_s": last_complete,
        "best_value": best_value,
        "best_trial": best_trial,
    }
