"""The supervisor's records: worker slots and jobs as held in memory, and as shown.

:class:`WorkerInfo` (``gpuwatchctl jobs``) and :class:`WorkerCrash` (``on_crash``) cross
the package boundary; :class:`WorkerSlot` and :class:`ManagedJob` are the supervisor's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.config import JobConfig
from gpuwatchd.crash import CrashInfo
from gpuwatchd.errors import SupervisorError
from gpuwatchd.jobs.output import OutputFiles, StderrTail
from gpuwatchd.jobs.procfs import OomCounter
from gpuwatchd.jobs.worker import STATE_TRANSITIONS, Intent, WorkerState
from gpuwatchd.model import JobEvent
from gpuwatchd.restart import RestartPolicy
from gpuwatchd.xid import XidEvent, summary

if TYPE_CHECKING:
    import subprocess

__all__ = [
    "LIVE",
    "WORKER_STATES",
    "DrainWorker",
    "ManagedJob",
    "OnCrash",
    "TrialHolder",
    "WorkerCrash",
    "WorkerInfo",
    "WorkerSlot",
    "WorkerState",
]

#: Worker states as ``workers()`` and ``status()`` show them.
WORKER_STATES: Final[tuple[str, ...]] = (
    "running",  # the process is alive
    "backoff",  # crashed; waiting for its restart delay
    "draining",  # asked to finish its trial and exit (``drain`` over the socket)
    "stopping",  # SIGTERM sent, waiting up to restart.stop_timeout before SIGKILL
    "stopped",  # not running and not restarted: exited cleanly, budget spent, or stopped
    "failed",  # crash loop: died right after start restart.crash_loop times in a row
)


LIVE: Final = frozenset({"running", "draining", "stopping"})
"""States in which the slot's process runs."""


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
    """A worker process that ended without a clean exit, for ``on_crash``.

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


@dataclass(slots=True)
class WorkerSlot:
    """One worker slot as the supervisor holds it (mutable; the event loop's only).

    ``state`` is set when the slot is made and changed only by :meth:`to`, checked
    against :data:`~gpuwatchd.jobs.worker.STATE_TRANSITIONS`; assigning it raises
    :class:`AttributeError`.
    """

    number: int
    state: WorkerState = "stopped"
    pid: int | None = None
    start_ticks: int | None = None
    gpu: int | None = None
    placement_reason: str = ""
    started_at_s: float | None = None
    started_mono: float | None = None
    restarts: int = 0
    streak: int = 0
    stalled_streak: int = 0
    """Consecutive deaths of this slot's launches that made no progress (crash loop)."""
    last_crash: CrashInfo | None = None
    exit_code: int | None = None
    adopted: bool = False
    intent: Intent | None = None
    remove_after: bool = False
    exiting: bool = False
    pin_gpu: int | None = None
    next_start_at_s: float | None = None
    trial_number: int | None = None
    last_exception: str | None = None
    note: str = ""
    worker_id: str | None = None
    stderr_offset: int | None = None
    """Size of ``worker-<n>.err`` when this launch started: its output begins there."""
    host_oom_kills: int | None = None
    """``/proc/vmstat``'s ``oom_kill`` when this launch started (kept in workers.json)."""
    given_up: bool = False
    """The supervisor will not start this slot again by itself (crash loop, environment
    failure at start, restart budget spent) until an operator acts."""
    progressed: bool = False
    """Whether this launch made progress: its hook spoke to the daemon, or one of its
    trials finished (a death after progress does not count toward ``crash_loop``)."""
    held: str | None = None
    """Why the slot stays down across daemon restarts (``"finished"``: its process exited
    with status 0; ``"stopped by an operator"``), ``None``: it is started again."""
    oom: OomCounter | None = None
    unit: str | None = None
    """The transient unit running this slot's process (systemd launcher), else ``None``."""
    unit_result: str = ""
    """systemd's ``Result`` of the unit's last run (``oom-kill``, ``exit-code``, ...)."""
    popen: subprocess.Popen[bytes] | None = None
    files: OutputFiles | None = None
    tail: StderrTail | None = None
    task: asyncio.Task[None] | None = None
    done: asyncio.Future[None] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and _has_state(self):
            raise AttributeError("WorkerSlot.state changes only through WorkerSlot.to()")
        object.__setattr__(self, name, value)

    def to(self, new_state: WorkerState, note: str | None = None) -> None:
        """Move to ``new_state`` (and set ``note`` unless None).

        Raises :class:`~gpuwatchd.errors.SupervisorError` (``internal``) for a change
        :data:`~gpuwatchd.jobs.worker.STATE_TRANSITIONS` does not allow: a bug,
        never a user's input.
        """
        if new_state not in STATE_TRANSITIONS.get(self.state, frozenset()):
            raise SupervisorError(
                f"worker {self.number}: no transition {self.state} -> {new_state}",
                code="internal",
            )
        object.__setattr__(self, "state", new_state)
        if note is not None:
            self.note = note


def _has_state(slot: WorkerSlot) -> bool:
    try:
        object.__getattribute__(slot, "state")
    except AttributeError:
        return False  # being constructed
    return True


@dataclass(slots=True)
class ManagedJob:
    """One managed job: its settings, its slots and its restart history."""

    cfg: JobConfig
    policy: RestartPolicy
    directory: Path
    allowed_gpus: tuple[int, ...] | None
    popen_user: dict[str, Any]
    user_env: dict[str, str]
    parallelism: int
    workers: dict[int, WorkerSlot] = field(default_factory=dict)
    restart_times_s: list[float] = field(default_factory=list)
    place_next: int | None = None
    launching: int = 0
    """Slots of this job being started now (a process may run before its pid is known)."""
    hooked: bool = False
    """Whether a worker of this job spoke to the daemon through the hook in this daemon's
    run (then a launch without progress is stalled, however long it ran)."""
    fingerprint: str = ""
    """The job configuration's digest (:func:`gpuwatchd.jobs.workers_file.fingerprint`):
    held slots recorded under another configuration are started again."""


OnCrash = Callable[[WorkerCrash], Awaitable[None] | None]
DrainWorker = Callable[[str, int], Awaitable[bool]]
