"""Actuators: carry out the policy engine's decisions and record their outcome.

:meth:`Actuator.plan` gives a decision's record before anything happens (so the daemon
can journal it first), :meth:`Actuator.start` acts. The actions are described in
docs/daemon-internals.md ("Actions").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gpuwatchd.crash import signal_of
from gpuwatchd.errors import ActionRefused, GpuwatchError
from gpuwatchd.model import Decision
from gpuwatchd.notify import send_notification
from gpuwatchd.policy.actions import ACTIONS, public_params
from gpuwatchd.policy.actions.spec import (
    Effects,
    GpuCordoning,
    JobCommander,
    ManagedJobs,
    SlurmBackend,
)
from gpuwatchd.policy.holds import KnobHolds
from gpuwatchd.systemd import strip_notify_env

__all__ = [
    "EXEC_TAIL_CHARS",
    "Actuator",
    "DecisionRecord",
    "ExecResult",
    "GpuCordoning",
    "JobCommander",
    "ManagedJobs",
    "run_exec",
]

_LOG_LEVELS = ("debug", "info", "warning", "error")
EXEC_TAIL_CHARS: Final = 1000
"""Characters of an ``exec`` command's stdout and of its stderr kept in the outcome detail
(the journal keeps 4000 characters of a detail)."""
_EXEC_READ_GRACE_S: Final = 1.0
"""After an ``exec`` command exits, how long its pipes may stay open (a background child
holding them) before the tails are taken as they are."""
_STALE_SWEEP_MARGIN_S: Final = 1.0
"""A stale-trial sweep runs this long after the grace period, so the dead worker's last
heartbeat is older than the grace period by then."""
_CRASHES_KEPT: Final = 1024
"""Crash reports remembered for restart decisions (oldest forgotten first)."""


@dataclass(slots=True)
class DecisionRecord:
    """A decision and what became of it, as ``gpuwatchctl status`` shows it.

    ``outcome``: ``"logged"`` (a log action), ``"dry-run"``, ``"pending"`` (started, not
    finished), ``"applied"``, ``"refused"`` (the job or the present state said no,
    ``detail`` says why) or ``"failed"`` (no such job, disconnected, timeout, an error).
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
            "params": public_params(d.action, d.params),
            "dry_run": d.dry_run,
            "reason": d.reason,
            "outcome": self.outcome,
            "detail": self.detail,
            "finished_at_s": self.finished_at_s,
        }


# -- exec -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExecResult:
    """What :func:`run_exec` saw: ``returncode`` (``-N`` for signal N, None if it never
    ran), whether the timeout killed it, the tails of stdout/stderr (decoded, replaced
    errors), the wall time in seconds, and ``error`` when it could not be started."""

    returncode: int | None
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    duration_s: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Exit status 0 within the timeout."""
        return self.returncode == 0 and not self.timed_out and self.error is None

    def describe(self) -> str:
        """One line for the outcome detail: status, then the non-empty output tails."""
        if self.error is not None:
            return self.error
        if self.timed_out:
            status = f"timed out after {self.duration_s:.1f} s; process group killed"
        else:
            status = signal_of(self.returncode)[2]
        parts = [status]
        for name, tail in (("stdout", self.stdout_tail), ("stderr", self.stderr_tail)):
            text = tail.strip()
            if text:
                parts.append(f"{name}: {text}")
        return "; ".join(parts)


async def _pump(stream: asyncio.StreamReader | None, keep: bytearray, limit: int) -> None:
    """Read ``stream`` to its end keeping only its last ``limit`` bytes in ``keep``."""
    if stream is None:
        return
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return
        keep += chunk
        if len(keep) > limit:
            del keep[: len(keep) - limit]


def _tail_text(data: bytes, limit: int) -> str:
    text = data.decode("utf-8", errors="replace")
    return text[-limit:]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_exec(
    argv: Sequence[str],
    timeout_s: float,
    *,
    tail_chars: int = EXEC_TAIL_CHARS,
    env: Mapping[str, str] | None = None,
) -> ExecResult:
    """Run ``argv`` (program and arguments; never through a shell) and wait at most
    ``timeout_s`` seconds.

    The process gets stdin ``/dev/null``, its own session (so a timeout or a cancel kills
    its whole process group with SIGKILL), and ``env`` (default: the daemon's environment
    without systemd's ``NOTIFY_SOCKET``/``WATCHDOG_*``). stdout and stderr are read as
    they come, keeping only the last ``tail_chars`` characters of each (bounded memory
    whatever the command prints). Arguments are passed as they are: ``;``, ``$(...)`` or
    ``*`` mean nothing special. Never raises for a command that cannot be started (an
    :class:`ExecResult` with ``error``); raises :class:`ValueError` for an empty ``argv``
    or a non-positive timeout. Cancelling it kills the process group.
    """
    if not argv:
        raise ValueError("exec needs a non-empty argv")
    if not timeout_s > 0:
        raise ValueError(f"exec timeout must be positive, not {timeout_s!r}")
    started = time.monotonic()
    limit = max(1, tail_chars) * 4  # UTF-8: at most 4 bytes per character
    try:
        proc = await asyncio.create_subprocess_exec(
            *[str(a) for a in argv],
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            env=dict(strip_notify_env(os.environ if env is None else env)),
        )
    except (OSError, ValueError) as exc:
        return ExecResult(
            None,
            False,
            "",
            "",
            time.monotonic() - started,
            error=f"cannot run {argv[0]!r}: {getattr(exc, 'strerror', None) or exc}",
        )
    out, err = bytearray(), bytearray()
    readers = asyncio.ensure_future(
        asyncio.gather(_pump(proc.stdout, out, limit), _pump(proc.stderr, err, limit))
    )
    timed_out = False
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            _kill_group(proc.pid)
            await proc.wait()
        # A background child may keep the pipes open after the command exits.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(readers), _EXEC_READ_GRACE_S)
    except BaseException:
        _kill_group(proc.pid)
        raise
    finally:
        if not readers.done():
            readers.cancel()
            with contextlib.suppress(BaseException):
                await readers
    return ExecResult(
        proc.returncode,
        timed_out,
        _tail_text(bytes(out), tail_chars),
        _tail_text(bytes(err), tail_chars),
        time.monotonic() - started,
    )


# -- the actuator ---------------------------------------------------------------------------


class Actuator:
    """Carries out decisions; ``apply`` never blocks the tick and never raises for a bad target.

    Each decision is dispatched through its action's spec
    (:data:`gpuwatchd.policy.actions.ACTIONS`): its ``plan`` (an outcome known before
    acting), its ``needs`` and its ``carry_out``, which gets the collaborators
    (:class:`~gpuwatchd.policy.actions.spec.Effects`). ``commander`` is the control server;
    ``logger`` a structlog logger; ``clock`` gives seconds (the daemon's wall clock).
    Knob commands wait up to ``ack_timeout_s`` (default 10 minutes: a job applies
    DataLoader knobs at its next epoch) for the job. ``managed`` carries out the
    managed-job actions; ``None`` makes them fail (no ``jobs:`` configured). ``gpus``
    carries out ``cordon_gpu`` and ``uncordon_gpu`` and refuses ``place_on_idle_gpu`` on a
    cordoned GPU; ``None`` makes them fail. ``on_outcome`` receives every record whose
    outcome became known after :meth:`plan` (the daemon journals it). ``holds`` are the
    operator's overrides (:mod:`gpuwatchd.policy.holds`): a knob decision on a held knob
    is refused, naming the operator. ``slurm`` carries out ``drain_node`` and the ladder
    actions of the Slurm arrays it owns; ``None``: not on Slurm.
    """

    def __init__(
        self,
        commander: JobCommander,
        logger: Any,
        clock: Callable[[], float],
        *,
        ack_timeout_s: float = 600.0,
        on_outcome: Callable[[DecisionRecord], None] | None = None,
        managed: ManagedJobs | None = None,
        gpus: GpuCordoning | None = None,
        holds: KnobHolds | None = None,
        slurm: SlurmBackend | None = None,
    ) -> None:
        self._effects = Effects(
            commander=commander,
            managed=managed,
            gpus=gpus,
            slurm=slurm,
            run_exec=run_exec,
            send_notification=send_notification,
            ack_timeout_s=ack_timeout_s,
        )
        self._holds = holds
        self._log = logger
        self._clock = clock
        self._on_outcome = on_outcome
        self._tasks: set[asyncio.Task[None]] = set()

    def plan(self, decision: Decision) -> DecisionRecord:
        """The record of ``decision`` before acting: its outcome if already known, else pending.

        ``dry-run`` for a dry-run decision; the action's own plan if it has one
        (``logged`` for ``log`` and a ``tune_loader`` hold, ``refused`` for a knob an
        operator holds: the detail names the operator's change); ``failed`` for an
        action without a carrying-out or whose collaborators are missing (no managed
        jobs, no GPU cordons); else ``pending``. No side effects.
        """
        now = self._clock()
        if decision.dry_run:
            return DecisionRecord(decision, "dry-run", finished_at_s=now)
        spec = ACTIONS.get(decision.action)
        known = None if spec is None or spec.plan is None else spec.plan(decision, self._holds)
        if known is not None:
            return DecisionRecord(decision, known[0], detail=known[1], finished_at_s=now)
        if spec is None or spec.carry_out is None:
            detail = f"action {decision.action!r} has no actuator"
            return DecisionRecord(decision, "failed", detail=detail, finished_at_s=now)
        missing = self._effects.missing(spec.needs)
        if missing is not None:
            return DecisionRecord(decision, "failed", detail=missing, finished_at_s=now)
        return DecisionRecord(decision, "pending")

    def start(self, record: DecisionRecord) -> None:
        """Act on a record from :meth:`plan`: log it, or start carrying it out.

        Never blocks and never raises for a bad target; a ``pending`` record is updated
        in place when its outcome is known, and then passed to ``on_outcome``. Must run
        on the event loop for pending records.
        """
        decision = record.decision
        fields = _fields(decision, record.journal_id)
        if record.outcome == "dry-run":
            self._log.info("decision", dry_run=True, params=_public(decision), **fields)
        elif record.outcome == "logged":
            level = str(decision.params.get("level", "info"))
            emit = getattr(self._log, level if level in _LOG_LEVELS else "info")
            emit("policy", message=decision.params.get("message", ""), **fields)
        elif record.outcome == "pending":
            self._log.info("decision", params=_public(decision), **fields)
            task = asyncio.get_running_loop().create_task(self._carry_out(record))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._log.warning(
                "decision not carried out",
                params=_public(decision),
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

    async def _carry_out(self, record: DecisionRecord) -> None:
        """Carry out a pending decision through its action's ``carry_out``; set its outcome
        (``ActionRefused``: refused; any other error: failed) and report it."""
        decision = record.decision
        spec = ACTIONS.get(decision.action)
        try:
            if spec is None or spec.carry_out is None:  # plan() failed these already
                raise GpuwatchError(f"action {decision.action!r} has no actuator")
            record.outcome, record.detail = await spec.carry_out(decision, self._effects)
        except ActionRefused as exc:
            record.outcome, record.detail = "refused", exc.message
        except asyncio.CancelledError:
            if spec is not None and spec.job_command:
                raise  # left pending: the job may still apply it (unknown after a restart)
            record.outcome, record.detail = "failed", "cancelled: the daemon stopped"
            record.finished_at_s = self._clock()
            self._report(record)
            raise
        except GpuwatchError as exc:
            record.outcome, record.detail = "failed", str(exc)
        except Exception as exc:
            record.outcome, record.detail = "failed", f"{type(exc).__name__}: {exc}"
        record.finished_at_s = self._clock()
        fields = _fields(decision, record.journal_id)
        log = self._log.info if record.outcome == "applied" else self._log.warning
        if spec is not None and spec.job_command:
            params = decision.params
            fields |= {"knob": params.get("knob"), "value": params.get("value")}
            log("knob " + record.outcome, detail=record.detail or None, **fields)
        else:
            log("action " + record.outcome, detail=record.detail or None, **fields)
        self._report(record)

    def _report(self, record: DecisionRecord) -> None:
        if self._on_outcome is None:
            return
        try:
            self._on_outcome(record)
        except Exception as exc:  # the callback must not kill the actuator's task
            self._log.error(
                "recording an outcome failed",
                policy=record.decision.policy,
                decision_id=record.journal_id,
                error=f"{type(exc).__name__}: {exc}",
            )

    async def close(self) -> None:
        """Cancel what is still running (commands waiting for an acknowledgement, ``exec``
        commands: their process groups are killed, managed-job actions)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _public(decision: Decision) -> dict[str, object]:
    return public_params(decision.action, decision.params)


def _fields(decision: Decision, journal_id: int | None) -> dict[str, Any]:
    fields = {
        "policy": decision.policy,
        "action": decision.action,
        "job": decision.job,
        "gpu_uuid": decision.gpu_uuid,
        "reason": decision.reason,
        "decision_id": journal_id,
    }
    return {k: v for k, v in fields.items() if v not in (None, "")}
