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
from gpuwatchd.hpo.study_recovery import StudyRecovery, describe_requeue
from gpuwatchd.model import JobEvent, JobInfo
from gpuwatchd.supervisor import WorkerCrash

__all__ = ["TRIALS_KEPT", "TrialAttribution", "killed_from_outside"]

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
    :class:`~gpuwatchd.hpo.study_recovery.StudyRecovery` for storage lookups;
    ``logger``: structlog-style. Also keeps each pid's hook ``detach`` (daemon clock
    seconds) for the supervisor's exit hint.
    """

    def __init__(self, jobs: Sequence[JobConfig], study: StudyRecovery, logger: Any) -> None:
        self._jobs = {job.name: job for job in jobs}
        self._study = study
        self._log = logger
        self._trials: OrderedDict[int, tuple[int, str]] = OrderedDict()
        """Worker pid -> (trial number, "running" | "ended:<TrialState>"), latest word."""
        self._detached: OrderedDict[int, float] = OrderedDict()
        self._session_trials: dict[int, int] = {}

    # -- the hook's word ---------------------------------------------------------------

    def note_event(self, event: JobEvent) -> bool:
        """Take a hook event's word; True when the event is a ``detach`` (kept here only).

        A ``trial`` event notes the trial the pid ended; any event but ``detach`` says the
        process went on after a ``detach`` it sent earlier.
        """
        if event.pid is None:
            return False
        if event.kind == "detach":  # for the exit hint only; no detector reads it
            _remember(self._detached, event.pid, event.timestamp_s)
            return True
        self._detached.pop(event.pid, None)
        if event.kind == "trial" and event.trial_number is not None:
            self._note(event.pid, event.trial_number, f"ended:{event.trial_state}")
        return False

    def observe(self, jobs: Sequence[JobInfo]) -> None:
        """Note each attached job's running trial when its hook reports a new one (and
        forget the ``detach`` of a process that attached again since)."""
        for job in jobs:
            detached_at = self._detached.get(job.pid)
            if detached_at is not None and job.connected_at_s > detached_at:
                del self._detached[job.pid]
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

    def has_detach(self, pid: int) -> bool:
        """Whether ``pid``'s hook sent a ``detach`` not yet taken."""
        return pid in self._detached

    def take_detach(self, pid: int) -> float | None:
        """When ``pid``'s hook said ``detach`` (daemon clock, seconds), forgetting it; or None."""
        return self._detached.pop(pid, None)

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
        hook): :func:`gpuwatchd.study.trials_of_worker` names the trial it died in even
        when no daemon heard the worker, where the hook's last word or ``workers.json``
        may name an older trial. The newest such trial becomes ``trial_number``; any
        other RUNNING trial of the same worker (``n_jobs > 1``) is marked FAIL here
        (re-enqueued with the job's ``optuna.max_retries`` only when the daemon stopped
        the worker itself). When the storage names no open trial of the worker, or cannot
        be read (logged), ``crash`` is returned unchanged. Never raises.
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
        if not found:
            # None: no trial names the worker; (): its trials all ended. Either way the
            # hook's word stands (its set_user_attr may have failed; a finished trial is
            # left alone by the recovery, which then asks for a stale-trial sweep).
            return crash
        trial = found[-1]
        if trial != crash.trial_number:
            self._log.info(
                "crashed trial from the study",
                job=crash.job,
                pid=crash.pid,
                worker_id=crash.worker_id,
                trial=trial,
                previous=crash.trial_number,
            )
        if len(found) > 1:
            await self._fail_others(crash, found[:-1])
        return dataclasses.replace(crash, trial_number=trial)

    async def ended_between_trials(self, job: str, worker_id: str) -> bool:
        """Whether the study says worker launch ``worker_id`` of ``job`` ended between
        trials: its newest trial COMPLETE or PRUNED, none RUNNING
        (:func:`gpuwatchd.study.trials_of_worker` returns ``()``). False with no study,
        no trial of it, a trial left RUNNING or FAIL, or the storage unreadable (logged).
        Never raises."""
        cfg = self._jobs.get(job)
        if cfg is None or cfg.optuna is None:
            return False
        try:
            return await self._study.trials_of_worker(cfg.optuna, worker_id) == ()
        except Exception as exc:  # unknown stays unknown: a crash, as before
            self._log.error(
                "cannot read the crashed worker's trials",
                job=job,
                worker_id=worker_id,
                error=f"{type(exc).__name__}: {exc}",
            )
            return False

    async def _fail_others(self, crash: WorkerCrash, trials: Sequence[int]) -> None:
        cfg = self._jobs[crash.job]
        assert cfg.optuna is not None
        killed = killed_from_outside(crash)
        reason = "stopped" if crash.intentional else ("killed" if killed else crash.crash_info.kind)
        retries = cfg.optuna.max_retries if crash.intentional or killed else 0
        try:
            results = await self._study.fail_and_requeue(
                cfg.optuna, trials, max_retries=retries, reason=reason
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
