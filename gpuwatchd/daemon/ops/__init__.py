"""Control operations: one module per op, each docstring that op's contract.

Each op module has ``NAMES`` (the ops it answers) and ``execute(target, op, params,
peer)``; ``target`` is anything with the :class:`ControlTarget` shape (the daemon, or a
fake in tests). The server has checked the caller's admin rights before.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from gpuwatchd.actuators import DecisionRecord, JobCommander
from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import ErrorCode, Request
from gpuwatchd.errors import ProtocolError
from gpuwatchd.model import Decision
from gpuwatchd.policy.holds import KnobHolds

__all__ = ["ControlTarget", "EventSource", "dispatch", "op_names"]


class EventSource(Protocol):
    """What the ``events`` op reads: the event rows of a :class:`gpuwatchd.journal.Journal`."""

    def events(
        self, *, since_s: float | None = None, after_id: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """Events in id order; raises :class:`~gpuwatchd.errors.JournalError`."""
        ...

    def last_event_id(self) -> int:
        """The newest event id (0 for none)."""
        ...


class ControlTarget(Protocol):
    """What the ops need from the daemon."""

    @property
    def paused(self) -> bool:
        """Whether remediation is paused (decisions logged as dry-run only)."""
        ...

    def set_paused(self, paused: bool, *, by_uid: int) -> None:
        """Pause or resume remediation (logged with the caller's uid)."""
        ...

    def status_report(self) -> dict[str, Any]:
        """The whole ``status`` object before it is fitted into one reply line."""
        ...

    def status_reply(self, *, full: bool = False, brief: bool = False) -> Any:
        """The ``status`` reply, fitted into one line (a dict, or a result
        :func:`gpuwatchd.control.protocol.encode` splices as JSON text); ``full`` and
        ``brief`` as :mod:`gpuwatchd.daemon.ops.status` says."""
        ...

    async def set_cordon(self, gpu: int, cordoned: bool, *, by_uid: int) -> str:
        """Cordon GPU ``gpu`` or lift its cordon; raises
        :class:`~gpuwatchd.errors.ActionRefused`."""
        ...

    async def resume_node(self, *, by_uid: int) -> tuple[str, str]:
        """Return this node to service in Slurm; ``(node, detail)``. Raises
        :class:`~gpuwatchd.errors.ActionRefused` (no ``slurm:``, Slurm refused)."""
        ...

    def jobs_report(self) -> dict[str, Any]:
        """``{"jobs": [attached job...], "managed": [managed job...]}``."""
        ...

    def policies_report(self) -> dict[str, Any]:
        """The running policies with ``loaded_at_s``, ``paused``, ``dry_run``."""
        ...

    async def reload_policies(self, path: str | None = None) -> object:
        """Swap in the policies of ``path`` (or the configured ones); PolicyError keeps them."""
        ...

    def event_source(self) -> EventSource | None:
        """The open journal, or None."""
        ...

    def commander(self) -> JobCommander | None:
        """The control server (sends commands to jobs), or None before it runs."""
        ...

    def record_decision(self, decision: Decision) -> DecisionRecord:
        """Journal a decision made outside a tick (``pending``; shown by ``status``)."""
        ...

    def decision_done(self, record: DecisionRecord) -> None:
        """Journal the outcome of a record from :meth:`record_decision`."""
        ...

    @property
    def knob_holds(self) -> KnobHolds:
        """The operator's holds on job knobs (the ``knob`` op places them)."""
        ...

    async def control_job(self, job: str, action: str, *, by_uid: int) -> tuple[int, int]:
        """``start``, ``stop`` or ``restart`` managed job ``job``; returns (stopped, started).

        Raises :class:`~gpuwatchd.errors.SupervisorError` (``not_found`` for an unknown job).
        """
        ...

    @property
    def log(self) -> Any:
        """A structlog-style logger."""
        ...


Execute = Callable[[ControlTarget, str, Mapping[str, Any], PeerCredentials], Awaitable[Any]]


@functools.cache
def _table() -> dict[str, Execute]:
    """Each op's ``execute``, built at the first request (nothing at import time) and
    kept: building it per request was 10 us of every ``status`` (cProfile of
    bench/control.py's daemon)."""
    from gpuwatchd.daemon.ops import events, gpu, job, jobs, knob, node, pause, policy, status

    table: dict[str, Execute] = {}
    for module in (status, jobs, events, policy, knob, pause, job, gpu, node):
        for name in module.NAMES:
            table[name] = module.execute
    return table


def op_names() -> tuple[str, ...]:
    """Every op the daemon answers."""
    return tuple(_table())


async def dispatch(target: ControlTarget, request: Request, peer: PeerCredentials) -> Any:
    """Answer one control request; raises :class:`ProtocolError` (``unknown_op`` and the
    op's own errors)."""
    execute = _table().get(request.op)
    if execute is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {request.op!r}")
    return await execute(target, request.op, request.params, peer)
