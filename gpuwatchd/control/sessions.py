"""The job half of protocol v1 on the server side: a job's session (``hello``), what its
``report``, ``event`` and knob replies change, and the rate limit on its events. No
sockets; the caller gives the peer, the time and the logger."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gpuwatchd.control.messages import (
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
from gpuwatchd.model import JobEvent, JobInfo, JobReport, Knob

__all__ = ["EVENTS_PER_S", "Connection", "EventBucket", "JobSession", "open_session"]

EVENTS_PER_S: Final = 10.0
"""Job ``event`` messages one connection may send per second (burst of the same size);
beyond that they are refused, so one job cannot flood the tick's queue or the log."""


@dataclass
class JobSession:
    """A connection's job after a valid ``hello``; ``session`` numbers attaches from 1."""

    session: int
    name: str
    pid: int
    connected_at_s: float
    cuda_devices: tuple[str, ...]
    knobs: dict[str, Knob]
    study: str | None
    trial_number: int | None
    last_report: JobReport | None = None

    @classmethod
    def attach(cls, hello: Hello, session: int, now_s: float) -> JobSession:
        """The session a checked ``hello`` opens at ``now_s`` (seconds, server clock)."""
        return cls(
            session=session,
            name=hello.job,
            pid=hello.pid,
            connected_at_s=now_s,
            cuda_devices=hello.cuda_devices,
            knobs=dict(hello.knobs),
            study=hello.study,
            trial_number=hello.trial_number,
        )

    def info(self) -> JobInfo:
        """The :class:`~gpuwatchd.model.JobInfo` the daemon sees (a copy)."""
        return JobInfo(
            name=self.name,
            pid=self.pid,
            connected_at_s=self.connected_at_s,
            cuda_devices=self.cuda_devices,
            knobs=dict(self.knobs),
            study=self.study,
            trial_number=self.trial_number,
            last_report=self.last_report,
        )

    def apply_report(self, update: ReportUpdate, log: Any) -> None:
        """Store a checked report: the report, a new trial (logged ``control.job_trial``),
        knob values that changed (each logged ``control.knob_applied``, ``source="job"``)."""
        self.last_report = update.report
        trial_number = update.trial_number if update.trial_given else self.trial_number
        if trial_number != self.trial_number:
            log.info("control.job_trial", job=self.name, pid=self.pid, trial=trial_number)
            self.trial_number = trial_number
        now = update.report.timestamp_s
        for name, value in update.knob_values.items():
            old = self.knobs[name]
            if old.value == value:  # same kind: bool-ness checked by report_knobs
                continue
            self.knobs[name] = Knob(name, value, old.min, old.max, applied_at_s=now)
            log.info("control.knob_applied", job=self.name, knob=name, value=value, source="job")

    def report(self, params: Mapping[str, Any], now_s: float, log: Any) -> None:
        """Check a ``report`` whole (:func:`~.messages.parse_report`), then store it.

        Raises :class:`ProtocolError` ``bad_request``; a bad report changes nothing.
        """
        self.apply_report(parse_report(params, declared=self.knobs, timestamp_s=now_s), log)

    def event(self, params: Mapping[str, Any], now_s: float, log: Any) -> JobEvent:
        """Check a job ``event`` (:func:`~.messages.parse_event`), stamped with ``now_s``
        and this session's job, pid and (by default) trial; logged ``control.job_event``.

        Raises :class:`ProtocolError` ``bad_request``.
        """
        event = parse_event(
            params,
            job=self.name,
            pid=self.pid,
            default_trial=self.trial_number,
            timestamp_s=now_s,
        )
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

    def apply_knob_reply(self, result: Any, now_s: float, log: Any) -> None:
        """Record the job's ``set_knob`` reply ``result`` if it is well formed (else log
        ``control.bad_set_knob_reply``)."""
        applied = parse_set_knob_result(result) if isinstance(result, Mapping) else None
        if applied is None:
            if isinstance(result, Mapping):
                log.warning("control.bad_set_knob_reply", job=self.name, result=repr(result)[:200])
            return
        self.apply_knob(applied, now_s, log)

    def apply_knob(self, applied: KnobApplied, now_s: float, log: Any) -> None:
        """Record the job's ``set_knob`` reply (logged ``control.knob_applied``)."""
        old = self.knobs.get(applied.name)
        self.knobs[applied.name] = Knob(
            name=applied.name,
            value=applied.value,
            min=old.min if old else None,
            max=old.max if old else None,
            applied_at_s=now_s,
        )
        log.info("control.knob_applied", job=self.name, knob=applied.name, value=applied.value)


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
) -> JobSession:
    """The :class:`JobSession` a ``hello`` from ``peer`` opens (logged ``control.job_attached``).

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
    session = JobSession.attach(hello, number, now_s)
    log.info(
        "control.job_attached",
        job=hello.job,
        pid=hello.pid,
        session=number,
        knobs={k: v.value for k, v in hello.knobs.items()},
        cuda_devices=list(hello.cuda_devices),
        study=hello.study,
        trial=hello.trial_number,
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
    pending: dict[str, tuple[str, asyncio.Future[Reply]]] = field(default_factory=dict)
    """Daemon->job commands awaiting the job's reply: command id -> (op, future)."""
    inflight: set[asyncio.Task[None]] = field(default_factory=set)
    events: EventBucket = field(default_factory=lambda: EventBucket(at_s=time.monotonic()))
