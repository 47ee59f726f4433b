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
from typing import TYPE_CHECKING, Any, Final, Protocol

from gpuwatchd.control.knobmemory import policy_source
from gpuwatchd.control.protocol import Op, Reply
from gpuwatchd.crash import signal_of
from gpuwatchd.errors import ActionRefused, ControlError, GpuwatchError
from gpuwatchd.model import Decision
from gpuwatchd.policy.actions import public_params
from gpuwatchd.policy.holds import KnobHolds
from gpuwatchd.systemd import strip_notify_env

if TYPE_CHECKING:  # pragma: no cover - typing only
    pass

__all__ = [
    "EXEC_TAIL_CHARS",
    "GPU_ACTIONS",
    "MANAGED_ACTIONS",
    "Actuator",
    "DecisionRecord",
    "ExecResult",
    "GpuCordoning",
    "JobCommander",
    "ManagedJobs",
    "run_exec",
]

_LOG_LEVELS = ("debug", "info", "warning", "error")
_NO_ANSWER = frozenset({"disconnected", "timeout"})
"""``error_message`` of the replies ControlServer.send_command makes up for lost jobs."""
MANAGED_ACTIONS: Final = (
    "lower_parallelism",
    "raise_parallelism",
    "restart_worker",
    "restart_study",
    "place_on_idle_gpu",
)
"""Actions carried out on managed jobs through a :class:`ManagedJobs` backend."""
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
        source: str | None = None,
    ) -> list[Reply]: ...


class ManagedJobs(Protocol):
    """What the actuator needs for the managed-job actions (:data:`MANAGED_ACTIONS`).

    Each method carries out one decision and returns the outcome's detail (one line);
    it raises :class:`~gpuwatchd.errors.ActionRefused` when the present state forbids the
    action (outcome ``refused``) and any other exception when it failed (``failed``).
    """

    async def set_parallelism(self, job: str, to: int, mode: str) -> str: ...

    async def restart_worker(self, decision: Decision) -> str: ...

    async def restart_study(self, decision: Decision) -> str: ...

    async def place_next(self, job: str, gpu_index: int) -> str: ...


GPU_ACTIONS: Final = ("cordon_gpu", "uncordon_gpu")
"""Actions carried out on the GPU cordons through a :class:`GpuCordoning` backend."""


class GpuCordoning(Protocol):
    """What the actuator needs for ``cordon_gpu``/``uncordon_gpu``
    (:class:`gpuwatchd.cordon.CordonActions`)."""

    async def carry_out(self, decision: Decision) -> str: ...

    def is_cordoned(self, index: int) -> bool: ...


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


def _is_hold(decision: Decision) -> bool:
    """A ``tune_loader`` decision that keeps the value (a hold): nothing to send."""
    params = decision.params
    return decision.action == "tune_loader" and params.get("value") == params.get("previous")


# -- the actuator ---------------------------------------------------------------------------


class Actuator:
    """Carries out decisions; ``apply`` never blocks the tick and never raises for a bad target.

    ``commander`` is the control server; ``logger`` a structlog logger; ``clock`` gives
    seconds (the daemon's wall clock). ``set_knob`` commands wait up to ``ack_timeout_s``
    (default 10 minutes: a job applies DataLoader knobs at its next epoch) for the job.
    ``managed`` carries out the managed-job actions (:data:`MANAGED_ACTIONS`); ``None``
    makes them fail (no ``jobs:`` configured). ``gpus`` carries out ``cordon_gpu`` and
    ``uncordon_gpu`` (:data:`GPU_ACTIONS`) and refuses ``place_on_idle_gpu`` on a cordoned
    GPU; ``None`` makes them fail. ``on_outcome`` receives every record whose
    outcome became known after :meth:`plan` (the daemon journals it). ``holds`` are the
    operator's overrides (:mod:`gpuwatchd.policy.holds`): a knob decision on a held knob
    is refused, naming the operator.
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
    ) -> None:
        self._commander = commander
        self._gpus = gpus
        self._holds = holds
        self._log = logger
        self._clock = clock
        self._ack_timeout_s = ack_timeout_s
        self._on_outcome = on_outcome
        self._managed = managed
        self._tasks: set[asyncio.Task[None]] = set()

    def plan(self, decision: Decision) -> DecisionRecord:
        """The record of ``decision`` before acting: its outcome if already known, else pending.

        ``dry-run`` for a dry-run decision, ``logged`` for ``log``, ``pending`` for
        ``set_knob``, ``exec`` and (with a ``managed`` backend) the managed-job actions,
        ``failed`` for an action without an actuator, ``refused`` for a ``set_knob`` or
        ``tune_loader`` move on a knob an operator holds (the detail names the
        operator's change). No side effects.
        """
        now = self._clock()
        if decision.dry_run:
            return DecisionRecord(decision, "dry-run", finished_at_s=now)
        if decision.action == "log" or _is_hold(decision):
            return DecisionRecord(decision, "logged", finished_at_s=now)
        if decision.action in ("set_knob", "tune_loader") and self._holds is not None:
            held = self._holds.active(decision.job, str(decision.params.get("knob")))
            if held is not None:
                return DecisionRecord(
                    decision, "refused", detail=held.describe(), finished_at_s=now
                )
        if decision.action in ("set_knob", "exec", "notify", "tune_loader"):
            return DecisionRecord(decision, "pending")
        if decision.action in GPU_ACTIONS:
            if self._gpus is None:
                return DecisionRecord(
                    decision, "failed", detail="no GPU cordons here", finished_at_s=now
                )
            return DecisionRecord(decision, "pending")
        if decision.action in MANAGED_ACTIONS:
            if self._managed is None:
                return DecisionRecord(
                    decision,
                    "failed",
                    detail="no managed jobs (the config has no jobs:)",
                    finished_at_s=now,
                )
            return DecisionRecord(decision, "pending")
        return DecisionRecord(
            decision,
            "failed",
            detail=f"action {decision.action!r} has no actuator",
            finished_at_s=now,
        )

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
            knob = decision.action in ("set_knob", "tune_loader")
            work = self._set_knob(record) if knob else self._act(record)
            task = asyncio.get_running_loop().create_task(work)
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

    async def _set_knob(self, record: DecisionRecord) -> None:
        decision = record.decision
        params = {"knob": decision.params["knob"], "value": decision.params["value"]}
        job = decision.job or ""
        try:
            replies = await self._commander.send_command(
                job,
                Op.SET_KNOB,
                params,
                timeout_s=self._ack_timeout_s,
                source=policy_source(decision.policy),
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
                record.detail = "; ".join(
                    f"request {r.id}: {r.error_code}: {r.error_message}" for r in failed
                )
            else:
                record.outcome = "applied"
                record.detail = "request " + ", ".join(str(r.id) for r in replies)
        record.finished_at_s = self._clock()
        log = self._log.info if record.outcome == "applied" else self._log.warning
        log(
            "knob " + record.outcome,
            policy=decision.policy,
            action=decision.action,
            job=job,
            knob=params["knob"],
            value=params["value"],
            detail=record.detail or None,
            decision_id=record.journal_id,
        )
        self._report(record)

    async def _act(self, record: DecisionRecord) -> None:
        """Carry out an ``exec`` or managed-job decision; set its outcome and report it."""
        decision = record.decision
        try:
            record.outcome, record.detail = await self._carry_out(decision)
        except ActionRefused as exc:
            record.outcome, record.detail = "refused", exc.message
        except asyncio.CancelledError:
            record.outcome, record.detail = "failed", "cancelled: the daemon stopped"
            record.finished_at_s = self._clock()
            self._report(record)
            raise
        except GpuwatchError as exc:
            record.outcome, record.detail = "failed", str(exc)
        except Exception as exc:
            record.outcome, record.detail = "failed", f"{type(exc).__name__}: {exc}"
        record.finished_at_s = self._clock()
        log = self._log.info if record.outcome == "applied" else self._log.warning
        log(
            "action " + record.outcome,
            detail=record.detail or None,
            **_fields(decision, record.journal_id),
        )
        self._report(record)

    async def _carry_out(self, decision: Decision) -> tuple[str, str]:
        params = decision.params
        action = decision.action
        if action == "exec":
            argv = params.get("argv")
            if not isinstance(argv, (list, tuple)) or not argv:
                return "failed", "exec needs a non-empty argv list"
            timeout = params.get("timeout_s", 30.0)
            timeout_s = float(timeout) if isinstance(timeout, (int, float)) else 30.0
            result = await run_exec([str(a) for a in argv], timeout_s)
            return ("applied" if result.ok else "failed"), result.describe()
        if action == "notify":
            from gpuwatchd.notify import send_notification

            urls = params.get("urls")
            if not isinstance(urls, (list, tuple)) or not urls:
                return "failed", "notify needs a non-empty urls list"
            timeout = params.get("timeout_s", 10.0)
            sent, detail = await send_notification(
                [str(u) for u in urls],
                str(params.get("title") or decision.policy),
                str(params.get("message") or decision.reason),
                float(timeout) if isinstance(timeout, (int, float)) else 10.0,
            )
            return ("applied" if sent else "failed"), detail
        if action in GPU_ACTIONS:
            if self._gpus is None:
                return "failed", "no GPU cordons here"
            return "applied", await self._gpus.carry_out(decision)
        managed = self._managed
        if managed is None:  # plan() failed these already; a direct start() lands here
            return "failed", "no managed jobs (the config has no jobs:)"
        job = str(params.get("job") or decision.job or "")
        if action in ("lower_parallelism", "raise_parallelism"):
            to = params.get("to")
            if isinstance(to, bool) or not isinstance(to, int):
                return "failed", f"decision without an integer 'to': {to!r}"
            mode = str(params.get("mode", "drain" if action == "lower_parallelism" else "now"))
            return "applied", await managed.set_parallelism(job, to, mode)
        if action == "restart_worker":
            return "applied", await managed.restart_worker(decision)
        if action == "restart_study":
            return "applied", await managed.restart_study(decision)
        if action == "place_on_idle_gpu":
            gpu = params.get("gpu_index")
            if isinstance(gpu, bool) or not isinstance(gpu, int):
                return "failed", f"decision without a GPU index: {gpu!r}"
            if self._gpus is not None and self._gpus.is_cordoned(gpu):
                raise ActionRefused(f"GPU {gpu} is cordoned; no worker is placed on it")
            return "applied", await managed.place_next(job, gpu)
        return "failed", f"action {action!r} has no actuator"

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
