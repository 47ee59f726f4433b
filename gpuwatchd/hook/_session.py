"""The job's session with the daemon: the ``hello`` and ``report`` it sends, the
``set_knob``/``drain``/``stop`` it answers, and the acknowledgements once applied.

:class:`DaemonSession` holds that state (knob values, pending changes and commands,
step records, events, replies) and is a member of :class:`~gpuwatchd.hook.Watch`; the
connection thread calls it as a :class:`gpuwatchd.hook._connection.Session`.
Threading: docs/hook-internals.md.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal

from gpuwatchd.control.messages import slurm_identity
from gpuwatchd.control.protocol import (
    EVENT_MESSAGE_MAX_CHARS,
    TRIAL_ATTR_WORKER_ID,
    WORKER_ID_ENV,
    ErrorCode,
    Op,
    Request,
    command_source,
    error_reply,
    ok_reply,
    request,
)
from gpuwatchd.errors import KnobError
from gpuwatchd.hook._connection import Wakeup
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

BATCH_SIZE: Final = "batch_size"
RECORDS_MAX: Final = 16384
"""Step records kept between two reports; older ones are dropped when the thread lags."""
EVENTS_MAX: Final = 256
"""Job events (OOM, trial, crash) kept for the daemon, also across a reconnect; oldest dropped."""
OUTBOX_MAX: Final = 1024
"""Replies the training thread queued for the daemon and not sent yet; oldest dropped."""


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
    """The job's session with the daemon: what is sent, what was asked, what is applied.

    ``job``: the job's name; ``specs``: the declared knobs (their current values start at
    the declared ones); ``wakeup``: the hook thread's wake-up (woken when a reply or an
    event is queued); ``trial``/``study``/``cuda_devices``: what ``hello`` and reports
    carry; ``effective_batch_size``: samples per optimizer step, which a ``batch_size``
    must divide (None without a ``batch_size`` knob).

    The public methods of :class:`gpuwatchd.hook._connection.Session` run on the hook's
    thread; the others on the training thread at safe points. The two share the knob
    values (replaced whole, one reference swap), the pending changes and commands (under
    one lock) and bounded deques (records, events, replies).
    """

    def __init__(
        self,
        *,
        job: str,
        specs: Mapping[str, KnobSpec],
        wakeup: Wakeup,
        trial: object,
        study: str | None,
        cuda_devices: Iterable[str],
        effective_batch_size: int | None,
    ) -> None:
        self.job = job
        self.specs: Mapping[str, KnobSpec] = dict(specs)
        self.effective_batch_size = effective_batch_size
        self.trial = trial
        """The Optuna trial reported now (None between trials)."""
        self.trial_scoped = False
        """True inside :meth:`Watch.trial <gpuwatchd.hook.Watch.trial>`: a stop prunes it."""
        self.epoch = 0
        """0-based epoch of the primary loader, carried by each step record."""
        self.steps = 0
        """Training steps recorded since attach."""
        self.oom_events = 0
        """CUDA out-of-memory errors reported (:meth:`note_oom`)."""
        self.stop_requested = False
        self.stop_reason: str | None = None
        self.drain_requested = False
        self.stop_applied = False
        self.drain_applied = False
        self.attention = False
        """Read once per step by the loader: a ``stop`` waits for the next safe point."""
        self._wakeup = wakeup
        self._study = study
        self._cuda_devices = list(cuda_devices)
        self._dropped: set[str] = set()  # knobs the daemon's hello reply left out
        self._current: dict[str, KnobValue] = {n: s.value for n, s in self.specs.items()}
        self._trial_sent: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, KnobChange] = {}
        self._applying = False  # pending changes taken by an epoch start, not yet committed
        self._outbox: deque[tuple[int, dict[str, Any]]] = deque(maxlen=OUTBOX_MAX)
        self._events: deque[dict[str, Any]] = deque(maxlen=EVENTS_MAX)
        self._records: deque[StepRecord] = deque(maxlen=RECORDS_MAX)
        self._stops: list[Command] = []
        self._drains: list[Command] = []

    # -- training thread -------------------------------------------------------------------

    @property
    def current(self) -> Mapping[str, KnobValue]:
        """The applied knob values (replaced whole on each change; do not mutate)."""
        return self._current

    def pending_values(self) -> dict[str, KnobValue]:
        """The values of the changes asked for and not applied yet, ``{name: value}``."""
        with self._lock:
            return {name: change.value for name, change in self._pending.items()}

    def record_step(self, step_time_s: float, data_wait_s: float, samples: int) -> None:
        """One step: seconds of the whole step and of waiting for data, samples in it."""
        self.steps += 1
        self._records.append((step_time_s, data_wait_s, samples, self.epoch))

    def queue_event(
        self,
        kind: Literal["oom", "trial", "crash", "detach"],
        *,
        message: str = "",
        number: int | None = None,
        trial_state: str | None = None,
        crash_kind: str | None = None,
    ) -> None:
        """Queue a job ``event`` (message cut to :data:`EVENT_MESSAGE_MAX_CHARS`; the trial
        ``number`` defaults to the current trial's) and wake the hook's thread."""
        event: dict[str, Any] = {"kind": kind, "message": message[:EVENT_MESSAGE_MAX_CHARS]}
        if number is None:
            number = trial_number(self.trial)
        if number is not None:
            event["trial_number"] = number
        if trial_state is not None:
            event["trial_state"] = trial_state
        if crash_kind is not None:
            event["crash_kind"] = crash_kind
        self._events.append(event)
        self._wakeup.wake()

    def note_oom(self, message: str) -> None:
        """Count a CUDA out-of-memory error and queue its ``oom`` event."""
        self.oom_events += 1
        self.queue_event("oom", message=message)

    def take_stops(self) -> tuple[list[Command], bool] | None:
        """The ``stop`` commands to acknowledge now and whether this is the first time a
        stop is applied (``on_stop`` runs then); None when no stop was asked."""
        with self._lock:
            self.attention = False
            stops = self._stops
            self._stops = []
        if not stops and not self.stop_requested:
            return None
        first = not self.stop_applied
        self.stop_applied = True
        return stops, first

    def ack_stops(self, stops: Iterable[Command], at: str, error: str | None) -> None:
        """Acknowledge ``stops`` as applied ``at`` (``step``, ``trial_end``, ``exit``),
        with the ``on_stop`` callbacks' ``error`` if any."""
        number = trial_number(self.trial) if self.trial_scoped else None
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
            self._wakeup.wake()

    def ack_pending_stops(self, at: str, error: str | None) -> None:
        """Acknowledge the ``stop`` commands not applied yet (the job ends without a step)."""
        with self._lock:
            stops = self._stops
            self._stops = []
            self.attention = False
        if stops:
            self.stop_applied = True
            self.ack_stops(stops, at, error)

    def ack_drains(self, at: str) -> None:
        """A ``drain`` is applied ``at`` (``epoch_end``, ``trial_end``, ``exit``): acknowledge."""
        with self._lock:
            drains = self._drains
            self._drains = []
        if self.drain_requested:
            self.drain_applied = True
        if not drains:
            return
        result: dict[str, Any] = {"drained": True, "at": at, "epoch": self.epoch}
        number = trial_number(self.trial)
        if number is not None:
            result["trial"] = number
        for command in drains:
            self._outbox.append((command.generation, ok_reply(command.request_id, result)))
        logger.info("gpuwatchd: drain applied (%s)", at)
        self._wakeup.wake()

    def stop_exception(self) -> BaseException | None:
        """Inside a trial with optuna imported: the ``TrialPruned`` a stop raises."""
        if not self.trial_scoped:
            return None
        optuna = sys.modules.get("optuna")
        pruned = getattr(optuna, "TrialPruned", None) if optuna is not None else None
        if not isinstance(pruned, type):
            return None
        exc: BaseException = pruned(f"stopped by gpuwatchd: {self.stop_reason or 'no reason'}")
        return exc

    def take_pending(self) -> tuple[dict[str, Any], list[KnobChange]] | None:
        """The knob values with the pending changes applied, and those changes; None if none."""
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

    def commit(self, knobs: dict[str, Any], changes: Iterable[KnobChange]) -> None:
        """The job now runs with ``knobs``: make them current and acknowledge ``changes``."""
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
        self._wakeup.wake()

    def reject(self, changes: Iterable[KnobChange], reason: str) -> None:
        """``changes`` could not be applied: refuse them with ``reason``."""
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
        self._wakeup.wake()

    def set_local_knob(self, name: str, value: KnobValue, why: str) -> None:
        """Change a knob from the job itself (reported to the daemon in the next report);
        a pending change of it is refused ``conflict`` with ``why``."""
        with self._lock:
            superseded = self._pending.pop(name, None)
            current = dict(self._current)
            current[name] = value
            self._current = current
        if superseded is not None:
            text = f"superseded: {why} to {value!r} before it was applied"
            reply = error_reply(superseded.request_id, ErrorCode.CONFLICT, text)
            self._outbox.append((superseded.generation, reply))
            self._wakeup.wake()

    # -- the hook's thread (gpuwatchd.hook._connection.Session) -----------------------------

    def hello_message(self, request_id: int) -> dict[str, Any]:
        """The ``hello`` request of protocol v1 with the current knob values and trial."""
        current = self._current
        trial = trial_info(self.trial)
        self._trial_sent = trial
        return request(
            request_id,
            Op.HELLO,
            role="job",
            job=self.job,
            pid=os.getpid(),
            cuda_devices=list(self._cuda_devices),
            knobs={name: spec.as_hello(current[name]) for name, spec in self.specs.items()},
            study=study_name(self._study, self.trial),
            trial=trial,
            **_slurm_field(),
        )

    def hello_accepted(self, result: dict[str, Any]) -> None:
        """Take the daemon's ok reply to ``hello``.

        ``result["dropped_knobs"]`` (``[{knob, reason}]``, docs/protocol.md): declared
        knobs the daemon left out; each is warned about in one line and left out of
        reports (it stays the job's, not tunable by the daemon). ``result["knobs"]``
        (``{name: value}``): the values the daemon remembers for this job (what a policy
        or an operator applied to its earlier processes); each is checked like a
        ``set_knob`` (declared, kind, bounds) and becomes a pending change, applied
        before the first loader is built or at the next epoch start. A value refused is
        logged with the reason and not applied."""
        self._dropped = self._take_dropped(result.get("dropped_knobs"))
        knobs = result.get("knobs")
        if not isinstance(knobs, dict):
            return
        for name, raw in knobs.items():
            spec = self.specs.get(name) if isinstance(name, str) else None
            if spec is None or name in self._dropped:
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

    def _take_dropped(self, dropped: object) -> set[str]:
        """The declared knobs the daemon's ``hello`` reply says it left out (none from a
        daemon older than the field); one warning line each, unless the daemon the job
        was attached to before had dropped it too."""
        names: set[str] = set()
        for entry in dropped if isinstance(dropped, list) else ():
            name = entry.get("knob") if isinstance(entry, dict) else None
            if not isinstance(name, str) or name not in self.specs or name in names:
                continue
            names.add(name)
            if name in self._dropped:
                continue
            reason = entry.get("reason")
            logger.warning(
                "gpuwatchd: the daemon dropped knob %r (%s); attached without it",
                name,
                reason if isinstance(reason, str) else "no reason given",
            )
        return names

    def take_report(self) -> dict[str, Any] | None:
        """Drain the step records into one ``report`` object (None without steps).

        Beside :func:`gpuwatchd.hook._stats.summarize`'s fields: ``oom_events``,
        ``knobs`` (current values of the knobs the daemon took), ``cuda_memory`` (see
        :func:`gpuwatchd.hook._cuda.cuda_memory`) and ``trial`` when it changed.
        """
        records: list[StepRecord] = []
        pop = self._records.popleft
        try:
            while True:
                records.append(pop())
        except IndexError:
            pass
        report = summarize(records, self.steps)
        if report is None:
            return None
        report["oom_events"] = self.oom_events
        dropped = self._dropped
        knobs = {n: v for n, v in self._current.items() if n not in dropped}
        if knobs:
            report["knobs"] = knobs
        report["cuda_memory"] = cuda_memory()
        trial = trial_info(self.trial)
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
        if message.op == Op.SET_KNOB:
            return self._handle_set_knob(message, generation)
        if message.op == Op.DRAIN:
            with self._lock:
                self.drain_requested = True
                deferred = not self.drain_applied
                if deferred:
                    self._drains.append(Command(message.id, generation))
            if not deferred:
                return [ok_reply(message.id, {"drained": True, "at": "before"})]
            logger.info("gpuwatchd: drain requested; ending after the current epoch or trial")
            return []
        if message.op == Op.STOP:
            reason = message.params.get("reason")
            with self._lock:
                if not self.stop_requested:
                    self.stop_reason = reason if isinstance(reason, str) else None
                self.stop_requested = True
                deferred = not self.stop_applied
                if deferred:
                    self._stops.append(Command(message.id, generation))
                    self.attention = True
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
        effective = self.effective_batch_size
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
        spec = self.specs.get(name) if name not in self._dropped else None
        if spec is None:
            declared = ", ".join(sorted(set(self.specs) - self._dropped)) or "none"
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
