"""Actuators: carry out the policy engine's decisions and record their outcome.

Issue-2 slice: ``log`` (a structured log line) and ``set_knob`` (a ``set_knob``
command over the control socket to the job's hook, acknowledged when the job has
applied it, e.g. at its next epoch). A decision marked ``dry_run`` (per policy,
``--dry-run`` or ``gpuwatchctl pause``) is only logged.

Two steps, so the daemon can journal a decision *before* anything happens
(write-ahead): :meth:`Actuator.plan` returns the :class:`DecisionRecord` with the
outcome when it is known before acting (``logged``, ``dry-run``, ``failed`` for an
action without an actuator) or ``pending``; :meth:`Actuator.start` then acts. An
outcome that arrives later (a job acknowledging ``set_knob``) updates the record in
place and is passed to the ``on_outcome`` callback. :meth:`Actuator.apply` does both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuwatchd.control.protocol import Reply
from gpuwatchd.errors import ControlError
from gpuwatchd.model import Decision

__all__ = ["Actuator", "DecisionRecord", "JobCommander"]

_LOG_LEVELS = ("debug", "info", "warning", "error")
_NO_ANSWER = frozenset({"disconnected", "timeout"})
"""``error_message`` of the replies ControlServer.send_command makes up for lost jobs."""


class JobCommander(Protocol):
    """What the actuator needs from the control server: sending a command to a job."""

    async def send_command(
        self,
        job: str,
        op: str,
        params: Mapping[str, Any],
        *,
        pid: int | None = None,
        timeout_s: float = 60.0,
    ) -> list[Reply]: ...


@dataclass(slots=True)
class DecisionRecord:
    """A decision and what became of it, as ``gpuwatchctl status`` shows it.

    ``outcome``: ``"logged"`` (a log action), ``"dry-run"``, ``"pending"`` (sent, not yet
    acknowledged), ``"applied"``, ``"refused"`` (the job said no, ``detail`` says why) or
    ``"failed"`` (no such job, disconnected, timeout).
    """

    decision: Decision
    outcome: str
    detail: str = ""
    finished_at_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    journal_id: int | None = None
    """The decision's id in the journal (``decision_id`` of ``gpuwatchctl events``)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the ``decisions`` entries of ``status --json``)."""
        d = self.decision
        return {
            "id": self.journal_id,
            "timestamp_s": d.timestamp_s,
            "policy": d.policy,
            "action": d.action,
            "job": d.job,
            "gpu_uuid": d.gpu_uuid,
            "params": dict(d.params),
            "dry_run": d.dry_run,
            "reason": d.reason,
            "outcome": self.outcome,
            "detail": self.detail,
            "finished_at_s": self.finished_at_s,
        }


class Actuator:
    """Carries out decisions; ``apply`` never blocks the tick and never raises for a bad target.

    ``commander`` is the control server; ``logger`` a structlog logger; ``clock`` gives
    seconds (the daemon's wall clock). ``set_knob`` commands wait up to ``ack_timeout_s``
    (default 10 minutes: a job applies DataLoader knobs at its next epoch) for the job.
    """

    def __init__(
        self,
        commander: JobCommander,
        logger: Any,
        clock: Callable[[], float],
        *,
        ack_timeout_s: float = 600.0,
        on_outcome: Callable[[DecisionRecord], None] | None = None,
    ) -> None:
        self._commander = commander
        self._log = logger
        self._clock = clock
        self._ack_timeout_s = ack_timeout_s
        self._on_outcome = on_outcome
        self._tasks: set[asyncio.Task[None]] = set()

    def plan(self, decision: Decision) -> DecisionRecord:
        """The record of ``decision`` before acting: its outcome if already known, else pending.

        ``dry-run`` for a dry-run decision, ``logged`` for ``log``, ``pending`` for
        ``set_knob``, ``failed`` for an action without an actuator. No side effects.
        """
        now = self._clock()
        if decision.dry_run:
            return DecisionRecord(decision, "dry-run", finished_at_s=now)
        if decision.action == "log":
            return DecisionRecord(decision, "logged", finished_at_s=now)
        if decision.action == "set_knob":
            return DecisionRecord(decision, "pending")
        return DecisionRecord(
            decision,
            "failed",
            detail=f"action {decision.action!r} has no actuator",
            finished_at_s=now,
        )

    def start(self, record: DecisionRecord) -> None:
        """Act on a record from :meth:`plan`: log it, or send the command to the job.

        Never blocks and never raises for a bad target; a ``pending`` record is updated
        in place when the job answers, and then passed to ``on_outcome``. Must run on the
        event loop for ``set_knob``.
        """
        decision = record.decision
        fields = {
            "policy": decision.policy,
            "action": decision.action,
            "job": decision.job,
            "gpu_uuid": decision.gpu_uuid,
            "reason": decision.reason,
            "decision_id": record.journal_id,
        }
        fields = {k: v for k, v in fields.items() if v not in (None, "")}
        if record.outcome == "dry-run":
            self._log.info("decision", dry_run=True, params=dict(decision.params), **fields)
        elif record.outcome == "logged":
            level = str(decision.params.get("level", "info"))
            emit = getattr(self._log, level if level in _LOG_LEVELS else "info")
            emit("policy", message=decision.params.get("message", ""), **fields)
        elif record.outcome == "pending" and decision.action == "set_knob":
            self._log.info("decision", params=dict(decision.params), **fields)
            task = asyncio.get_running_loop().create_task(self._set_knob(record))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._log.warning(
                "decision not supported yet",
                params=dict(decision.params),
                detail=record.detail or None,
                **fields,
            )

    def apply(self, decision: Decision) -> DecisionRecord:
        """:meth:`plan` and :meth:`start` in one: start carrying out ``decision``.

        Returns its record (a pending one is updated in place later).
        """
        record = self.plan(decision)
        self.start(record)
        return record

    async def _set_knob(self, record: DecisionRecord) -> None:
        decision = record.decision
        params = {"knob": decision.params["knob"], "value": decision.params["value"]}
        job = decision.job or ""
        try:
            replies = await self._commander.send_command(
                job, "set_knob", params, timeout_s=self._ack_timeout_s
            )
        except ControlError as exc:
            record.outcome, record.detail = "failed", exc.message
        except Exception as exc:
            record.outcome, record.detail = "failed", f"{type(exc).__name__}: {exc}"
        else:
            failed = [r for r in replies if not r.ok]
            if failed:
                # The server reports a job that went away or never answered with these
                # messages; anything else is the job's own refusal, with its reason.
                lost = all(r.error_message in _NO_ANSWER for r in failed)
                record.outcome = "failed" if lost else "refused"
                record.detail = "; ".join(f"{r.error_code}: {r.error_message}" for r in failed)
            else:
                record.outcome = "applied"
        record.finished_at_s = self._clock()
        log = self._log.info if record.outcome == "applied" else self._log.warning
        log(
            "knob " + record.outcome,
            policy=decision.policy,
            action="set_knob",
            job=job,
            knob=params["knob"],
            value=params["value"],
            detail=record.detail or None,
            decision_id=record.journal_id,
        )
        if self._on_outcome is not None:
            try:
                self._on_outcome(record)
            except Exception as exc:  # the callback must not kill the actuator's task
                self._log.error(
                    "recording an outcome failed",
                    policy=decision.policy,
                    decision_id=record.journal_id,
                    error=f"{type(exc).__name__}: {exc}",
                )

    async def close(self) -> None:
        """Cancel commands still waiting for an acknowledgement."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
