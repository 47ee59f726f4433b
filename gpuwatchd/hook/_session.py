"""The watch's side of the daemon session: the ``hello`` and ``report`` it sends, the
``set_knob``/``drain``/``stop`` it answers, and the acknowledgements once applied.

:class:`DaemonSession` is a base of :class:`~gpuwatchd.hook.Watch` (the state is the
watch's); the connection thread calls it through
:class:`gpuwatchd.hook._connection.Session`. Threading: docs/hook-internals.md.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Final

from gpuwatchd.control.messages import slurm_identity
from gpuwatchd.control.protocol import (
    TRIAL_ATTR_WORKER_ID,
    WORKER_ID_ENV,
    ErrorCode,
    Request,
    command_source,
    error_reply,
    ok_reply,
    request,
)
from gpuwatchd.errors import KnobError
from gpuwatchd.hook._connection import Connection
from gpuwatchd.hook._cuda import cuda_memory
from gpuwatchd.hook._host import Command, KnobChange
from gpuwatchd.hook._knobs import KnobSpec, check_value, divisors
from gpuwatchd.hook._stats import StepRecord, summarize
from gpuwatchd.model import KnobValue

__all__ = [
    "BATCH_SIZE",
    "DaemonSession",
    "mark_worker",
    "study_name",
    "trial_info",
    "trial_number",
]

logger = logging.getLogger("gpuwatchd.hook")

_REFUSED_KNOB: Final = re.compile(r"\bknob '([^']{1,128})'")
"""The knob a daemon's ``bad_request`` reply to ``hello`` names (its messages say
``knob 'NAME' ...``: :func:`gpuwatchd.control.messages.parse_knobs`)."""

BATCH_SIZE: Final = "batch_size"


def _json_plain(value: object) -> object:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    return str(value)


def trial_info(trial: object) -> dict[str, Any] | None:
    if trial is None:
        return None
    number = getattr(trial, "number", None)
    try:
        params = dict(getattr(trial, "params", None) or {})
    except Exception:  # a live Optuna trial being changed by the training thread
        params = {}
    return {
        "number": number if isinstance(number, int) and not isinstance(number, bool) else None,
        "params": {str(k): _json_plain(v) for k, v in params.items()},
    }


def trial_number(trial: object) -> int | None:
    number = getattr(trial, "number", None)
    return number if isinstance(number, int) and not isinstance(number, bool) else None


def study_name(study: str | None, trial: object) -> str | None:
    if study is not None:
        return study
    name = getattr(getattr(trial, "study", None), "study_name", None)
    return name if isinstance(name, str) else None


def mark_worker(trial: object) -> None:
    """Write ``$GPUWATCHD_WORKER_ID`` into the trial's ``gpuwatchd:worker_id`` user attr.

    Only in a worker the daemon launched (the variable is set) and for a trial with
    Optuna's ``set_user_attr``. It is one storage write per trial, made whether or not
    the daemon is reachable: the daemon reads it back when the worker dies, even when
    it was down at the time (:func:`gpuwatchd.jobs.study.trials_of_worker`). A storage error
    here is logged and the trial goes on.
    """
    worker_id = os.environ.get(WORKER_ID_ENV)
    set_user_attr = getattr(trial, "set_user_attr", None)
    if not worker_id or not callable(set_user_attr):
        return
    try:
        set_user_attr(TRIAL_ATTR_WORKER_ID, worker_id)
    except Exception:
        logger.warning("gpuwatchd: cannot record the worker id on the trial", exc_info=True)


class DaemonSession:
    """The daemon-facing methods of :class:`~gpuwatchd.hook.Watch` (see the module doc).

    The attributes are the watch's, set in ``Watch.__init__``; the public methods here
    implement :class:`gpuwatchd.hook._connection.Session` (background thread), the
    private ones are called on the training thread at safe points.
    """

    job: str
    stop_requested: bool
    stop_reason: str | None
    drain_requested: bool
    _specs: dict[str, KnobSpec]
    _refused_knobs: set[str]
    _current: dict[str, KnobValue]
    _trial: object
    _trial_sent: dict[str, Any] | None
    _trial_scoped: bool
    _study: str | None
    _cuda_devices: list[str]
    _effective: int | None
    _on_stop: list[Callable[[str | None], object]]
    _lock: threading.Lock
    _pending: dict[str, KnobChange]
    _applying: bool
    _outbox: deque[tuple[int, dict[str, Any]]]
    _events: deque[dict[str, Any]]
    _records: deque[StepRecord]
    _steps_total: int
    _epoch: int
    _oom_events: int
    _stops: list[Command]
    _drains: list[Command]
    _stop_applied: bool
    _drain_applied: bool
    _attention: bool
    _connection: Connection

    def _run_on_stop(self) -> str | None:
        errors: list[str] = []
        for callback in list(self._on_stop):
            try:
                callback(self.stop_reason)
            except Exception as exc:
                logger.exception("gpuwatchd: the on_stop callback failed; stopping all the same")
                errors.append(f"{type(exc).__name__}: {exc}")
        return "; ".join(errors) or None

    def _apply_stop(self, at: str) -> None:
        """Apply a requested stop now: ``on_stop`` (the first time), then the acks."""
        with self._lock:
            self._attention = False
            stops = self._stops
            self._stops = []
        if stops or self.stop_requested:
            first = not self._stop_applied
            self._stop_applied = True
            error = self._run_on_stop() if first else None
            self._send_stop_acks(stops, at, error)

    def _send_stop_acks(self, stops: Iterable[Command], at: str, error: str | None) -> None:
        number = trial_number(self._trial) if self._trial_scoped else None
        sent = False
        for command in stops:
            result: dict[str, Any] = {"stopped": True, "at": at, "reason": self.stop_reason}
            if number is not None:
                result["pruned_trial"] = number
            if error is not None:
                result["callback_error"] = error
            self._outbox.append((command.generation, ok_reply(command.request_id, result)))
            sent = True
        if sent:
            logger.info("gpuwatchd: stop applied (%s)", at)
            self._connection.wake()

    def _ack_stops(self, at: str, error: str | None) -> None:
        with self._lock:
            stops = self._stops
            self._stops = []
            self._attention = False
        if stops:
            self._stop_applied = True
            self._send_stop_acks(stops, at, error)

    def _ack_drains(self, at: str) -> None:
        with self._lock:
            drains = self._drains
            self._drains = []
        if self.drain_requested:
            self._drain_applied = True
        if not drains:
            return
        result: dict[str, Any] = {"drained": True, "at": at, "epoch": self._epoch}
        number = trial_number(self._trial)
        if number is not None:
            result["trial"] = number
        for command in drains:
            self._outbox.append((command.generation, ok_reply(command.request_id, result)))
        logger.info("gpuwatchd: drain applied (%s)", at)
        self._connection.wake()

    def _stop_exception(self) -> BaseException | None:
        """Inside a trial with optuna imported: the ``TrialPruned`` a stop raises."""
        if not self._trial_scoped:
            return None
        optuna = sys.modules.get("optuna")
        pruned = getattr(optuna, "TrialPruned", None) if optuna is not None else None
        if not isinstance(pruned, type):
            return None
        exc: BaseException = pruned(f"stopped by gpuwatchd: {self.stop_reason or 'no reason'}")
        return exc

    def _take_pending(self) -> tuple[dict[str, Any], list[KnobChange]] | None:
        with self._lock:
            if not self._pending:
                return None
            changes = list(self._pending.values())
            self._pending.clear()
            self._applying = True
        knobs: dict[str, Any] = dict(self._current)
        for change in changes:
            knobs[change.knob] = change.value
        return knobs, changes

    def _commit(self, knobs: dict[str, Any], changes: Iterable[KnobChange]) -> None:
        with self._lock:
            previous = self._current
            self._current = dict(knobs)  # one reference swap: readers see old or new, never a mix
            self._applying = False
        for change in changes:
            result = {
                "knob": change.knob,
                "value": change.value,
                "previous": previous[change.knob],
                "applied": True,
            }
            if change.request_id is not None:
                self._outbox.append((change.generation, ok_reply(change.request_id, result)))
            logger.info(
                "gpuwatchd: applied %s=%r (was %r)",
                change.knob,
                change.value,
                previous[change.knob],
            )
        self._connection.wake()

    def _reject(self, changes: Iterable[KnobChange], reason: str) -> None:
        with self._lock:
            self._applying = False
        for change in changes:
            message = (
                f"{change.knob}={change.value!r} not applied: {reason}; "
                f"kept {change.knob}={self._current[change.knob]!r}"
            )
            if change.request_id is None:
                logger.warning("gpuwatchd: the daemon's remembered %s", message)
                continue
            reply = error_reply(change.request_id, ErrorCode.BAD_REQUEST, message)
            self._outbox.append((change.generation, reply))
        self._connection.wake()

    def hello_message(self, request_id: int) -> dict[str, Any]:
        """The ``hello`` request of protocol v1 with the current knob values and trial."""
        current = self._current
        trial = trial_info(self._trial)
        self._trial_sent = trial
        return request(
            request_id,
            "hello",
            role="job",
            job=self.job,
            pid=os.getpid(),
            cuda_devices=list(self._cuda_devices),
            knobs={
                name: spec.as_hello(current[name])
                for name, spec in self._specs.items()
                if name not in self._refused_knobs
            },
            study=study_name(self._study, self._trial),
            trial=trial,
            **_slurm_field(),
        )

    def hello_refused(self, code: str | None, message: str | None) -> bool:
        """The daemon refused ``hello``: when its message names a declared knob
        (``knob 'NAME' ...``, :func:`gpuwatchd.control.messages.parse_knobs`), leave that
        knob out of the next ``hello`` and say so (the job is then watched with the knobs
        the daemon accepts; the dropped one is still the job's, not tunable by the
        daemon). Returns whether a knob was dropped (False: nothing left to drop)."""
        found = _REFUSED_KNOB.search(message or "") if code == ErrorCode.BAD_REQUEST else None
        name = found.group(1) if found else None
        if name is None or name not in self._specs or name in self._refused_knobs:
            return False
        self._refused_knobs.add(name)
        logger.warning(
            "gpuwatchd: the daemon refused knob %r (%s); attaching without it",
            name,
            message,
        )
        return True

    def hello_accepted(self, result: dict[str, Any]) -> None:
        """Take the knob values the daemon remembers for this job (``result["knobs"]``,
        ``{name: value}``; what a policy or an operator applied to the job's earlier
        processes): each is checked like a ``set_knob`` (declared, kind, bounds) and
        becomes a pending change, applied before the first loader is built or at the
        next epoch start. A value refused is logged with the reason and not applied."""
        knobs = result.get("knobs")
        if not isinstance(knobs, dict):
            return
        for name, raw in knobs.items():
            spec = self._specs.get(name) if isinstance(name, str) else None
            if spec is None:
                logger.warning("gpuwatchd: the daemon's remembered knob %r is not declared", name)
                continue
            try:
                value = self._check_knob(spec, raw)
            except KnobError as exc:
                logger.warning("gpuwatchd: the daemon's remembered value refused: %s", exc.message)
                continue
            with self._lock:
                if name in self._pending or value == self._current[name]:
                    continue  # a newer set_knob, or nothing to change
                self._pending[name] = KnobChange(name, value, None, 0)
            logger.info("gpuwatchd: the daemon restores %s=%r (the job's last value)", name, value)

    def take_report(self) -> dict[str, Any] | None:
        """Drain the step records into one ``report`` object (None without steps).

        Beside :func:`gpuwatchd.hook._stats.summarize`'s fields: ``oom_events``,
        ``knobs`` (current values), ``cuda_memory`` (see
        :func:`gpuwatchd.hook._cuda.cuda_memory`) and ``trial`` when it changed.
        """
        records: list[StepRecord] = []
        pop = self._records.popleft
        try:
            while True:
                records.append(pop())
        except IndexError:
            pass
        report = summarize(records, self._steps_total)
        if report is None:
            return None
        report["oom_events"] = self._oom_events
        if self._current:
            report["knobs"] = dict(self._current)
        report["cuda_memory"] = cuda_memory()
        trial = trial_info(self._trial)
        if trial != self._trial_sent:
            report["trial"] = trial
            self._trial_sent = trial
        return report

    def take_events(self) -> list[dict[str, Any]]:
        """Job events queued for the daemon (kept across reconnects until taken)."""
        events: list[dict[str, Any]] = []
        pop = self._events.popleft
        try:
            while True:
                events.append(pop())
        except IndexError:
            pass
        return events

    def discard_records(self) -> None:
        """Forget steps recorded while disconnected."""
        self._records.clear()

    def take_replies(self, generation: int) -> list[dict[str, Any]]:
        """Replies the training thread queued for connection ``generation``."""
        replies: list[dict[str, Any]] = []
        pop = self._outbox.popleft
        try:
            while True:
                reply_generation, reply = pop()
                if reply_generation == generation:
                    replies.append(reply)
        except IndexError:
            pass
        return replies

    def connection_lost(self, generation: int) -> None:
        """Drop the knob changes asked by connection ``generation``: no one can be told.

        A ``drain`` or ``stop`` it sent stays in force (the job still ends); only its
        acknowledgement has no one to go to.
        """
        with self._lock:
            for name in [n for n, c in self._pending.items() if c.generation == generation]:
                logger.debug("gpuwatchd: dropped pending %s: its daemon connection is gone", name)
                del self._pending[name]
            self._stops = [c for c in self._stops if c.generation != generation]
            self._drains = [c for c in self._drains if c.generation != generation]

    def handle_request(self, message: Request, generation: int) -> list[dict[str, Any]]:
        """Answer a daemon request: ``set_knob`` (maybe deferred), ``drain``, ``stop``.

        ``drain`` and ``stop`` are acknowledged when applied; one that arrives after the
        job already applied the same command is acknowledged at once.
        """
        if message.op == "set_knob":
            return self._handle_set_knob(message, generation)
        if message.op == "drain":
            with self._lock:
                self.drain_requested = True
                deferred = not self._drain_applied
                if deferred:
                    self._drains.append(Command(message.id, generation))
            if not deferred:
                return [ok_reply(message.id, {"drained": True, "at": "before"})]
            logger.info("gpuwatchd: drain requested; ending after the current epoch or trial")
            return []
        if message.op == "stop":
            reason = message.params.get("reason")
            with self._lock:
                if not self.stop_requested:
                    self.stop_reason = reason if isinstance(reason, str) else None
                self.stop_requested = True
                deferred = not self._stop_applied
                if deferred:
                    self._stops.append(Command(message.id, generation))
                    self._attention = True
            if not deferred:
                result = {"stopped": True, "at": "before", "reason": self.stop_reason}
                return [ok_reply(message.id, result)]
            logger.info("gpuwatchd: stop requested (%s); ending at the next step", reason)
            return []
        return [
            error_reply(
                message.id,
                ErrorCode.UNKNOWN_OP,
                f"a job connection does not handle op {message.op!r} "
                "(it handles set_knob, drain, stop)",
            )
        ]

    def _check_knob(self, spec: KnobSpec, raw: object) -> KnobValue:
        value = check_value(spec, raw)
        effective = self._effective
        if spec.name == BATCH_SIZE and effective is not None and effective % int(value):
            fitting = divisors(effective)
            below = max((d for d in fitting if d < value), default=None)
            above = min((d for d in fitting if d > value), default=None)
            nearest = " and ".join(str(d) for d in (below, above) if d is not None)
            raise KnobError(
                f"knob 'batch_size': {value!r} does not divide the effective batch size "
                f"{effective} (gradient accumulation keeps it); nearest that do: {nearest}",
                knob=BATCH_SIZE,
            )
        return value

    def _handle_set_knob(self, message: Request, generation: int) -> list[dict[str, Any]]:
        name = message.params.get("knob")
        if not isinstance(name, str):
            return [error_reply(message.id, ErrorCode.BAD_REQUEST, "set_knob needs 'knob'")]
        if "value" not in message.params:
            return [error_reply(message.id, ErrorCode.BAD_REQUEST, "set_knob needs 'value'")]
        spec = self._specs.get(name)
        if spec is None:
            declared = ", ".join(sorted(self._specs)) or "none"
            text = f"unknown knob {name!r}: job {self.job!r} declares {declared}"
            return [error_reply(message.id, ErrorCode.BAD_REQUEST, text)]
        try:
            value = self._check_knob(spec, message.params["value"])
        except KnobError as exc:
            return [error_reply(message.id, ErrorCode.BAD_REQUEST, exc.message)]
        replies: list[dict[str, Any]] = []
        with self._lock:
            superseded = self._pending.pop(name, None)
            current = self._current[name]
            # While an epoch start is applying other changes, wait for the next one.
            applied_now = value == current and not self._applying
            if not applied_now:
                self._pending[name] = KnobChange(
                    name, value, message.id, generation, command_source(message.params)
                )
        if superseded is not None and superseded.request_id is not None:
            source = command_source(message.params)
            by = f"request {message.id!r}" if source is None else source
            text = f"superseded by {by} ({name}={_shown(value)}) before it was applied"
            replies.append(error_reply(superseded.request_id, ErrorCode.CONFLICT, text))
        if applied_now:
            result = {"knob": name, "value": value, "previous": current, "applied": True}
            replies.append(ok_reply(message.id, result))
        return replies


def _slurm_field() -> dict[str, Any]:
    """``{"slurm": ...}`` inside a Slurm job, else nothing (an older daemon ignores the key)."""
    found = slurm_identity(os.environ)
    return {} if found is None else {"slurm": found}


def _shown(value: KnobValue) -> str:
    """A knob value as a message shows it: ``2``, ``0.5``, ``true``."""
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)
