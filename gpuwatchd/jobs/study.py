"""Optuna study recovery and statistics: the daemon's only door to Optuna.

Specification: docs/modules.md#gpuwatchdjobsstudy
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import warnings
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from gpuwatchd.control.protocol import TRIAL_ATTR_WORKER_ID
from gpuwatchd.errors import StudyError
from gpuwatchd.jobs.storage import open_storage, redact_url

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
    "RequeueOutcome",
    "RequeueResult",
    "RunningTrial",
    "WorkerTrials",
    "fail_and_requeue",
    "fail_stale_trials",
    "redact_url",
    "running_trials",
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

STATES = ("RUNNING", "WAITING", "COMPLETE", "PRUNED", "FAIL")
"""Optuna's :class:`~optuna.trial.TrialState` names, in the order ``study_stats`` reports them."""

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
    - ``already_requeued``: a retry of this trial existed already (``requeued_as``); nothing new;
    - ``retries_exhausted``: the trial is FAIL and its chain has ``max_retries`` retries;
    - ``not_running``: the trial is COMPLETE, PRUNED or WAITING and was left alone;
    - ``not_found``: the study has no trial with that number.

    ``state_before`` is the Optuna state name seen before this call (None when not
    found); ``failed_now`` is True when this call moved it from RUNNING to FAIL.
    ``retry`` is the chain position of ``requeued_as`` (None without one).
    ``params`` are the params (re-)enqueued, or the trial's params otherwise.
    """

    trial_number: int
    outcome: RequeueOutcome
    state_before: str | None
    failed_now: bool
    requeued_as: int | None = None
    retry: int | None = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with the same keys as the fields."""
        return dataclasses.asdict(self)


def _study_id(storage: BaseStorage, url: str, study_name: str) -> int:
    try:
        return storage.get_study_id_from_name(study_name)
    except KeyError:
        raise StudyError(f"no study {study_name!r} in {redact_url(url)}") from None


def _lineage(trial: FrozenTrial) -> tuple[int, int]:
    """(original trial number, position in the chain) of ``trial``: (itself, 0) if not a retry."""
    attrs = trial.user_attrs
    root = attrs.get(ATTR_RETRY_OF, trial.number)
    position = attrs.get(ATTR_RETRY, 0)
    return int(root), int(position)


def _children(trials: Sequence[FrozenTrial]) -> dict[int, FrozenTrial]:
    """Map parent trial number -> the (first) retry gpuwatchd enqueued for it."""
    found: dict[int, FrozenTrial] = {}
    for trial in trials:
        parent = trial.user_attrs.get(ATTR_PARENT)
        if isinstance(parent, int) and parent not in found:
            found[parent] = trial
    return found


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
    objective raised before the process died) — is enqueued again with its params and
    the lineage attrs of the module docstring, unless a retry of it exists already
    (idempotent) or its chain already holds ``max_retries`` retries. COMPLETE, PRUNED
    and WAITING trials are left alone. Other trials of the study (other workers, other
    machines sharing the storage) are never touched.

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
        children = _children(storage.get_all_trials(study_id, deepcopy=False))
        results = []
        for number in trial_numbers:
            results.append(
                _fail_and_requeue_one(
                    storage,
                    study_id,
                    study_name,
                    number,
                    children,
                    max_retries=max_retries,
                    reason=reason,
                    mark_running=True,
                )
            )
        return results


def _fail_and_requeue_one(
    storage: BaseStorage,
    study_id: int,
    study_name: str,
    number: int,
    children: dict[int, FrozenTrial],
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
    existing = children.get(number)
    if existing is not None:
        return RequeueResult(
            number,
            "already_requeued",
            state_before,
            failed_now,
            requeued_as=existing.number,
            retry=_lineage(existing)[1],
            params=params,
        )
    root, position = _lineage(trial)
    if position >= max_retries:
        return RequeueResult(number, "retries_exhausted", state_before, failed_now, params=params)
    study = optuna.load_study(study_name=study_name, storage=storage)
    study.enqueue_trial(
        params,
        user_attrs={
            ATTR_RETRY_OF: root,
            ATTR_PARENT: number,
            ATTR_RETRY: position + 1,
            ATTR_RETRY_REASON: reason,
            ATTR_MAX_RETRIES: max_retries,
        },
    )
    waiting = storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.WAITING,))
    child = _children(waiting).get(number)
    assert child is not None, "enqueue_trial left no WAITING retry"
    children[number] = child
    return RequeueResult(
        number,
        "requeued",
        state_before,
        failed_now,
        requeued_as=child.number,
        retry=position + 1,
        params=params,
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
        mine = [
            trial
            for trial in storage.get_all_trials(study_id, deepcopy=False)
            if trial.user_attrs.get(ATTR_WORKER_ID) == worker_id
        ]
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
    ``datetime_start`` as a POSIX timestamp (seconds; Optuna stores the local time of
    the process that started it)."""

    number: int
    worker_id: str | None
    started_s: float | None


def running_trials(storage_url: str, study_name: str) -> list[RunningTrial]:
    """The study's ``RUNNING`` trials, ascending by number.

    Raises:
        StudyError: bad URL, unreachable storage, or no such study.
    """
    from optuna.trial import TrialState

    with open_storage(storage_url) as storage:
        study_id = _study_id(storage, storage_url, study_name)
        trials = storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
    found = []
    for trial in sorted(trials, key=lambda t: t.number):
        tag = trial.user_attrs.get(ATTR_WORKER_ID)
        found.append(
            RunningTrial(
                trial.number,
                tag if isinstance(tag, str) else None,
                _timestamp(trial.datetime_start),
            )
        )
    return found


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
    fail in exactly one caller; only the trials *this* call failed are re-enqueued
    (Optuna workers with heartbeats run the same check at each trial start and
    handle what they fail with their own ``heartbeat_stale_trial_callback``).
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
        study = optuna.load_study(study_name=study_name, storage=storage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        children = _children(storage.get_all_trials(study_id, deepcopy=False))
        return [
            _fail_and_requeue_one(
                storage,
                study_id,
                study_name,
                number,
                children,
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
            "retries": {"retry_trials": int,    # trials gpuwatchd enqueued as retries
                        "retried_trials": int,  # distinct original trials retried
                        "max_retry": int,       # longest chain (0: none)
                        "by_state": {STATE: int}},
            "trials_per_hour": {"overall": float | None,   # finished / span hours
                                "last_hour": int},         # finished in the last 3600 s
            "first_start_s": float | None, "last_complete_s": float | None,
            "best_value": float | None, "best_trial": int | None}]}

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
    retry_trials = [t for t in trials if ATTR_RETRY in t.user_attrs]
    by_state = dict.fromkeys(STATES, 0)
    for trial in retry_trials:
        by_state[trial.state.name] = by_state.get(trial.state.name, 0) + 1
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
            "retried_trials": len({_lineage(t)[0] for t in retry_trials}),
            "max_retry": max((_lineage(t)[1] for t in retry_trials), default=0),
            "by_state": by_state,
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
