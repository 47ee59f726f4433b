"""The actuator's managed-job backend: what a policy's decision does to a managed job.

:class:`SupervisorActions` carries out ``lower_parallelism``/``raise_parallelism``,
``place_on_idle_gpu``, ``restart_worker`` and ``restart_study`` over the
:class:`~gpuwatchd.jobs.supervisor.Supervisor`, and fails a dead worker's trial at once
(for the crash handler). Specification: docs/managed-jobs.md, "Optuna studies" and "Retries".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gpuwatchd.config import JobConfig
from gpuwatchd.errors import ActionRefused, StudyError
from gpuwatchd.jobs.attribution import killed_from_outside
from gpuwatchd.jobs.ledger import CrashLedger
from gpuwatchd.jobs.records import WorkerCrash, WorkerInfo
from gpuwatchd.jobs.study_recovery import StudyRecovery, describe_requeue
from gpuwatchd.jobs.supervisor import Supervisor
from gpuwatchd.model import Decision

__all__ = ["SupervisorActions", "effective_max_retries"]


class SupervisorActions:
    """The :class:`ManagedJobs` backend over a :class:`~gpuwatchd.jobs.supervisor.Supervisor`.

    ``jobs``: the configured jobs (for their ``optuna:``); ``study``: the
    :class:`StudyRecovery`; ``logger``: structlog-style; ``ledger``: the daemon's
    :class:`~gpuwatchd.jobs.ledger.CrashLedger`. The crash handler passes every
    :class:`~gpuwatchd.jobs.records.WorkerCrash` to :meth:`handle_crash`, which has the
    ledger remember it (a restart decision names the crashed pid; the worker slot and
    trial come from there) and fails the dead trial at once.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        jobs: Sequence[JobConfig],
        study: StudyRecovery,
        logger: Any,
        *,
        ledger: CrashLedger,
    ) -> None:
        self._supervisor = supervisor
        self._jobs = {job.name: job for job in jobs}
        self._study = study
        self._log = logger
        self._ledger = ledger
        self._busy: dict[str, int] = {}

    # -- crashes ------------------------------------------------------------------------

    async def handle_crash(self, crash: WorkerCrash) -> str:
        """Fail the Optuna trial a dead worker left behind; returns what was done (one line).

        A crash (``intentional=False``): the trial the worker ran is marked ``FAIL`` if it
        is still ``RUNNING`` (``max_retries=0``: the retry is the ``restart_study``
        policy's decision, capped by the job's ``optuna.max_retries``). A worker the
        daemon stopped itself (``intentional=True``: ``lower_parallelism`` with ``mode:
        now``, a daemon stop) or one killed from outside (:func:`killed_from_outside`):
        its trial is failed and re-enqueued up to the job's ``optuna.max_retries`` (the
        trial was not at fault; retry reason ``stopped`` or ``killed``). A trial already
        COMPLETE or PRUNED is never touched (:func:`gpuwatchd.jobs.study.fail_and_requeue`).
        When the trial number is unknown, or the trial it
        names had already ended COMPLETE or PRUNED (the worker had started a trial the
        hook had not reported yet), a stale-trial sweep is requested (needs
        ``optuna.grace_period``). Never raises: a storage error is logged and returned.
        """
        self._ledger.remember(crash)
        cfg = self._jobs.get(crash.job)
        if cfg is None or cfg.optuna is None:
            return "no optuna study configured"
        optuna = cfg.optuna
        killed = killed_from_outside(crash)
        reason = "stopped" if crash.intentional else ("killed" if killed else crash.crash_info.kind)
        # Not the trial's fault (stopped by us, or killed from outside): retried up to the
        # job's optuna.max_retries now. A crash of its own: FAIL; its retry is a policy's.
        retries = optuna.max_retries if crash.intentional or killed else 0
        found_trial = False  # found the trial the worker died in
        detail = "trial unknown (the hook had not reported one)"
        if crash.trial_number is not None:
            try:
                (result,) = await self._study.fail_and_requeue(
                    optuna, [crash.trial_number], max_retries=retries, reason=reason
                )
            except (StudyError, ValueError) as exc:
                self._log.error(
                    "cannot fail the crashed worker's trial",
                    job=crash.job,
                    pid=crash.pid,
                    trial=crash.trial_number,
                    error=str(exc),
                )
                return f"study error: {exc}"
            # FAIL: Optuna failed it (the objective raised) or we did; COMPLETE, PRUNED or
            # WAITING: the worker had moved on to a trial the hook had not reported yet.
            found_trial = result.outcome not in ("not_running", "not_found")
            detail = describe_requeue(result, retries)
            outcome: str = result.outcome
            if retries == 0 and result.outcome == "retries_exhausted":
                # Nothing was tried: no "retries exhausted" after zero retries.
                outcome = "failed" if result.failed_now else "was_failed"
                detail = f"trial {result.trial_number}" + (
                    " marked FAIL" if result.failed_now else " is FAIL"
                )
            self._log.info(
                "crashed worker's trial recovered",
                job=crash.job,
                pid=crash.pid,
                worker=crash.worker,
                trial=crash.trial_number,
                outcome=outcome,
                requeued_as=result.requeued_as,
                detail=detail,
            )
        if not found_trial:
            if self._study.request_sweep(crash.job, optuna):
                detail += f"; stale-trial sweep in {optuna.grace_period_s} s"
            elif crash.trial_number is None:
                self._log.warning(
                    "crashed worker's trial unknown and no heartbeats configured; "
                    "a trial may stay RUNNING (set optuna.grace_period)",
                    job=crash.job,
                    pid=crash.pid,
                    worker=crash.worker,
                )
        return detail

    # -- ManagedJobs ----------------------------------------------------------------------

    def busy(self, job: str) -> bool:
        """Whether a parallelism change of ``job`` is in flight (e.g. waiting for a drain)."""
        return self._busy.get(job, 0) > 0

    async def set_parallelism(self, job: str, to: int, mode: str) -> str:
        """``supervisor.set_parallelism(job, to, mode)``; returns ``"parallelism A -> B"``.

        With ``mode="drain"`` it returns once the drained worker's hook has acknowledged
        (its trial finished); raises :class:`~gpuwatchd.errors.SupervisorError` for an
        unknown job or a bad value.
        """
        before = self._supervisor.parallelism(job)
        self._busy[job] = self._busy.get(job, 0) + 1
        try:
            await self._supervisor.set_parallelism(job, to, mode)
        finally:
            self._busy[job] -= 1
        return f"parallelism {before} -> {to} ({mode})"

    async def place_next(self, job: str, gpu_index: int) -> str:
        """``supervisor.place_next(job, gpu_index)``."""
        self._supervisor.place_next(job, gpu_index)
        return f"next worker start of {job} goes to GPU {gpu_index}"

    def _slot(self, decision: Decision) -> tuple[str, int, WorkerCrash | None]:
        params = decision.params
        job = str(params.get("job") or decision.job or "")
        pid = params.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise ActionRefused("the decision names no crashed pid")
        return job, pid, self._ledger.crash_of(job, pid)

    def _relaunch(self, job: str, pid: int, crash: WorkerCrash | None) -> str:
        """Where the crashed worker's relaunch stands; ActionRefused when there is none."""
        if crash is None:
            raise ActionRefused(f"no crash of {job} pid {pid} is known to this daemon")
        slot = next((w for w in self._supervisor.workers(job) if w.worker == crash.worker), None)
        return _relaunch_text(crash, slot)

    async def restart_worker(self, decision: Decision) -> str:
        """Report the relaunch of the crashed worker the decision names (class docstring)."""
        job, pid, crash = self._slot(decision)
        return self._relaunch(job, pid, crash)

    async def restart_study(self, decision: Decision) -> str:
        """Fail and re-enqueue the crashed worker's trial, then as :meth:`restart_worker`.

        The relaunch part never makes the outcome fail: a worker the supervisor will not
        relaunch is named in the detail (``applied`` because the study part was done).
        """
        job, pid, crash = self._slot(decision)
        parts = [await self._requeue(decision, job, crash)]
        try:
            parts.append(self._relaunch(job, pid, crash))
        except ActionRefused as exc:
            parts.append(f"worker not relaunched: {exc.message}")
        return "; ".join(parts)

    async def resume_restart_study(self, decision: Decision) -> str:
        """The study part of a ``restart_study`` a killed daemon left unfinished.

        Its journal outcome is ``unknown``: the trial may or may not have been
        re-enqueued. :func:`gpuwatchd.jobs.study.fail_and_requeue` is idempotent (a retry of
        the trial is looked up before one is enqueued), so running it again finishes the
        decision without repeating it. The worker was relaunched by the supervisor
        meanwhile. Raises StudyError, ValueError or ActionRefused as :meth:`restart_study`.
        """
        job, _pid, crash = self._slot(decision)
        return await self._requeue(decision, job, crash)

    async def _requeue(self, decision: Decision, job: str, crash: WorkerCrash | None) -> str:
        params = decision.params
        trial = params.get("trial_number")
        if not isinstance(trial, int) or isinstance(trial, bool):
            trial = crash.trial_number if crash is not None else None
        cfg = self._jobs.get(job)
        if cfg is None or cfg.optuna is None:
            return "no optuna study configured for the job"
        max_retries = effective_max_retries(cfg.optuna.max_retries, params.get("max_retries"))
        if trial is None:
            swept = self._study.request_sweep(job, cfg.optuna)
            return (
                "trial unknown; stale-trial sweep requested"
                if swept
                else "trial unknown and no optuna.grace_period: nothing failed"
            )
        kind = str(params.get("crash_kind") or "other")
        (result,) = await self._study.fail_and_requeue(
            cfg.optuna, [trial], max_retries=max_retries, reason=kind
        )
        return describe_requeue(result, max_retries)


def effective_max_retries(job_max_retries: int, action_max_retries: object) -> int:
    """The retries a ``restart_study`` decision may make: the job's ``optuna.max_retries``
    caps them; the action's ``max_retries`` (when an integer >= 0) may only lower them
    (docs/managed-jobs.md, "Retries"; ``gpuwatchd check-config`` reports a difference)."""
    if (
        isinstance(action_max_retries, bool)
        or not isinstance(action_max_retries, int)
        or action_max_retries < 0
    ):
        return job_max_retries
    return min(job_max_retries, action_max_retries)


def _relaunch_text(crash: WorkerCrash, slot: WorkerInfo | None) -> str:
    where = f"worker {crash.worker}"
    if slot is None:
        return f"{where} was removed (parallelism lowered): nothing to relaunch"
    if slot.state == "backoff":
        delay = ""
        if slot.next_start_at_s is not None:
            delay = f" at {time.strftime('%H:%M:%S', time.localtime(slot.next_start_at_s))}"
        return f"{where} relaunch scheduled by the supervisor{delay} (restart: backoff)"
    if slot.pid is not None and slot.pid != crash.pid and slot.state in ("running", "draining"):
        gpu = "no GPU" if slot.gpu_index is None else f"GPU {slot.gpu_index}"
        return f"{where} relaunched as pid {slot.pid} on {gpu}"
    if slot.state in ("stopped", "failed"):
        raise ActionRefused(f"{where} is {slot.state}: {slot.note or 'not restarted'}")
    return f"{where} is {slot.state}"
