"""The shapes that leave the supervisor: a worker as shown, a worker's end, a trial holder.

:class:`WorkerInfo` (``gpuwatchctl jobs``), :class:`WorkerCrash` (the supervisor's crash
event, kept by the crash ledger) and :class:`TrialHolder` (the orphan sweep) cross the
package's modules; the supervisor's own state is :class:`~gpuwatchd.jobs.job.Job` and
:class:`~gpuwatchd.jobs.worker.Worker`.

Events: the supervisor calls nothing back when a worker dies. It puts a
:class:`WorkerCrash` in its outbox (:meth:`~gpuwatchd.jobs.supervisor.Supervisor.take_crashes`);
the daemon's tick takes them and hands each to its crash handler
(:meth:`~gpuwatchd.jobs.crashes.CrashHandler.handle`), which fails the dead trials and
posts the ``crash`` job event the policy engine sees at the next tick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuwatchd.crash import CrashInfo
from gpuwatchd.model import JobEvent
from gpuwatchd.xid import XidEvent, summary

if TYPE_CHECKING:
    pass

__all__ = [
    "TrialHolder",
    "WorkerCrash",
    "WorkerInfo",
]


@dataclass(frozen=True, slots=True)
class TrialHolder:
    """A worker launch that may hold RUNNING trials of its job's study: its process runs,
    or its end is still being handled.

    ``worker_id``: the launch's ``GPUWATCHD_WORKER_ID`` (the trials it tagged);
    ``started_s``: when its process started (POSIX seconds, from ``/proc``; ``None``
    unknown: it may hold any untagged trial)."""

    worker_id: str | None
    started_s: float | None


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker slot of a managed job, as ``gpuwatchctl jobs`` shows it.

    ``worker`` is the slot number (``GPUWATCHD_WORKER``, file names); ``pid`` is ``None``
    when no process runs. ``gpu_index`` is the NVML index given in
    ``CUDA_VISIBLE_DEVICES`` (``None``: no GPU). ``state``: one of
    :data:`WORKER_STATES`. ``restarts`` counts every start after the first.
    ``started_at_s`` and ``next_start_at_s`` are on the supervisor's clock. ``adopted``: the
    process was started by an earlier daemon and is watched by polling ``/proc``.
    ``note`` says why a worker is stopped or failed. ``worker_id``: the current (or last)
    launch's ``GPUWATCHD_WORKER_ID``, the value of its trials' ``gpuwatchd:worker_id``.
    ``held``: why the slot stays down across daemon restarts (``"finished"``, ``"stopped
    by an operator"``), ``None`` when it is not held. ``given_up``: the supervisor will
    not start it again by itself (crash loop, environment failure, restart budget) until
    an operator does (``gpuwatchctl job start``): the ``worker_given_up`` finding.
    """

    job: str
    worker: int
    pid: int | None
    gpu_index: int | None
    state: str
    restarts: int
    last_crash_kind: str | None
    started_at_s: float | None
    placement_reason: str = ""
    adopted: bool = False
    exit_code: int | None = None
    next_start_at_s: float | None = None
    trial_number: int | None = None
    last_crash_reason: str | None = None
    note: str = ""
    worker_id: str | None = None
    held: str | None = None
    given_up: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (keys as the field names)."""
        return {
            "job": self.job,
            "worker": self.worker,
            "pid": self.pid,
            "gpu": self.gpu_index,
            "state": self.state,
            "restarts": self.restarts,
            "last_crash_kind": self.last_crash_kind,
            "last_crash_reason": self.last_crash_reason,
            "started_at_s": self.started_at_s,
            "next_start_at_s": self.next_start_at_s,
            "placement_reason": self.placement_reason,
            "adopted": self.adopted,
            "exit_code": self.exit_code,
            "trial_number": self.trial_number,
            "note": self.note,
            "worker_id": self.worker_id,
            "held": self.held,
            "given_up": self.given_up,
        }


@dataclass(frozen=True, slots=True)
class WorkerCrash:
    """The supervisor's crash event: a worker process that ended without a clean exit.

    Emitted by the supervisor (written into the crash ledger first), taken by the
    daemon's tick (:meth:`~gpuwatchd.jobs.supervisor.Supervisor.take_crashes`) and
    handled by :class:`~gpuwatchd.jobs.crashes.CrashHandler`.

    ``crash_info`` is :func:`gpuwatchd.crash.classify`'s verdict. ``trial_number`` is the
    Optuna trial the worker was running as far as the supervisor was told
    (:meth:`Supervisor.note_trial` / :meth:`Supervisor.observe`), else ``None``.
    ``intentional``: the supervisor itself stopped the process (``set_parallelism(...,
    "now")``, ``restart_worker``, ``stop``); the trial it ran was still cut short, so an
    Optuna recovery must fail it, but it is not a crash for the ``job_crashed`` detector.
    ``returncode`` is ``None`` and ``uptime_s`` may be ``None`` for a worker that ended
    while no daemon was watching (found at start-up). ``worker_id`` is the launch's
    ``GPUWATCHD_WORKER_ID`` (unique per process start; the Optuna hook writes it into the
    ``gpuwatchd:worker_id`` user attr of each trial it runs), ``None`` when unknown.
    ``xid_events``: the NVML Xid errors on the worker's GPU around the crash (see
    :meth:`gpuwatchd.xid.XidLog.near`), empty where the driver reported none.
    """

    job: str
    worker: int
    pid: int
    gpu_index: int | None
    crash_info: CrashInfo
    trial_number: int | None
    stderr_tail: str
    timestamp_s: float
    returncode: int | None
    uptime_s: float | None
    intentional: bool = False
    worker_id: str | None = None
    xid_events: tuple[XidEvent, ...] = ()

    def to_event(self) -> JobEvent:
        """The :class:`~gpuwatchd.model.JobEvent` (``kind="crash"``) for the next snapshot.

        Its message is the classification's reason, with the Xids around the crash
        appended in brackets (``"... [Xid 31 on GPU 0: GPU memory page fault]"``).
        """
        message = self.crash_info.reason
        if self.xid_events:
            message = f"{message} [{summary(self.xid_events)}]"
        return JobEvent(
            timestamp_s=self.timestamp_s,
            job=self.job,
            kind="crash",
            pid=self.pid,
            crash_kind=self.crash_info.kind,
            trial_number=self.trial_number,
            gpu_index=self.gpu_index,
            message=message,
        )

