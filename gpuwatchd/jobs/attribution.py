"""Which Optuna trial a worker was running: the one answer for the crash path.

Three sources, in order: what the worker's hook said last (its ``trial`` events and the
trial number of its reports), the study itself (trials carry the worker's launch id in
the ``gpuwatchd:worker_id`` user attr), and what the supervisor or the crash ledger
recorded (``WorkerCrash.trial_number``) when neither says anything.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final, TypeVar

from gpuwatchd.config import JobConfig
from gpuwatchd.jobs.records import WorkerCrash
from gpuwatchd.jobs.study_recovery import StudyRecovery, describe_requeue
from gpuwatchd.model import JobEvent, JobInfo

__all__ = ["KILLED_WITH_WORKER", "TRIALS_KEPT", "TrialAttribution", "killed_from_outside"]

KILLED_WITH_WORKER: Final = "killed_with_worker"
"""Retry reason (``gpuwatchd:retry_reason``) of a trial that died with its process while
another trial of the same process (``n_jobs > 1``) hit the error."""

_V = TypeVar("_V")
TRIALS_KEPT: Final = 4096
"""Worker pids whose latest trial is remembered (oldest forgotten first)."""


def _remember(by_pid: OrderedDict[int, _V], pid: int, value: _V) -> None:
    """Set ``by_pid[pid]`` as the newest entry; forget the oldest beyond :data:`TRIALS_KEPT`."""
    by_pid[pid] = value
    by_pid.move_to_end(pid)
    while len(by_pid) > TRIALS_KEPT:
        by_pid.popitem(last=False)


class TrialAttribution:
    """Tracks the trial each worker pid runs; answers it for a :class:`WorkerCrash`.

    ``jobs``: the configured jobs (their ``optuna:``); ``study``: the
    :class:`~gpuwatchd.jobs.study_recovery.StudyRecovery` for storage lookups;
    ``logger``: structlog-style.
    """

    def __init__(self, jobs: Sequence[JobConfig], study: StudyRecovery, logger: Any) -> None:
        self._jobs = {job.name: job for job in jobs}
        self._study = study
        self._log = logger
        self._trials: OrderedDict[int, tuple[int, str]] = OrderedDict()
        """Worker pid -> (trial number, "running" | "ended:<TrialState>"), latest word."""
        self._session_trials: dict[int, int] = {}

    # -- the hook's word ---------------------------------------------------------------

    def note_event(self, event: JobEvent) -> bool:
        """Take a hook event's word; True when the event is a ``detach`` (consumed here:
        the end of an ``attach`` block, not of the process, and no detector reads it).

        A ``trial`` event notes the trial the pid ended.
        """
        if event.pid is None:
            return False
        if event.kind == "detach":
            return True
        if event.kind == "trial" and event.trial_number is not None:
            self._note(event.pid, event.trial_number, f"ended:{event.trial_state}")
        return False

    def observe(self, jobs: Sequence[JobInfo]) -> None:
        """Note each attached job's running trial when its hook reports a new one."""
        for job in jobs:
            if job.trial_number is None:
                continue
            if self._session_trials.get(job.pid) != job.trial_number:
                self._session_trials[job.pid] = job.trial_number
                self._note(job.pid, job.trial_number, "running")
        if len(self._session_trials) > TRIALS_KEPT:
            live = {job.pid for job in jobs}
            self._session_trials = {p: n for p, n in self._session_trials.items() if p in live}

    def _note(self, pid: int, number: int, what: str) -> None:
        _remember(self._trials, pid, (number, what))

    def from_hook(self, crash: WorkerCrash) -> int | None:
        """The trial ``crash``'s worker died in, from what its hook said last.

        A trial it reported running, or one it reported ending ``FAIL`` (Optuna fails the
        trial whose objective raised, and the hook reports that before the process dies),
        is the crashed trial; after a COMPLETE or PRUNED trial the worker had started one
        the hook had not reported yet: unknown (None; the stale-trial sweep finds it).
        Without any word from the hook (e.g. a worker adopted after a restart), the
        supervisor's (or the ledger's) ``crash.trial_number``.
        """
        seen = self._trials.get(crash.pid)
        if seen is None:
            return crash.trial_number
        number, what = seen
        return number if what in ("running", "ended:FAIL") else None

    # -- the study's word --------------------------------------------------------------

    async def from_study(self, crash: WorkerCrash) -> WorkerCrash:
        """``crash`` with the trial its worker died in, as the Optuna storage tells it.

        The worker's trials carry its launch id (``gpuwatchd:worker_id``, written by the
        hook): :func:`gpuwatchd.jobs.study.trials_of_worker` names the trials it died with
        even when no daemon heard the worker, where the hook's last word or
        ``workers.json`` may name an older trial. The one that hit the error
        (:attr:`~gpuwatchd.jobs.study.WorkerTrials.crashed`) becomes ``trial_number``; every
        other RUNNING trial of the same process (``n_jobs > 1``) died with it through no
        fault of its own: failed here and re-enqueued with the job's
        ``optuna.max_retries``, reason ``killed_with_worker``. When the storage names no
        trial of the worker, or cannot be read (logged), ``crash`` is returned unchanged.
        Never raises.
        """
        cfg = self._jobs.get(crash.job)
        if cfg is None or cfg.optuna is None or crash.worker_id is None:
            return crash
        optuna = cfg.optuna
        try:
            found = await self._study.trials_of_worker(optuna, crash.worker_id)
        except Exception as exc:  # never lose the crash over a lookup
            self._log.error(
                "cannot read the crashed worker's trials",
                job=crash.job,
                pid=crash.pid,
                worker_id=crash.worker_id,
                error=f"{type(exc).__name__}: {exc}",
            )
            return crash
        if found is None or found.crashed is None:
            # None: no trial names the worker; else its trials all ended. Either way the
            # hook's word stands (its set_user_attr may have failed; a finished trial is
            # left alone by the recovery, and the orphan sweep finds an untagged one).
            return crash
        trial = found.crashed
        if crash.trial_number in found.running and found.failed is None:
            trial = crash.trial_number  # the hook named the one it was in
        if trial != crash.trial_number:
            self._log.info(
                "crashed trial from the study",
                job=crash.job,
                pid=crash.pid,
                worker_id=crash.worker_id,
                trial=trial,
                previous=crash.trial_number,
            )
        others = tuple(n for n in found.running if n != trial)
        if others:
            await self._fail_others(crash, others)
        return dataclasses.replace(crash, trial_number=trial)

    async def _fail_others(self, crash: WorkerCrash, trials: Sequence[int]) -> None:
        """Fail and re-enqueue (the job's ``optuna.max_retries``) the trials that died with
        ``crash``'s process besides the one that crashed: not their fault."""
        cfg = self._jobs[crash.job]
        assert cfg.optuna is not None
        retries = cfg.optuna.max_retries
        try:
            results = await self._study.fail_and_requeue(
                cfg.optuna, trials, max_retries=retries, reason=KILLED_WITH_WORKER
            )
        except Exception as exc:
            self._log.error(
                "cannot fail the crashed worker's other trials",
                job=crash.job,
                pid=crash.pid,
                error=f"{type(exc).__name__}: {exc}",
            )
            return
        for result in results:
            self._log.info(
                "crashed worker's other trial recovered",
                job=crash.job,
                pid=crash.pid,
                trial=result.trial_number,
                reason=KILLED_WITH_WORKER,
                detail=describe_requeue(result, retries),
            )


_OUTSIDE_SIGNALS: Final = frozenset({"SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"})


def killed_from_outside(crash: WorkerCrash) -> bool:
    """Whether a worker died of a signal someone sent it (``kill -9``, a scheduler's
    SIGTERM), not of its trial: kind ``other`` with no error printed by its launch, and
    a terminating signal, or an unknown status (an adopted worker: no status to read, no
    clean detach, no OOM kill counted, nothing printed)."""
    info = crash.crash_info
    unknown = info.signal is None and info.exit_code is None
    return (
        not crash.intentional
        and info.kind == "other"
        and (info.signal in _OUTSIDE_SIGNALS or unknown)
        and not info.evidence
    )
