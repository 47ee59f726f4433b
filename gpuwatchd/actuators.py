"""Actuators: carry out the policy engine's decisions and record their outcome.

Actions and what carries them out:

==========================  ===============================================================
``log``                     a structured log line (outcome ``logged`` at once)
``set_knob``                a ``set_knob`` command over the control socket to the job's hook,
                            ``applied`` when the job has applied it (e.g. at its next epoch)
``exec``                    ``asyncio.create_subprocess_exec(*argv)``: never a shell, stdin
                            ``/dev/null``, its own session; ``applied`` on exit status 0,
                            ``failed`` otherwise or after ``timeout_s`` (the process group
                            is killed); the tails of stdout and stderr go into the detail
``lower_parallelism``,      :meth:`gpuwatchd.supervisor.Supervisor.set_parallelism` with the
``raise_parallelism``       decision's ``to`` and ``mode`` (``drain`` waits until the worker
                            has finished its trial and left)
``restart_worker``          makes sure the crashed worker is relaunched: the supervisor
                            relaunches every crashed worker itself with the job's ``restart:``
                            backoff and budget; ``refused`` when it will not (budget spent,
                            crash loop), since a policy must not defeat the crash-loop guard
``restart_study``           the crashed worker's Optuna trial: ``FAIL`` (if still RUNNING)
                            and its params re-enqueued up to the action's ``max_retries``
                            (:func:`gpuwatchd.study.fail_and_requeue`, idempotent, lineage in
                            ``user_attrs``), then as ``restart_worker``; ``applied`` when the
                            study part was done
``place_on_idle_gpu``       :meth:`~gpuwatchd.supervisor.Supervisor.place_next`: the job's
                            next worker start goes to that GPU
==========================  ===============================================================

A decision marked ``dry_run`` (per policy, ``--dry-run`` or ``gpuwatchctl pause``) is only
logged. The managed-job actions need a :class:`ManagedJobs` backend (the daemon gives
:class:`SupervisorActions` when the config has ``jobs:``); without one they fail.

Two steps, so the daemon can journal a decision *before* anything happens (write-ahead):
:meth:`Actuator.plan` returns the :class:`DecisionRecord` with the outcome when it is known
before acting (``logged``, ``dry-run``, ``failed`` for an action without an actuator) or
``pending``; :meth:`Actuator.start` then acts. An outcome that arrives later updates the
record in place and is passed to the ``on_outcome`` callback (the daemon journals it).
:meth:`Actuator.apply` does both. A decision is started once per process; a daemon killed
after journaling it finds it ``unknown`` and never starts it again.

Optuna storages are only touched from threads (:func:`asyncio.to_thread`), one operation
at a time per storage URL (:class:`StudyRecovery`), so two recoveries of one dead trial
never race each other into two retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from gpuwatchd.config import JobConfig, OptunaConfig
from gpuwatchd.control.protocol import Reply
from gpuwatchd.crash import signal_of
from gpuwatchd.errors import ActionRefused, ControlError, GpuwatchError, StudyError
from gpuwatchd.model import Decision
from gpuwatchd.systemd import strip_notify_env

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.study import RequeueResult
    from gpuwatchd.supervisor import Supervisor, WorkerCrash, WorkerInfo

__all__ = [
    "EXEC_TAIL_CHARS",
    "MANAGED_ACTIONS",
    "Actuator",
    "DecisionRecord",
    "ExecResult",
    "JobCommander",
    "ManagedJobs",
    "StudyRecovery",
    "SupervisorActions",
    "describe_requeue",
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
            "params": dict(d.params),
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

    ``commander`` is the control server; ``logger`` a structlog logger; ``clock`` gives
    seconds (the daemon's wall clock). ``set_knob`` commands wait up to ``ack_timeout_s``
    (default 10 minutes: a job applies DataLoader knobs at its next epoch) for the job.
    ``managed`` carries out the managed-job actions (:data:`MANAGED_ACTIONS`); ``None``
    makes them fail (no ``jobs:`` configured). ``on_outcome`` receives every record whose
    outcome became known after :meth:`plan` (the daemon journals it).
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
    ) -> None:
        self._commander = commander
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
        ``failed`` for an action without an actuator. No side effects.
        """
        now = self._clock()
        if decision.dry_run:
            return DecisionRecord(decision, "dry-run", finished_at_s=now)
        if decision.action == "log":
            return DecisionRecord(decision, "logged", finished_at_s=now)
        if decision.action in ("set_knob", "exec"):
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
            self._log.info("decision", dry_run=True, params=dict(decision.params), **fields)
        elif record.outcome == "logged":
            level = str(decision.params.get("level", "info"))
            emit = getattr(self._log, level if level in _LOG_LEVELS else "info")
            emit("policy", message=decision.params.get("message", ""), **fields)
        elif record.outcome == "pending":
            self._log.info("decision", params=dict(decision.params), **fields)
            work = self._set_knob(record) if decision.action == "set_knob" else self._act(record)
            task = asyncio.get_running_loop().create_task(work)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._log.warning(
                "decision not carried out",
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


# -- Optuna study recovery ------------------------------------------------------------------


class StudyRecovery:
    """Runs :mod:`gpuwatchd.study` recoveries in threads, one at a time per storage URL.

    :meth:`fail_and_requeue` for trials whose number is known; :meth:`request_sweep` for a
    crashed worker whose trial is unknown: when the job's ``optuna.grace_period`` is set
    (its workers record heartbeats), :func:`gpuwatchd.study.fail_stale_trials` runs once
    the dead worker's last heartbeat is older than the grace period (a grace period and a
    second after the request; requests meanwhile are folded into one later sweep).
    ``logger``: a structlog-style logger. :meth:`close` cancels pending sweeps.
    """

    def __init__(self, logger: Any) -> None:
        self._log = logger
        self._locks: dict[str, asyncio.Lock] = {}
        self._sweep_due: dict[str, float] = {}
        self._sweeps: dict[str, asyncio.Task[None]] = {}

    def _lock(self, storage: str) -> asyncio.Lock:
        lock = self._locks.get(storage)
        if lock is None:
            lock = self._locks[storage] = asyncio.Lock()
        return lock

    async def fail_and_requeue(
        self, optuna: OptunaConfig, trials: Sequence[int], *, max_retries: int, reason: str
    ) -> list[RequeueResult]:
        """:func:`gpuwatchd.study.fail_and_requeue` in a thread, serialised per storage.

        Raises :class:`~gpuwatchd.errors.StudyError` (storage or study unusable) and
        ValueError for a negative ``max_retries``.
        """
        from gpuwatchd.study import fail_and_requeue

        async with self._lock(optuna.storage):
            return await asyncio.to_thread(
                fail_and_requeue,
                optuna.storage,
                optuna.study,
                list(trials),
                max_retries=max_retries,
                reason=reason,
            )

    async def trials_of_worker(
        self, optuna: OptunaConfig, worker_id: str
    ) -> tuple[int, ...] | None:
        """:func:`gpuwatchd.study.trials_of_worker` in a thread; raises StudyError likewise."""
        from gpuwatchd.study import trials_of_worker

        async with self._lock(optuna.storage):
            return await asyncio.to_thread(
                trials_of_worker, optuna.storage, optuna.study, worker_id
            )

    async def fail_stale(self, job: str, optuna: OptunaConfig) -> list[RequeueResult]:
        """:func:`gpuwatchd.study.fail_stale_trials` now (``optuna.grace_period`` must be set).

        Retries get ``optuna.max_retries``; raises StudyError like :meth:`fail_and_requeue`.
        """
        from gpuwatchd.study import fail_stale_trials

        if optuna.grace_period_s is None:
            raise StudyError(f"job {job!r}: optuna.grace_period is not set (no heartbeats)")
        async with self._lock(optuna.storage):
            return await asyncio.to_thread(
                fail_stale_trials,
                optuna.storage,
                optuna.study,
                max_retries=optuna.max_retries,
                grace_period_s=optuna.grace_period_s,
            )

    def request_sweep(self, job: str, optuna: OptunaConfig) -> bool:
        """Schedule a stale-trial sweep for ``job`` (see the class docstring).

        Returns False (and does nothing) when the job has no ``optuna.grace_period``.
        Must run on the event loop.
        """
        grace = optuna.grace_period_s
        if grace is None:
            return False
        due = time.monotonic() + grace + _STALE_SWEEP_MARGIN_S
        self._sweep_due[job] = max(due, self._sweep_due.get(job, 0.0))
        task = self._sweeps.get(job)
        if task is None or task.done():
            self._sweeps[job] = asyncio.get_running_loop().create_task(
                self._sweep_loop(job, optuna), name=f"gpuwatchd-sweep-{job}"
            )
        return True

    async def _sweep_loop(self, job: str, optuna: OptunaConfig) -> None:
        while True:
            due = self._sweep_due.get(job, 0.0)
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            started = time.monotonic()
            try:
                results = await self.fail_stale(job, optuna)
            except Exception as exc:
                self._log.error(
                    "stale trial sweep failed", job=job, error=f"{type(exc).__name__}: {exc}"
                )
            else:
                for result in results:
                    self._log.warning(
                        "stale trial failed",
                        job=job,
                        trial=result.trial_number,
                        outcome=result.outcome,
                        requeued_as=result.requeued_as,
                        retry=result.retry,
                    )
                if not results:
                    self._log.info("stale trial sweep: none stale", job=job)
            if self._sweep_due.get(job, 0.0) <= started:
                self._sweep_due.pop(job, None)
                return

    async def close(self) -> None:
        """Cancel the pending sweeps."""
        tasks = [t for t in self._sweeps.values() if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._sweeps.clear()


def describe_requeue(result: RequeueResult, max_retries: int) -> str:
    """One phrase for a :class:`~gpuwatchd.study.RequeueResult` (logs and outcome details)."""
    n = result.trial_number
    failed = " marked FAIL," if result.failed_now else ""
    if result.outcome == "requeued":
        return (
            f"trial {n}{failed} re-enqueued as trial {result.requeued_as} "
            f"(retry {result.retry}/{max_retries})"
        )
    if result.outcome == "already_requeued":
        return f"trial {n}{failed} already re-enqueued as trial {result.requeued_as}"
    if result.outcome == "retries_exhausted":
        return f"trial {n}{failed} not re-enqueued: its chain has {max_retries} retries"
    if result.outcome == "not_running":
        return f"trial {n} was {result.state_before}: left alone"
    return f"trial {n}: no such trial in the study"


# -- the managed-job backend ----------------------------------------------------------------


class SupervisorActions:
    """The :class:`ManagedJobs` backend over a :class:`~gpuwatchd.supervisor.Supervisor`.

    ``jobs``: the configured jobs (for their ``optuna:``); ``study``: the
    :class:`StudyRecovery`; ``logger``: structlog-style. The daemon passes every
    :class:`~gpuwatchd.supervisor.WorkerCrash` to :meth:`handle_crash` (its ``on_crash``),
    which remembers it (a restart decision names the crashed pid; the worker slot and
    trial come from here) and fails the dead trial at once.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        jobs: Sequence[JobConfig],
        study: StudyRecovery,
        logger: Any,
    ) -> None:
        self._supervisor = supervisor
        self._jobs = {job.name: job for job in jobs}
        self._study = study
        self._log = logger
        self._crashes: OrderedDict[tuple[str, int], WorkerCrash] = OrderedDict()
        self._busy: dict[str, int] = {}

    # -- crashes ------------------------------------------------------------------------

    def remember(self, crash: WorkerCrash) -> None:
        """Remember ``crash`` for the restart decisions that will name its pid."""
        key = (crash.job, crash.pid)
        self._crashes[key] = crash
        self._crashes.move_to_end(key)
        while len(self._crashes) > _CRASHES_KEPT:
            self._crashes.popitem(last=False)

    def crash_of(self, job: str, pid: int) -> WorkerCrash | None:
        """The remembered crash of ``job``'s worker ``pid``, if any."""
        return self._crashes.get((job, pid))

    async def locate_trial(self, crash: WorkerCrash) -> WorkerCrash:
        """``crash`` with the trial its worker died in, as the Optuna storage tells it.

        The worker's trials carry its launch id (``gpuwatchd:worker_id``, written by the
        hook): :func:`gpuwatchd.study.trials_of_worker` names the trial it died in even
        when no daemon heard the worker (killed and restarted meanwhile, the hook not
        reconnected yet), where the hook's last word or ``workers.json`` may name an older
        trial. The newest such trial becomes ``trial_number`` (the one the
        ``restart_study`` policy retries); any other RUNNING trial of the same worker
        (``n_jobs > 1``) is marked FAIL here, as :meth:`handle_crash` does (re-enqueued
        with the job's ``optuna.max_retries`` only when the daemon stopped the worker
        itself). When the storage names no trial of the worker still open, or cannot be
        read (logged), ``crash`` is returned unchanged. Never raises.
        """
        cfg = self._jobs.get(crash.job)
        if cfg is None or cfg.optuna is None or crash.worker_id is None:
            return crash
        optuna = cfg.optuna
        try:
            found = await self._study.trials_of_worker(optuna, crash.worker_id)
        except Exception as exc:  # never lose the crash over a lookup
            self._log.error(
                "cannot read the crashed worker's trials",
                job=crash.job,
                pid=crash.pid,
                worker_id=crash.worker_id,
                error=f"{type(exc).__name__}: {exc}",
            )
            return crash
        if not found:
            # None: no trial names the worker; (): its trials all ended. Either way the
            # hook's word stands (its set_user_attr may have failed; a finished trial is
            # left alone by the recovery, which then asks for a stale-trial sweep).
            return crash
        trial = found[-1]
        if trial != crash.trial_number:
            self._log.info(
                "crashed trial from the study",
                job=crash.job,
                pid=crash.pid,
                worker_id=crash.worker_id,
                trial=trial,
                previous=crash.trial_number,
            )
        if len(found) > 1:
            reason = "stopped" if crash.intentional else crash.crash_info.kind
            retries = optuna.max_retries if crash.intentional else 0
            try:
                results = await self._study.fail_and_requeue(
                    optuna, found[:-1], max_retries=retries, reason=reason
                )
            except Exception as exc:
                self._log.error(
                    "cannot fail the crashed worker's other trials",
                    job=crash.job,
                    pid=crash.pid,
                    error=f"{type(exc).__name__}: {exc}",
                )
            else:
                for result in results:
                    self._log.info(
                        "crashed worker's other trial recovered",
                        job=crash.job,
                        pid=crash.pid,
                        detail=describe_requeue(result, retries),
                    )
        return dataclasses.replace(crash, trial_number=trial)

    def is_crashed_worker(self, pid: int) -> bool:
        """True when ``pid`` is a managed worker whose end the supervisor reported."""
        return any(key[1] == pid for key in self._crashes)

    async def handle_crash(self, crash: WorkerCrash) -> str:
        """Fail the Optuna trial a dead worker left behind; returns what was done (one line).

        A crash (``intentional=False``): the trial the worker ran is marked ``FAIL`` if it
        is still ``RUNNING`` (``max_retries=0``: the retry is the ``restart_study``
        policy's decision, with its own ``max_retries``). A worker the daemon stopped
        itself (``intentional=True``: ``lower_parallelism`` with ``mode: now``, a daemon
        stop): its trial is failed and re-enqueued up to the job's ``optuna.max_retries``
        (the trial was not at fault). When the trial number is unknown, or the trial it
        names had already ended COMPLETE or PRUNED (the worker had started a trial the
        hook had not reported yet), a stale-trial sweep is requested (needs
        ``optuna.grace_period``). Never raises: a storage error is logged and returned.
        """
        self.remember(crash)
        cfg = self._jobs.get(crash.job)
        if cfg is None or cfg.optuna is None:
            return "no optuna study configured"
        optuna = cfg.optuna
        reason = "stopped" if crash.intentional else crash.crash_info.kind
        retries = optuna.max_retries if crash.intentional else 0
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
            if not crash.intentional and result.outcome == "retries_exhausted":
                detail = f"trial {result.trial_number}" + (
                    " marked FAIL" if result.failed_now else " is FAIL"
                )
            self._log.info(
                "crashed worker's trial recovered",
                job=crash.job,
                pid=crash.pid,
                worker=crash.worker,
                trial=crash.trial_number,
                outcome=result.outcome,
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
        return job, pid, self.crash_of(job, pid)

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
        re-enqueued. :func:`gpuwatchd.study.fail_and_requeue` is idempotent (a retry of
        the trial is looked up before one is enqueued), so running it again finishes the
        decision without repeating it. The worker was relaunched by the supervisor
        meanwhile. Raises StudyError, ValueError or ActionRefused as :meth:`restart_study`.
        """
        job, _pid, crash = self._slot(decision)
        return await self._requeue(decision, job, crash)

    async def _requeue(self, decision: Decision, job: str, crash: WorkerCrash | None) -> str:
        params = decision.params
        max_retries = params.get("max_retries", 3)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int):
            max_retries = 3
        trial = params.get("trial_number")
        if not isinstance(trial, int) or isinstance(trial, bool):
            trial = crash.trial_number if crash is not None else None
        cfg = self._jobs.get(job)
        if cfg is None or cfg.optuna is None:
            return "no optuna study configured for the job"
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
