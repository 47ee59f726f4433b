"""The daemon's Xid watch: the Xid errors drained from the GPU sampler, kept for the
``xid`` detector, ``status``, the metrics and a crash's evidence (docs/daemon-internals.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuwatchd.jobs.records import WorkerCrash
from gpuwatchd.xid import XID_LOG_SIZE, XidEvent, XidLog

__all__ = ["XidWatch"]


class XidWatch:
    """The Xid errors NVML reported: a :class:`~gpuwatchd.xid.XidLog` of them and the
    ones the next snapshot has not carried yet.

    Made before the parts that read it (the ticker, the crash handler); the GPU sampler
    is handed to it once open (:meth:`use_sampler`). ``clock``: the daemon's clock
    (seconds); ``logger``: structlog-style.
    """

    def __init__(self, clock: Callable[[], float], logger: Any) -> None:
        self._clock = clock
        self._log = logger
        self._sampler: Any = None
        self.log = XidLog()
        self._pending: list[XidEvent] = []
        """Xid errors drained since the last snapshot (a crash's evidence drains NVML
        between ticks too): the next snapshot's ``xids``, for the ``xid`` detector."""

    def use_sampler(self, sampler: Any) -> None:
        """Drain ``sampler`` (a GPU sampler; only NVML's has ``poll_xid_events``) from now."""
        self._sampler = sampler

    def poll(self, now: float) -> None:
        """Drain the GPU sampler's pending Xid errors (NVML only) into the Xid log, logging
        each as a warning. On the event-loop thread, like every NVML call."""
        poll = getattr(self._sampler, "poll_xid_events", None)
        if poll is None:
            return
        try:
            events: tuple[XidEvent, ...] = poll(now)
        except Exception as exc:  # the sampler never raises; a bug must not fail the tick
            self._log.error("xid polling failed", error=f"{type(exc).__name__}: {exc}")
            return
        for event in events:
            self._log.warning(
                "gpu xid",
                gpu=event.gpu_index,
                gpu_uuid=event.gpu_uuid,
                xid=event.xid,
                description=event.description,
                cause=event.cause,
            )
        self.log.add(events)
        if len(self._pending) < XID_LOG_SIZE:
            self._pending.extend(events[: XID_LOG_SIZE - len(self._pending)])

    def take_pending(self) -> tuple[XidEvent, ...]:
        """The Xid errors drained since the last call (a snapshot's ``xids``)."""
        taken, self._pending = tuple(self._pending), []
        return taken

    def evidence(self, crash: WorkerCrash) -> tuple[XidEvent, ...]:
        """The Xid errors on ``crash``'s GPU around its time (:meth:`XidLog.near`).

        Drains NVML first, so an Xid the driver reported since the last tick counts too.
        ``()`` for a worker the daemon stopped itself (``intentional``: its Xid 45 is the
        daemon's doing) or one with no known GPU.
        """
        if crash.intentional or crash.gpu_index is None:
            return ()
        self.poll(self._clock())
        return self.log.near(crash.gpu_index, crash.timestamp_s)
