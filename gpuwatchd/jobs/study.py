"""Optuna study recovery and statistics (Optuna imported inside the functions only).

Specification: docs/modules.md#gpuwatchdjobsstudy
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from gpuwatchd.control.protocol import TRIAL_ATTR_WORKER_ID
from gpuwatchd.errors import StudyError
from gpuwatchd.jobs.sqlite_guard import TRIAL_STATE_GUARD, guard_trial_states
from gpuwatchd.jobs.storage import open_storage, redact_url
from gpuwatchd.jobs.study_summary import STATES, summarize_trials
from gpuwatchd.jobs.trial_lineage import (
    ATTR_MAX_RETRIES,
    ATTR_PARENT,
    ATTR_RETRY,
    ATTR_RETRY_OF,
    ATTR_RETRY_REASON,
    SYSTEM_ATTR_FAILED_TRIAL,
    SYSTEM_ATTR_RETRY_HISTORY,
    RetryChains,
    RetryMaker,
    retry_link,
)

if TYPE_CHECKING:  # pragma: no cover - typing only; optuna is imported lazily
    from optuna.storages import BaseStorage
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
    "RunningTrial",
    "WorkerTrials",
    "abandon_waiting_retries",
    "fail_and_requeue",
    "fail_stale_trials",
    "redact_url",
    "running_trials",
    "study_stats",
    "trials_of_worker",
]

ATTR_FAILED_REASON = "gpuwatchd:failed_reason"
"""User attr of a trial gpuwatchd moved from RUNNING to FAIL: why."""
ATTR_WORKER_ID = TRIAL_ATTR_WORKER_ID
"""User attr the hook writes at a trial's start in a managed worker: the worker launch's id."""

DEFAULT_GRACE_PERIOD_S = 120
"""Heartbeat age after which a RUNNING trial is stale (Optuna's ``RDBStorage`` docs pair
``heartbeat_interval=60`` with ``grace_period=120``; Optuna's own default is twice the
interval, which the checker does not know)."""

RequeueOutcome = Literal[
    "requeued", "already_requeued", "retries_exhausted", "not_running", "not_found"
]


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


def _study_id(storage: BaseStorage, url: str, study_name: str) -> int:
    try:
        return storage.get_study_id_from_name(study_name)
    except KeyError:
        raise StudyError(f"no study {study_name!r} in {redact_url(url)}") from None


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

    On SQLite, Optuna's row lock is a no-op, so two threads of ``optimize(n_jobs=2)`` could
    both pop one WAITING retry and run it twice (``ValueError: Cannot tell a COMPLETE
    trial.``): before it writes, this adds :mod:`gpuwatchd.jobs.sqlite_guard`'s trigger.

    Two processes recovering the *same* trial at the same time could both enqueue it;
    gpuwatchd avoids that by letting only the daemon that supervises a worker recover it.

    Args:
        storage_url: a storage spec (:mod:`gpuwatchd.jobs.storage`): an RDB URL or a journal.
        study_name: the study's name.
        trial_numbers: Optuna trial numbers (``trial.number``), not storage trial ids.
        max_retries: how many retries a chain may have (0: fail, never re-enqueue).
        reason: recorded in the attrs, e.g. ``cuda_assert``, ``cuda_oom``, ``stopped``.

    Returns:
        One :class:`RequeueResult` per trial number, in the same order.

    Raises:
        StudyError: bad storage spec, unreachable storage, or no such study.
        ValueError: ``max_retries`` < 0.
    """
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, not {max_retries}")
    with open_storage(storage_url) as storage:
        study_id = _study_id(storage, storage_url, study_name)
        guard_trial_states(storage)
        chains = RetryChains(storage.get_all_trials(study_id, deepcopy=False))
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


def _fail_and_requeue_one(
    storage: BaseStorage,
    study_id: int,
    number: int,
    chains: RetryChains,
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


@dataclasses.dataclass(frozen=True)
class WorkerTrials:
    """The trials a dead worker launch left behind, as the study tells it.

    ``running``: its trials still ``RUNNING``, ascending (several with ``n_jobs > 1``).
    ``failed``: the ``FAIL`` trial that ended the process, if any: its newest FAIL trial
    (by completion) after which it started no other trial (Optuna failed it because the
    objective raised, and the exception left ``optimize``); a FAIL trial the worker went
    on from (``catch=``) is not it. ``finished``: how many of its trials ended COMPLETE or
    PRUNED.
    """

    running: tuple[int, ...]
    failed: int | None
    finished: int = 0

    @property
    def crashed(self) -> int | None:
        """The trial that hit the error: ``failed`` when Optuna failed one, else the
        newest RUNNING trial (an abort leaves every trial RUNNING), else None."""
        if self.failed is not None:
            return self.failed
        return self.running[-1] if self.running else None

    @property
    def others(self) -> tuple[int, ...]:
        """The RUNNING trials that died with the process but are not :attr:`crashed`."""
        return tuple(n for n in self.running if n != self.crashed)


def trials_of_worker(storage_url: str, study_name: str, worker_id: str) -> WorkerTrials | None:
    """The trials worker launch ``worker_id`` left behind when it died.

    The trials are those whose ``gpuwatchd:worker_id`` user attr is ``worker_id`` (the
    hook writes it when each trial starts); see :class:`WorkerTrials` for which of them
    died with it. A worker running ``study.optimize(..., n_jobs=2)`` may leave an older
    FAIL trial (the one whose objective raised) and a newer COMPLETE one (its sibling
    finished while ``optimize`` waited for it): the FAIL trial is the one it died of.
    A retry Optuna's ``RetryFailedTrialCallback`` made of the worker's trial carries the
    worker's id as a copy of its parent's user attrs until it runs; it is not the worker's.

    Returns:
        A :class:`WorkerTrials` (``running == ()`` and ``failed is None`` when the
        worker's trials all ended otherwise: it died between trials); ``None`` when no
        trial of the study names ``worker_id`` (the worker died before its first trial
        was tagged, or runs without the hook).

    Raises:
        StudyError: bad storage spec, unreachable storage, or no such study.
    """
    from optuna.trial import TrialState

    with open_storage(storage_url) as storage:
        study_id = _study_id(storage, storage_url, study_name)
        trials = storage.get_all_trials(study_id, deepcopy=False)
    chains = RetryChains(trials)
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
    running = tuple(sorted(t.number for t in mine if t.state == TrialState.RUNNING))
    finished = sum(1 for t in mine if t.state in (TrialState.COMPLETE, TrialState.PRUNED))
    fails = [t for t in mine if t.state == TrialState.FAIL and t.datetime_complete is not None]
    failed: int | None = None
    if fails:
        last = max(fails, key=lambda t: (t.datetime_complete, t.number))
        ended = last.datetime_complete
        assert ended is not None
        went_on = any(
            t.datetime_start is not None and t.datetime_start > ended and t.number != last.number
            for t in mine
        )
        if not went_on:
            failed = last.number
    return WorkerTrials(running, failed, finished)


@dataclasses.dataclass(frozen=True)
class RunningTrial:
    """A ``RUNNING`` trial of a study: its number, the worker launch that tagged it
    (``gpuwatchd:worker_id``, ``None`` before the hook's tag or without the hook) and its
    ``datetime_start`` as a POSIX timestamp (seconds; Optuna stores the naive local time
    of the process that started it, read in the workers' zone: :func:`running_trials`)."""

    number: int
    worker_id: str | None
    started_s: float | None


def _stores_utc() -> bool:
    """Whether the installed Optuna stores trial datetimes in UTC (5.0 on; pull 6776)."""
    import optuna

    major = optuna.__version__.split(".", 1)[0]
    return major.isdigit() and int(major) >= 5


def running_trials(
    storage_url: str, study_name: str, tz: datetime.tzinfo | None = None
) -> list[RunningTrial]:
    """The study's ``RUNNING`` trials, ascending by number.

    ``tz``: the time zone of the workers that started them, None for the daemon's own
    (:func:`gpuwatchd.jobs.orphans.workers_time_zone` tells which). Optuna 4 stores
    ``datetime_start`` as the writer's naive local time, so it is read in ``tz``; Optuna 5
    stores UTC and hands it back as the *reader's* local time (optuna/optuna pull 6776),
    so ``tz`` is not needed and not applied (workers on Optuna 4 beside a daemon on 5
    are not told apart: docs/managed-jobs.md, "No trial left RUNNING").

    A ``gpuwatchd:worker_id`` that Optuna's ``RetryFailedTrialCallback`` copied from the
    failed parent into its retry names the dead launch, not the one running the retry
    (the hook overwrites it only when its trial scope starts): such a trial counts as
    untagged.

    Raises:
        StudyError: bad URL, unreachable storage, or no such study.
    """
    from optuna.trial import TrialState

    if _stores_utc():
        tz = None  # handed back in this process's local time already
    with open_storage(storage_url) as storage:
        study_id = _study_id(storage, storage_url, study_name)
        trials = storage.get_all_trials(study_id, deepcopy=False)
    chains = RetryChains(trials)
    by_number = {trial.number: trial for trial in trials}
    found = []
    for trial in sorted(trials, key=lambda t: t.number):
        if trial.state != TrialState.RUNNING:
            continue
        tag = trial.user_attrs.get(ATTR_WORKER_ID)
        parent_number = chains.parent(trial.number)
        parent = None if parent_number is None else by_number.get(parent_number)
        if (
            chains.maker(trial.number) == "optuna"
            and parent is not None
            and parent.user_attrs.get(ATTR_WORKER_ID) == tag
        ):
            tag = None  # copied by Optuna's retry callback
        found.append(
            RunningTrial(
                trial.number,
                tag if isinstance(tag, str) else None,
                None
                if trial.datetime_start is None
                else trial.datetime_start.replace(tzinfo=tz).timestamp(),
            )
        )
    return found


def abandon_waiting_retries(storage_url: str, study_name: str, *, reason: str) -> list[int]:
    """Fail the retries (gpuwatchd's or Optuna's) still ``WAITING`` in a study no worker
    will run again; their numbers, ascending.

    For a managed job whose every worker exited 0 (the study's own stop rule, e.g.
    ``MaxTrialsCallback``, ended it) while a retry enqueued at the same moment was not
    popped: left WAITING it would be picked up by any later ``optimize`` and count as
    open work. Each gets ``gpuwatchd:failed_reason = reason`` and moves WAITING -> FAIL;
    one a worker took meanwhile (no longer WAITING) is left alone. Trials a user enqueued
    (no retry link) are never touched.

    Raises:
        StudyError: bad storage spec, unreachable storage, or no such study.
    """
    import optuna
    from optuna.trial import TrialState

    abandoned: list[int] = []
    with open_storage(storage_url) as storage:
        study_id = _study_id(storage, storage_url, study_name)
        guard_trial_states(storage)
        waiting = storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.WAITING,))
        for trial in sorted(waiting, key=lambda t: t.number):
            if retry_link(trial) is None:
                continue
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
            try:
                # Claim it as a worker pops it (row-locked: False when one took it first),
                # then fail it: never the trial a worker has just started.
                if not storage.set_trial_state_values(trial_id, TrialState.RUNNING):
                    continue
                storage.set_trial_user_attr(trial_id, ATTR_FAILED_REASON, reason)
                storage.set_trial_state_values(trial_id, TrialState.FAIL)
                abandoned.append(trial.number)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # a worker ran it after all
    return abandoned


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
    A journal storage is refused: Optuna's ``JournalStorage`` records no heartbeats.

    Args:
        storage_url: a storage spec (:mod:`gpuwatchd.jobs.storage`): an RDB URL or a journal.
        study_name: the study's name.
        max_retries: as in :func:`fail_and_requeue`.
        grace_period_s: seconds (an integer, as Optuna's ``grace_period``) without a
            heartbeat after which a RUNNING trial is stale; the database's clock decides.
        reason: recorded as ``gpuwatchd:retry_reason`` of the retries.

    Returns:
        One :class:`RequeueResult` per trial this call failed (``trial_number`` is the
        failed trial; ``state_before`` is ``RUNNING``), in trial-number order.

    Raises:
        StudyError: bad storage spec, unreachable storage, a journal storage, or no
            such study.
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
    with open_storage(storage_url, **kwargs) as storage:
        study_id = _study_id(storage, storage_url, study_name)
        guard_trial_states(storage)
        study = optuna.load_study(study_name=study_name, storage=storage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        chains = RetryChains(storage.get_all_trials(study_id, deepcopy=False))
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
        storage_url: a storage spec (:mod:`gpuwatchd.jobs.storage`): an RDB URL or a journal.
        study_name: one study, or None for all (sorted by name).
        now_s: "now" for ``last_hour`` (default :func:`time.time`).

    Raises:
        StudyError: bad storage spec, unreachable storage, or no such study.
    """
    now = time.time() if now_s is None else now_s
    with open_storage(storage_url) as storage:
        if study_name is None:
            # a FrozenStudy's id is only its private _study_id: look each one up by name
            names = sorted(s.study_name for s in storage.get_all_studies())
        else:
            names = [study_name]
        out = []
        for name in names:
            study_id = _study_id(storage, storage_url, name)
            directions = [d.name.lower() for d in storage.get_study_directions(study_id)]
            trials = storage.get_all_trials(study_id, deepcopy=False)
            out.append(summarize_trials(name, directions, trials, now))
    return {"storage": redact_url(storage_url), "generated_at_s": now, "studies": out}
