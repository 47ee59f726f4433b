"""The job half of protocol v1 on the server side: a job's session (``hello``), what its
``report``, ``event`` and knob replies change, and the rate limit on its events. No
sockets; the caller gives the peer, the time and the logger."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gpuwatchd.control.knobmemory import JOB, KnobMemory
from gpuwatchd.control.messages import (
    KNOB_NAME_MAX_CHARS,
    DroppedKnob,
    Hello,
    KnobApplied,
    ReportUpdate,
    parse_event,
    parse_hello,
    parse_report,
    parse_set_knob_result,
)
from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import ErrorCode, Reply
from gpuwatchd.errors import ProtocolError
from gpuwatchd.model import (
    CgroupIdentity,
    JobEvent,
    JobInfo,
    JobReport,
    Knob,
    KnobValue,
    SlurmJob,
)

__all__ = ["EVENTS_PER_S", "Connection", "EventBucket", "JobSession", "open_session"]

EVENTS_PER_S: Final = 10.0
"""Job ``event`` messages one connection may send per second (burst of the same size);
beyond that they are refused, so one job cannot flood the tick's queue or the log."""


@dataclass
class JobSession:
    """A connection's job after a valid ``hello``; ``session`` numbers attaches from 1;
    ``uid``: the connection's peer uid (``SO_PEERCRED``)."""

    session: int
    name: str
    pid: int
    connected_at_s: float
    cuda_devices: tuple[str, ...]
    knobs: dict[str, Knob]
    study: str | None
    trial_number: int | None
    last_report: JobReport | None = None
    slurm: SlurmJob | None = None
    dropped_knobs: tuple[DroppedKnob, ...] = ()
    """Knobs the ``hello`` declared that were left out, with the reason (its reply says so)."""
    uid: int | None = None
    cgroup: CgroupIdentity | None = None
    """The process's systemd unit and Kubernetes pod (its cgroup path), read at hello."""
    info_kept: JobInfo | None = field(default=None, repr=False, compare=False)
    """:meth:`info`'s last answer; None once a report, a trial or a knob changed the
    session (the methods below that change them clear it)."""

    @classmethod
    def attach(
        cls,
        hello: Hello,
        session: int,
        now_s: float,
        uid: int | None = None,
        cgroup: CgroupIdentity | None = None,
    ) -> JobSession:
        """The session a checked ``hello`` from peer ``uid`` opens at ``now_s`` (seconds,
        server clock); ``cgroup``: what the process's cgroup path says, if read."""
        return cls(
            session=session,
            name=hello.job,
            pid=hello.pid,
            connected_at_s=now_s,
            cuda_devices=hello.cuda_devices,
            knobs=dict(hello.knobs),
            study=hello.study,
            trial_number=hello.trial_number,
            slurm=hello.slurm,
            dropped_knobs=hello.dropped_knobs,
            uid=uid,
            cgroup=cgroup,
        )

    def remembered_knobs(self, memory: KnobMemory, log: Any) -> dict[str, KnobValue]:
        """The ``knobs`` of the ``hello`` reply: the values ``memory`` remembers for this
        job that its declared knobs can take (logged ``control.knobs_restored``; one
        outside the declared bounds is logged ``control.knob_not_restored`` with the
        reason). A declared value that is the remembered one keeps its source."""
        knobs, refused = memory.handback(self.name, self.knobs)
        for name, knob in self.knobs.items():
            source = memory.source_of(self.name, name, knob.value)
            if source is not None:  # a process that kept a remembered value (a reconnect)
                self.knobs[name] = dataclasses.replace(knob, source=source)
                self.info_kept = None
        for name, reason in refused.items():
            log.warning("control.knob_not_restored", job=self.name, knob=name, reason=reason)
        if knobs:
            log.info("control.knobs_restored", job=self.name, knobs=knobs)
        return knobs

    def info(self) -> JobInfo:
        """The :class:`~gpuwatchd.model.JobInfo` the daemon sees (frozen; its ``knobs`` a
        copy, not to be changed): the same object while nothing of it changed (every
        ``status`` and tick asks for all attached jobs: 64 new objects each was most of a
        ``status``'s CPU, docs/benchmarks.md). A report, a trial or a knob makes a new
        one: :meth:`apply_report`, :meth:`apply_knob` and :meth:`remembered_knobs`, the
        only code that changes them, clear :attr:`info_kept`; the other fields are the
        hello's, fixed for the session."""
        info = self.info_kept
        if info is None:
            info = self.info_kept = JobInfo(
                name=self.name,
                pid=self.pid,
                connected_at_s=self.connected_at_s,
                cuda_devices=self.cuda_devices,
                knobs=dict(self.knobs),
                study=self.study,
                trial_number=self.trial_number,
                last_report=self.last_report,
                slurm=self.slurm,
                uid=self.uid,
                cgroup=self.cgroup,
            )
        return info

    def apply_report(
        self, update: ReportUpdate, log: Any, memory: KnobMemory | None = None
    ) -> None:
        """Store a checked report: the report, a new trial (logged ``control.job_trial``),
        knob values that changed (each logged ``control.knob_applied``). A changed value
        that ``memory`` remembers for this job (handed back at ``hello``) keeps that
        source; any other change is the job's own (``source="job"``)."""
        self.last_report = update.report
        self.info_kept = None
        trial_number = update.trial_number if update.trial_given else self.trial_number
        if trial_number != self.trial_number:
            log.info("control.job_trial", job=self.name, pid=self.pid, trial=trial_number)
            self.trial_number = trial_number
        now = update.report.timestamp_s
        for name, value in update.knob_values.items():
            old = self.knobs[name]
            if old.value == value:  # same kind: bool-ness checked by report_knobs
                continue
            source = (memory.source_of(self.name, name, value) if memory else None) or JOB
            self.knobs[name] = Knob(name, value, old.min, old.max, applied_at_s=now, source=source)
            log.info("control.knob_applied", job=self.name, knob=name, value=value, source=source)

    def report(
        self, params: Mapping[str, Any], now_s: float, log: Any, memory: KnobMemory | None = None
    ) -> None:
        """Check a ``report`` whole (:func:`~.messages.parse_report`), then store it.

        Raises :class:`ProtocolError` ``bad_request``; a bad report changes nothing.
        """
        update = parse_report(params, declared=self.knobs, timestamp_s=now_s)
        self.apply_report(update, log, memory)

    def event(self, params: Mapping[str, Any], now_s: float, log: Any) -> JobEvent:
        """Check a job ``event`` (:func:`~.messages.parse_event`), stamped with ``now_s``
        and this session's job, pid and (by default) trial, and a ``crash`` with the Slurm
        array task its hello named (``slurm_job``, ``<array>_<task>``); logged
        ``control.job_event``.

        Raises :class:`ProtocolError` ``bad_request``.
        """
        event = parse_event(
            params,
            job=self.name,
            pid=self.pid,
            default_trial=self.trial_number,
            timestamp_s=now_s,
        )
        task = self.slurm
        if event.kind == "crash" and task is not None and task.array_task_id is not None:
            event = dataclasses.replace(event, slurm_job=task.label())
        log.info(
            "control.job_event",
            job=self.name,
            pid=self.pid,
            kind=event.kind,
            crash_kind=event.crash_kind,
            trial=event.trial_number,
            trial_state=event.trial_state,
            message=event.message[:200],
        )
        return event

    def apply_knob_reply(
        self,
        result: Any,
        now_s: float,
        log: Any,
        source: str | None = None,
        memory: KnobMemory | None = None,
    ) -> None:
        """Record the job's ``set_knob`` reply ``result`` if it is well formed (else log
        ``control.bad_set_knob_reply``); ``source`` is who sent the command (``policy
        <name>``, ``operator``), None when unknown; a known source's value is remembered
        in ``memory`` (handed back at ``hello``)."""
        applied = parse_set_knob_result(result) if isinstance(result, Mapping) else None
        if applied is None:
            if isinstance(result, Mapping):
                log.warning("control.bad_set_knob_reply", job=self.name, result=repr(result)[:200])
            return
        self.apply_knob(applied, now_s, log, source)
        if source is not None and memory is not None:
            memory.remember(self.name, applied.name, applied.value, source, now_s)

    def apply_knob(
        self, applied: KnobApplied, now_s: float, log: Any, source: str | None = None
    ) -> None:
        """Record the job's ``set_knob`` reply (logged ``control.knob_applied``); ``source``
        is who sent the command (``policy <name>``, ``operator``), None when unknown."""
        old = self.knobs.get(applied.name)
        self.info_kept = None
        self.knobs[applied.name] = Knob(
            name=applied.name,
            value=applied.value,
            min=old.min if old else None,
            max=old.max if old else None,
            applied_at_s=now_s,
            source=source or JOB,
        )
        log.info(
            "control.knob_applied",
            job=self.name,
            knob=applied.name,
            value=applied.value,
            source=source or JOB,
        )


@dataclass
class EventBucket:
    """A token bucket of :data:`EVENTS_PER_S` tokens refilled per second (``time.monotonic``)."""

    tokens: float = EVENTS_PER_S
    at_s: float = field(default=0.0)

    def take(self, now_s: float) -> bool:
        """Spend one token at ``now_s``; False (nothing spent) when the bucket is empty."""
        self.tokens = min(EVENTS_PER_S, self.tokens + (now_s - self.at_s) * EVENTS_PER_S)
        self.at_s = now_s
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


def open_session(
    params: Mapping[str, Any],
    peer: PeerCredentials,
    *,
    owner_of: Callable[[str], int | None],
    number: int,
    now_s: float,
    log: Any,
    cgroup_of: Callable[[int], CgroupIdentity] | None = None,
) -> JobSession:
    """The :class:`JobSession` a ``hello`` from ``peer`` opens (logged ``control.job_attached``,
    with what ``cgroup_of(pid)`` reads of the process's cgroup path when given;
    knobs left out of it, :attr:`JobSession.dropped_knobs`, are a ``control.knobs_dropped``
    warning with the job's pid, names cut to twice :data:`KNOB_NAME_MAX_CHARS`).

    A job may only speak for its own pid, and a job name attached by one user (``owner_of``
    gives its uid, ``None`` when nobody holds it) cannot be taken by another; root may do
    both. Raises :class:`ProtocolError` ``forbidden`` for those, ``bad_request`` for a
    malformed hello (rights are checked first, once name and pid are valid).
    """

    def authorize(name: str, pid: int) -> None:
        if pid != peer.pid and peer.uid != 0:
            raise ProtocolError(ErrorCode.FORBIDDEN, "a job may only speak for its own pid")
        owner = owner_of(name)
        if owner is not None and owner != peer.uid and peer.uid != 0:
            # A name is bound to the user whose processes hold it: nobody else may pose
            # as that job (and so draw its knob changes or report crashes in its name).
            raise ProtocolError(
                ErrorCode.FORBIDDEN, f"job {name!r} is attached by another user (uid {owner})"
            )

    hello = parse_hello(params, authorize=authorize)
    cgroup = None if cgroup_of is None else cgroup_of(hello.pid)
    if cgroup == CgroupIdentity():
        cgroup = None  # the path names nothing: null in status, not three nulls
    session = JobSession.attach(hello, number, now_s, uid=peer.uid, cgroup=cgroup)
    if hello.dropped_knobs:
        log.warning(
            "control.knobs_dropped",
            job=hello.job,
            pid=hello.pid,
            uid=peer.uid,
            dropped=[
                {"knob": d.knob[: 2 * KNOB_NAME_MAX_CHARS], "reason": d.reason}
                for d in hello.dropped_knobs
            ],
        )
    log.info(
        "control.job_attached",
        job=hello.job,
        pid=hello.pid,
        session=number,
        knobs={k: v.value for k, v in hello.knobs.items()},
        cuda_devices=list(hello.cuda_devices),
        study=hello.study,
        trial=hello.trial_number,
        slurm_job=None if hello.slurm is None else hello.slurm.label(),
        slurm_user=None if hello.slurm is None else hello.slurm.user,
        slurm_partition=None if hello.slurm is None else hello.slurm.partition,
        slurm_gpus=None if hello.slurm is None else list(hello.slurm.gpus),
        systemd_unit=None if cgroup is None else cgroup.systemd_unit,
        systemd_user=None if cgroup is None else cgroup.systemd_user,
        kubernetes_pod_uid=None if cgroup is None else cgroup.kubernetes_pod_uid,
    )
    return session


@dataclass
class Connection:
    """One client connection as the server holds it: its peer, its job session (after
    ``hello``), the daemon->job commands awaiting a reply, its running handler tasks."""

    number: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    peer: PeerCredentials
    session: JobSession | None = None
    closed: bool = False
    pending: dict[str, tuple[str, asyncio.Future[Reply], str | None]] = field(default_factory=dict)
    """Daemon->job commands awaiting the job's reply: command id -> (op, future, source)."""
    inflight: set[asyncio.Task[None]] = field(default_factory=set)
    events: EventBucket = field(default_factory=lambda: EventBucket(at_s=time.monotonic()))

    def add_pending(
        self, command_id: str, entry: tuple[str, asyncio.Future[Reply], str | None], limit: int
    ) -> None:
        """Await a reply to ``command_id``; at ``limit`` pending commands (a job that never
        answers), forget its oldest timed-out commands first."""
        if len(self.pending) >= limit:
            for stale in [k for k, (_, f, _s) in self.pending.items() if f.done()]:
                del self.pending[stale]
                if len(self.pending) < limit:
                    break
        self.pending[command_id] = entry
