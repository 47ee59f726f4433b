"""No trial left RUNNING: the study reconciled with the workers that can hold its trials.

A trial stays RUNNING in the storage when its process died without Optuna's ``tell``:
killed with the daemon, or between Optuna's ``ask`` and the hook's tag. For a job whose
workers are the study's only runners (``optuna.exclusive``, the default), a RUNNING trial
that no live worker of this host can hold is an orphan: failed and re-enqueued with the
job's ``optuna.max_retries``. Specification: docs/managed-jobs.md, "No trial left RUNNING".
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
import time
import zoneinfo
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.config import JobConfig, OptunaConfig
from gpuwatchd.jobs.ledger import CrashLedger
from gpuwatchd.jobs.records import TrialHolder
from gpuwatchd.jobs.study_recovery import StudyRecovery, describe_requeue
from gpuwatchd.jobs.supervisor import Supervisor

if TYPE_CHECKING:  # pragma: no cover - typing only; optuna is imported lazily
    from gpuwatchd.jobs.study import RequeueResult, RunningTrial

__all__ = [
    "JOB_FINISHED",
    "ORPHANED",
    "SWEEP_INTERVAL_S",
    "OrphanSweeper",
    "WorkersTimeZone",
    "find_orphans",
    "workers_time_zone",
]

ORPHANED: Final = "orphaned"
"""Retry reason (``gpuwatchd:retry_reason``) of a trial failed by the orphan sweep."""
JOB_FINISHED: Final = "job finished before the retry ran"
"""``gpuwatchd:failed_reason`` of a retry left WAITING when every worker of its job had
exited 0 (the study's own stop rule ended it while the retry was being enqueued)."""
SWEEP_INTERVAL_S: Final = 10.0
"""How often each exclusive job's study is reconciled (seconds; one read of its trials,
a write only for an orphan)."""
RECHECK_S: Final = 2.0
"""How soon a sweep that found unheld trials looks again to confirm them (seconds): a
trial is failed only when two sweeps this far apart find it unheld. Also how soon a sweep
put off because a worker was being started looks again: an orphan's retry must be
enqueued before the new workers have asked all their trials, or it never runs."""


@dataclasses.dataclass(frozen=True)
class WorkersTimeZone:
    """The time zone the workers of a study run in, to read Optuna's naive
    ``datetime_start``: ``known`` False when it cannot be told (jobs that differ, a
    ``TZ`` that is no IANA name); else ``tz``, None for the daemon's own zone."""

    known: bool
    tz: datetime.tzinfo | None = None


def workers_time_zone(
    jobs: Sequence[JobConfig], environ: Mapping[str, str] | None = None
) -> WorkersTimeZone:
    """The time zone of ``jobs``' workers: each job's ``env: TZ``, else the daemon's
    ``TZ`` (``environ``, default ``os.environ``), which a worker inherits.

    The same ``TZ`` as the daemon's is the daemon's own zone. Another is read as an IANA
    name (``Asia/Tokyo``; a leading ``:`` dropped, ``""`` is UTC as glibc reads it) with
    :mod:`zoneinfo`; a POSIX rule string (``EST5EDT``) or an unknown name is not known.
    """
    base = os.environ if environ is None else environ
    values = {job.env.get("TZ", base.get("TZ")) for job in jobs}
    if len(values) != 1:
        return WorkersTimeZone(False)
    (value,) = values
    if value is None or value == base.get("TZ"):
        return WorkersTimeZone(True, None)
    name = value.removeprefix(":") or "UTC"
    try:
        return WorkersTimeZone(True, zoneinfo.ZoneInfo(name))
    except (ValueError, OSError, zoneinfo.ZoneInfoNotFoundError):
        return WorkersTimeZone(False)


def find_orphans(running: Sequence[RunningTrial], holders: Sequence[TrialHolder]) -> list[int]:
    """Pure: the numbers of the ``running`` trials that none of ``holders`` can hold.

    A trial tagged with a worker launch id is held only by that launch. An untagged one
    (asked, not yet tagged; or a worker without the hook) may be held by any launch that
    started before it: it is an orphan only when every holder started after it (or there
    is none). A holder of unknown start may hold any untagged trial; a trial of unknown
    start is never an orphan unless tagged.
    """
    tags = {h.worker_id for h in holders if h.worker_id is not None}
    starts = [h.started_s for h in holders]
    orphans: list[int] = []
    for trial in running:
        if trial.worker_id is not None:
            if trial.worker_id not in tags:
                orphans.append(trial.number)
            continue
        if trial.started_s is None or any(s is None for s in starts):
            continue
        if all(s is not None and s > trial.started_s for s in starts):
            orphans.append(trial.number)
    return orphans


class OrphanSweeper:
    """Reconciles each exclusive Optuna job's study with the supervisor's live workers.

    ``supervisor``: the daemon's :class:`~gpuwatchd.jobs.supervisor.Supervisor` (which
    launches can hold trials); ``ledger``: the daemon's crash ledger (a launch whose end
    is being handled still holds its trials); ``jobs``: the configured jobs (only those with
    ``optuna.exclusive`` are swept; jobs sharing one study are swept together);
    ``study``: the :class:`StudyRecovery` (storage work off the loop, one at a time per
    storage); ``logger``: structlog-style; ``clock``: monotonic seconds (intervals only).
    The daemon's tick calls :meth:`due`, then :meth:`sweep` as a task.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        jobs: Sequence[JobConfig],
        study: StudyRecovery,
        logger: Any,
        *,
        ledger: CrashLedger | None = None,
        interval_s: float = SWEEP_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._supervisor = supervisor
        self._ledger = ledger
        self._study = study
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        groups: dict[tuple[str, str], list[JobConfig]] = {}
        for job in jobs:
            if job.optuna is not None and job.optuna.exclusive:
                groups.setdefault((job.optuna.storage, job.optuna.study), []).append(job)
        self._groups: Mapping[tuple[str, str], list[JobConfig]] = groups
        self._next_at = 0.0
        self._running = False
        self._suspects: dict[tuple[str, str], set[int]] = {}
        """Per study: the trials the last sweep found unheld (one more sweep confirms)."""
        self._put_off = False
        """Whether the last sweep skipped a study with RUNNING trials because a worker
        was being started (:meth:`Supervisor.trial_holders` None): look again soon."""

    def due(self, now_mono_s: float | None = None) -> bool:
        """Whether a sweep is due (every ``interval_s``) and none runs now."""
        now = self._clock() if now_mono_s is None else now_mono_s
        return bool(self._groups) and not self._running and now >= self._next_at

    async def sweep(self) -> list[RequeueResult]:
        """Sweep every exclusive study once; the trials failed (one result each). Never
        raises: a storage error is logged and that study skipped until the next sweep."""
        self._running = True
        self._next_at = self._clock() + self._interval_s
        results: list[RequeueResult] = []
        self._put_off = False
        try:
            for jobs in self._groups.values():
                results += await self._sweep_one(jobs)
        finally:
            self._running = False
        if self._put_off or any(self._suspects.values()):
            self._next_at = min(self._next_at, self._clock() + RECHECK_S)
        return results

    async def sweep_before_start(self) -> list[RequeueResult]:
        """The sweep at the daemon's start, before replacement workers start: one sweep,
        and when it finds trials unheld, a second :data:`RECHECK_S` later that confirms
        and fails them (the same rule as every sweep). Adds at most ``RECHECK_S`` to the
        start, only when a study has RUNNING trials no live worker holds. Returns the
        trials failed; never raises (as :meth:`sweep`)."""
        results = await self.sweep()
        if any(self._suspects.values()):
            await asyncio.sleep(RECHECK_S)
            results += await self.sweep()
        return results

    async def _abandon_if_finished(self, optuna: OptunaConfig, names: list[str]) -> None:
        """When every worker of ``names`` exited 0 and none runs or waits to restart,
        fail the retries left WAITING (:func:`gpuwatchd.jobs.study.abandon_waiting_retries`):
        no worker will pop them. Logged ``study.retry_abandoned``."""
        states = {s.job: s for s in self._supervisor.job_states()}
        done = [states.get(name) for name in names]
        if not all(
            s is not None and s.slots and s.live == 0 and s.finished == s.slots for s in done
        ):
            return
        try:
            abandoned = await self._study.abandon_waiting_retries(optuna, JOB_FINISHED)
        except Exception as exc:
            self._log.error(
                "study.orphan_sweep_failed", jobs=names, error=f"{type(exc).__name__}: {exc}"
            )
            return
        for number in abandoned:
            self._log.warning(
                "study.retry_abandoned", jobs=names, trial=number, reason=JOB_FINISHED
            )

    async def _sweep_one(self, jobs: Sequence[JobConfig]) -> list[RequeueResult]:
        first = jobs[0]
        optuna = first.optuna
        assert optuna is not None
        names = [job.name for job in jobs]
        await self._abandon_if_finished(optuna, names)
        zone = workers_time_zone(jobs)
        try:
            running = await self._study.running_trials(optuna, zone.tz)
        except Exception as exc:
            self._log.error(
                "study.orphan_sweep_failed",
                jobs=names,
                error=f"{type(exc).__name__}: {exc}",
            )
            return []
        if not running:
            return []
        if not zone.known:  # a start that cannot be read holds: only tagged trials judged
            running = [dataclasses.replace(t, started_s=None) for t in running]
        # Read after the storage: any process that asked one of these trials was started
        # (or being started) by then. Every managed job's workers are holders (a study
        # may be named by jobs whose storage strings differ).
        holders = self._supervisor.trial_holders(self._supervisor.job_names)
        if holders is None:  # a worker is being started: again in RECHECK_S
            self._put_off = True
            return []
        if self._ledger is not None:  # ends the supervisor reported, not handled yet
            holders += self._ledger.holders()
        key = (optuna.storage, optuna.study)
        unheld = find_orphans(running, holders)
        # Unheld on two sweeps in a row: a clock step or a start that was being read
        # does not fail a live worker's trial.
        orphans = [n for n in unheld if n in self._suspects.get(key, set())]
        self._suspects[key] = set(unheld)
        if not orphans:
            return []
        retries = min(job.optuna.max_retries for job in jobs if job.optuna is not None)
        try:
            results = await self._study.fail_and_requeue(
                optuna, orphans, max_retries=retries, reason=ORPHANED
            )
        except Exception as exc:
            self._log.error(
                "study.orphan_sweep_failed",
                jobs=names,
                trials=orphans,
                error=f"{type(exc).__name__}: {exc}",
            )
            return []
        for result in results:
            self._log.warning(
                "study.trial_orphaned",
                jobs=names,
                trial=result.trial_number,
                outcome=result.outcome,
                requeued_as=result.requeued_as,
                detail=describe_requeue(result, retries),
            )
        return results
