"""``attach()`` and the ``Watch`` object: the job-side half of gpuwatchd.

Threading model: the training thread calls :meth:`Watch.record_step` (one tuple
appended to a bounded deque, oldest dropped) and, at safe points (an epoch start, a
step boundary, the end of a trial), takes pending knob changes and daemon commands
under a lock that the background thread holds only for a few list and dict
operations. All socket I/O runs on the background thread of
:class:`gpuwatchd.hook._connection.Connection`.

Safe points, and what is applied there:

* epoch start (:class:`~gpuwatchd.hook.WatchedLoader`, the adapters, or
  :meth:`Watch.apply_knobs`): knob changes (the loader is rebuilt);
* step boundary (the primary loader's ``next()``, the adapters' batch-end hooks, or
  :meth:`Watch.safe_point`): ``stop`` (the user's ``on_stop`` callback runs first);
* epoch end, or trial end inside :meth:`Watch.trial`: ``drain``;
* an accumulation boundary inside :meth:`Watch.step`: the batch size halved after a
  CUDA out-of-memory error.

Every daemon command is acknowledged when it has been applied.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, TypeVar

from gpuwatchd.control.protocol import (
    TRIAL_ATTR_WORKER_ID,
    WORKER_ID_ENV,
    ErrorCode,
    Request,
    error_reply,
    ok_reply,
    request,
)
from gpuwatchd.errors import KnobError
from gpuwatchd.hook._connection import Connection
from gpuwatchd.hook._cuda import (
    crash_kind,
    cuda_memory,
    is_cuda_oom,
    is_trial_pruned,
    release_cached_memory,
)
from gpuwatchd.hook._knobs import KnobSpec, check_value, divisors, parse_knobs
from gpuwatchd.hook._loader import (
    LoaderFactory,
    WatchedLoader,
    batch_samples,
    set_live_loader_knob,
    slice_batch,
)
from gpuwatchd.hook._stats import StepRecord, summarize
from gpuwatchd.model import KnobValue

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "EVENT_MESSAGE_MAX_CHARS",
    "OomPolicy",
    "TrialScope",
    "Watch",
    "attach",
    "cuda_devices_from_env",
]

logger = logging.getLogger("gpuwatchd.hook")

T = TypeVar("T")
OomPolicy = Literal["raise", "halve"]

DEFAULT_SOCKET_PATH: Final = "/run/gpuwatchd/control.sock"
"""systemd ``RuntimeDirectory=gpuwatchd`` + ``control.sock`` (design.md)."""
RECORDS_MAX: Final = 16384
"""Step records kept between two reports; older ones are dropped when the thread lags."""
EVENTS_MAX: Final = 256
"""Job events (OOM, trial, crash) kept for the daemon, also across a reconnect; oldest dropped."""
EVENT_MESSAGE_MAX_CHARS: Final = 1000
"""The daemon refuses longer event messages (``control.server.EVENT_MESSAGE_MAX_CHARS``)."""
FIRST_CONNECT_WAIT_S: Final = 0.5
"""How long entering ``attach()`` waits for the first connect attempt (a Unix socket
connect is immediate when the daemon is there or absent)."""
BATCH_SIZE: Final = "batch_size"
LOADER_KNOBS: Final = frozenset(
    {"num_workers", "prefetch_factor", "persistent_workers", BATCH_SIZE}
)
"""Knobs that are DataLoader arguments (the others are the job's own, read from ``knobs``)."""


def _default_socket_path() -> str:
    try:
        from gpuwatchd.control.client import default_socket_path
    except ImportError:
        return os.environ.get("GPUWATCHD_SOCKET") or DEFAULT_SOCKET_PATH
    return str(default_socket_path())


def _default_job_name() -> str:
    env = os.environ.get("GPUWATCHD_JOB")
    if env:
        return env
    argv0 = sys.argv[0] if sys.argv else ""
    if not argv0 or argv0 in ("-c", "-m"):
        return "python"
    path = Path(argv0)
    if path.stem == "__main__" and path.parent.name:
        return path.parent.name
    return path.stem or "python"


def cuda_devices_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (ordinals, ``GPU-<uuid>`` or MIG ids), in order.

    ``[]`` when the variable is unset or empty. No CUDA call is made: the daemon maps
    the entries to NVML devices.
    """
    env = os.environ if environ is None else environ
    raw = env.get("CUDA_VISIBLE_DEVICES", "")
    return [part.strip() for part in raw.split(",") if part.strip()]


def _json_plain(value: object) -> object:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    return str(value)


def _trial_info(trial: object) -> dict[str, Any] | None:
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


def _trial_number(trial: object) -> int | None:
    number = getattr(trial, "number", None)
    return number if isinstance(number, int) and not isinstance(number, bool) else None


def _study_name(study: str | None, trial: object) -> str | None:
    if study is not None:
        return study
    name = getattr(getattr(trial, "study", None), "study_name", None)
    return name if isinstance(name, str) else None


def _default_backward(loss: Any) -> None:
    loss.backward()


@dataclass(frozen=True, slots=True)
class _Change:
    """A ``set_knob`` accepted but not applied yet."""

    knob: str
    value: KnobValue
    request_id: str | int
    generation: int


@dataclass(frozen=True, slots=True)
class _Command:
    """A ``drain`` or ``stop`` received but not applied yet (acknowledged when applied)."""

    request_id: str | int
    generation: int


class Watch:
    """The job's link to gpuwatchd, returned by :func:`attach`; use it as a context manager.

    Read by the training loop: :attr:`knobs` (current values), :attr:`epoch`,
    :attr:`connected`, :attr:`batch_size`, :attr:`accumulation_steps`,
    :attr:`sync_gradients`, :attr:`should_stop`, :attr:`stop_requested`,
    :attr:`drain_requested`. See the module docstring for where knob changes and the
    daemon's ``drain``/``stop`` are applied.
    """

    def __init__(
        self,
        *,
        job: str,
        knobs: Mapping[str, KnobSpec],
        socket_path: str,
        trial: object = None,
        study: str | None = None,
        report_interval_s: float = 0.5,
        cuda_devices: list[str] | None = None,
        effective_batch_size: int | None = None,
        oom: OomPolicy = "raise",
        on_stop: Callable[[str | None], object] | None = None,
    ) -> None:
        if oom not in ("raise", "halve"):
            raise KnobError(f"oom must be 'raise' or 'halve', not {oom!r}")
        if oom == "halve" and BATCH_SIZE not in knobs:
            raise KnobError("oom='halve' needs a batch_size knob to halve", knob=BATCH_SIZE)
        self.job = job
        self.socket_path = socket_path
        self._specs = dict(knobs)
        self._current: dict[str, KnobValue] = {n: s.value for n, s in self._specs.items()}
        self._trial = trial
        self._trial_sent: dict[str, Any] | None = None
        self._trial_scoped = False
        self._study = study
        self._cuda_devices = list(cuda_devices) if cuda_devices is not None else []
        self._effective = effective_batch_size
        self._oom_policy: OomPolicy = oom
        self._on_stop: list[Callable[[str | None], object]] = [on_stop] if on_stop else []
        self._reported_trials: deque[int] = deque(maxlen=1024)
        self._lock = threading.Lock()
        self._pending: dict[str, _Change] = {}
        self._applying = False  # pending changes taken by an epoch start, not yet committed
        self._outbox: deque[tuple[int, dict[str, Any]]] = deque(maxlen=1024)
        self._events: deque[dict[str, Any]] = deque(maxlen=EVENTS_MAX)
        self._records: deque[StepRecord] = deque(maxlen=RECORDS_MAX)
        self._steps_total = 0
        self._epoch = 0
        self._epoch_done = -1
        self._primary_claimed = False
        self._closed = False
        self._oom_events = 0
        self._window_samples = 0
        self.sync_gradients = False
        """True when the last :meth:`step` completed an accumulation window (the optimizer
        was stepped, or should be when :meth:`step` got no optimizer)."""
        self._stops: list[_Command] = []
        self._drains: list[_Command] = []
        self._stop_applied = False
        self._drain_applied = False
        self._attention = False  # read once per step by the loader: a stop is pending
        self._trial_events_by_callback = False
        self.stop_requested = False
        """The daemon sent ``stop`` (see :attr:`stop_reason`); applied at the next step."""
        self.stop_reason: str | None = None
        self.drain_requested = False
        """The daemon sent ``drain``: finish the current epoch (or trial), start no new one."""
        self._connection = Connection(socket_path, self, report_interval_s)

    # -- public API (training thread) ------------------------------------------------------

    @property
    def knobs(self) -> dict[str, Any]:
        """Current (applied) knob values, ``{name: value}`` (a copy)."""
        return dict(self._current)

    @property
    def pending_knobs(self) -> dict[str, Any]:
        """Knob changes the daemon asked for that the next epoch start will apply."""
        with self._lock:
            return {name: change.value for name, change in self._pending.items()}

    @property
    def epoch(self) -> int:
        """0-based index of the current epoch of the primary (first) loader."""
        return self._epoch

    @property
    def steps(self) -> int:
        """Training steps recorded since attach."""
        return self._steps_total

    @property
    def connected(self) -> bool:
        """True while connected to the daemon (``hello`` sent)."""
        return self._connection.connected

    @property
    def batch_size(self) -> int | None:
        """The current ``batch_size`` knob (the micro-batch size), None without one."""
        value = self._current.get(BATCH_SIZE)
        return int(value) if value is not None else None

    @property
    def effective_batch_size(self) -> int | None:
        """Samples per optimizer step (``batch_size * accumulation_steps``), kept constant
        when the batch size changes; None without a ``batch_size`` knob."""
        return self._effective

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step: ``effective_batch_size // batch_size`` (1
        without a ``batch_size`` knob)."""
        size = self.batch_size
        if size is None or self._effective is None:
            return 1
        return max(1, self._effective // size)

    @property
    def oom_events(self) -> int:
        """CUDA out-of-memory errors caught (by :meth:`step`/:meth:`report_oom`) since attach."""
        return self._oom_events

    @property
    def should_stop(self) -> bool:
        """True once a ``stop`` or ``drain`` has been applied: training should end now."""
        return self._stop_applied or self._drain_applied

    def start(self) -> Watch:
        """Start the background thread and wait briefly (0.5 s at most) for the first connect.

        A trial given to :func:`attach` (one trial for the whole process) gets its
        ``gpuwatchd:worker_id`` here, as :meth:`trial` does for each of its trials.
        """
        if self._closed:
            raise RuntimeError("this Watch was closed; call attach() again")
        if self._trial is not None and not self._trial_scoped:
            _mark_worker(self._trial)
        self._connection.start()
        self._connection.wait_first_attempt(FIRST_CONNECT_WAIT_S)
        return self

    def close(self, timeout_s: float = 1.0) -> None:
        """Acknowledge commands not applied yet, flush a last report (best effort), close
        the socket and stop the thread. Returns within about ``timeout_s`` seconds."""
        if not self._closed:
            self._ack_drains("exit")
            self._ack_stops("exit", None)
        self._closed = True
        if not self._connection.stop(timeout_s):
            logger.debug("gpuwatchd: hook thread did not end within %.1f s", timeout_s)

    def __enter__(self) -> Watch:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Report a CUDA exception as a ``crash`` event, or a clean end as ``detach``; close.

        ``detach`` tells the daemon that this process is about to exit cleanly: a worker
        adopted by a restarted daemon is not its child, so its exit status cannot be read,
        and without this word its end would count as a crash and be restarted.
        """
        if exc is not None:
            kind = crash_kind(exc)
            if kind is not None:
                self.report_event("crash", crash_kind=kind, message=f"{type(exc).__name__}: {exc}")
        elif not self._closed:
            self.report_event("detach")
        self.close()

    def loader(self, factory: LoaderFactory[T]) -> WatchedLoader[T]:
        """Wrap ``factory(knobs) -> DataLoader`` (any iterable of batches) for timing and knobs.

        ``knobs`` is a dict of the current knob values. The factory is called now and
        again at an epoch start after a knob change; the old loader is dropped, so a
        DataLoader's worker processes shut down. Errors of the first call propagate; a
        failing rebuild keeps the old loader and answers the daemon with ``bad_request``.
        The first loader created (inside a :meth:`trial`: the first of that trial) is
        the *primary* one: it counts epochs and ends training on ``drain``/``stop``.
        """
        primary = not self._primary_claimed
        self._primary_claimed = True
        return WatchedLoader(self, factory, primary=primary)

    def record_step(self, step_time_s: float, data_wait_s: float, samples: int = 1) -> None:
        """Record one training step (for loops that do not use :meth:`loader`).

        ``step_time_s``: wall seconds of the whole step, data wait included;
        ``data_wait_s``: seconds spent waiting for the batch; ``samples``: batch size.
        Cheap and non-blocking: one append to a bounded deque.
        """
        self._steps_total += 1
        self._records.append((step_time_s, data_wait_s, samples, self._epoch))

    def apply_knobs(self, live_loaders: Iterable[Any] | None = None) -> dict[str, Any]:
        """Apply pending knob changes now (a safe point) and acknowledge them; return the
        current values.

        For loops that build their own loaders; :meth:`loader` does this at each epoch
        start. With ``live_loaders`` (DataLoaders a framework built, see
        :func:`gpuwatchd.hook._loader.find_dataloaders`), ``num_workers`` and
        ``prefetch_factor`` are set on them in place; a change of ``batch_size`` or
        ``persistent_workers`` is then refused (a built DataLoader cannot take it).
        """
        taken = self._take_pending()
        if taken is None:
            return self.knobs
        knobs, changes = taken
        if live_loaders is None:
            self._commit(knobs, changes)
            return self.knobs
        loaders = list(live_loaders)
        applied: list[_Change] = []
        for change in changes:
            if change.knob in LOADER_KNOBS:
                try:
                    for live in loaders:
                        set_live_loader_knob(live, change.knob, change.value)
                except (KnobError, ValueError, TypeError, AttributeError) as exc:
                    knobs[change.knob] = self._current[change.knob]
                    self._reject([change], str(exc))
                    continue
            applied.append(change)
        self._commit(knobs, applied)
        return self.knobs

    def safe_point(self) -> bool:
        """A step boundary: apply a pending ``stop`` (run ``on_stop``, acknowledge it).

        Returns True when training should end now (a stop was applied, now or before, or
        a drain was applied). Cheap when nothing is pending: for custom loops, call it
        after each step. The primary loader and the adapters call it for you.
        """
        if self._attention:
            self._apply_stop("step")
        return self.should_stop

    def epoch_end(self) -> bool:
        """An epoch ended: apply a pending ``drain`` (outside a trial); True when training
        should end (a drain or stop was applied). Called by the primary loader and the
        adapters; call it yourself at the end of each epoch in a custom loop."""
        if self.drain_requested and not self._trial_scoped:
            self._ack_drains("epoch_end")
        return self.should_stop

    def report_oom(self, exc: BaseException, *, message: str | None = None) -> None:
        """Count a CUDA out-of-memory error and send an ``oom`` event to the daemon.

        ``message`` defaults to the exception's text (cut to 1000 characters).
        """
        self._oom_events += 1
        self.report_event("oom", message=message if message is not None else str(exc))

    def report_event(
        self,
        kind: Literal["oom", "trial", "crash", "detach"],
        *,
        message: str = "",
        trial_number: int | None = None,
        trial_state: str | None = None,
        crash_kind: str | None = None,
    ) -> None:
        """Queue a job ``event`` for the daemon (sent at once by the background thread).

        ``kind``: ``oom``, ``trial`` (needs ``trial_state``: ``COMPLETE``, ``PRUNED`` or
        ``FAIL``), ``crash`` (needs ``crash_kind``: ``cuda_assert``, ``cuda_oom``,
        ``host_oom``, ``other``), ``detach`` (the process ends cleanly). ``trial_number``
        defaults to the current trial's. Kept
        while disconnected (at most 256 events, oldest dropped). Never blocks.
        """
        event: dict[str, Any] = {"kind": kind, "message": message[:EVENT_MESSAGE_MAX_CHARS]}
        number = trial_number if trial_number is not None else _trial_number(self._trial)
        if number is not None:
            event["trial_number"] = number
        if trial_state is not None:
            event["trial_state"] = trial_state
        if crash_kind is not None:
            event["crash_kind"] = crash_kind
        self._events.append(event)
        self._connection.wake()

    def report_trial(self, number: int | None, state: str | None) -> None:
        """Send a ``trial`` event: trial ``number`` ended in Optuna ``TrialState`` ``state``
        (``COMPLETE``, ``PRUNED`` or ``FAIL``; other states are not final and ignored).

        At most one event per trial number: a second report of the same trial is ignored.
        """
        if state not in ("COMPLETE", "PRUNED", "FAIL"):
            return
        if number is not None:
            if number in self._reported_trials:
                return
            self._reported_trials.append(number)
        self.report_event("trial", trial_number=number, trial_state=state)

    def add_on_stop(self, callback: Callable[[str | None], object]) -> None:
        """Add ``callback(reason)`` to what runs when a ``stop`` is applied, after those
        given before (the ``on_stop`` of :func:`attach` first). Errors are logged."""
        self._on_stop.append(callback)

    def trial(self, trial: object) -> TrialScope:
        """A context for one Optuna trial (anything with ``.number``/``.params``).

        Inside it, reports carry the trial's number and params, the next loader created
        is the primary one (epochs counted from 0), a ``stop`` prunes the trial (raises
        ``optuna.TrialPruned`` at the next step, after ``on_stop``) and stops the study,
        and a ``drain`` lets the trial finish, then stops the study
        (``trial.study.stop()``) and is acknowledged. On exit a ``trial`` event with
        the state (COMPLETE, PRUNED for ``TrialPruned``, FAIL for another exception) is
        sent, unless a :class:`gpuwatchd.hook.optuna.StudyCallback` does it. In a
        worker the daemon launched, the trial gets the user attr ``gpuwatchd:worker_id``
        (``$GPUWATCHD_WORKER_ID``) when it starts, so that the daemon can find the
        trials of a worker that died while the daemon was down.
        """
        return TrialScope(self, trial)

    def step(
        self,
        fn: Callable[[Any], Any],
        batch: Any,
        optimizer: Any = None,
        *,
        backward: Callable[[Any], object] | None = None,
    ) -> list[Any]:
        """One training step on ``batch`` with gradient accumulation and OOM handling.

        ``fn(micro_batch) -> loss`` runs the forward pass and returns the loss, a mean
        over its samples (or None if it did the backward itself). ``batch`` is split
        into micro-batches of :attr:`batch_size` samples (:func:`slice_batch`; no split
        without a ``batch_size`` knob or when it is not smaller than the batch); each
        loss is scaled by ``samples / effective_batch_size`` and passed to ``backward``
        (default ``loss.backward()``; e.g. ``lambda l: scaler.scale(l).backward()``
        with AMP). Once :attr:`effective_batch_size` samples are accumulated,
        ``optimizer.step()`` and ``optimizer.zero_grad()`` are called (when an
        optimizer is given) and :attr:`sync_gradients` is True. Returns ``fn``'s
        results, one per micro-batch.

        On a CUDA out-of-memory error the hook counts it and sends an ``oom`` event;
        with ``oom="halve"`` it then frees memory (``gc.collect``,
        ``torch.cuda.empty_cache``), zeroes the gradients (``optimizer.zero_grad()``;
        the partial accumulation window is dropped), sets ``batch_size`` to the
        largest divisor of the effective batch size at most half of it (so the
        accumulation keeps the effective batch) and retries this batch, like
        Accelerate's ``find_executable_batch_size``. The loader is rebuilt with the new
        ``batch_size`` at the next epoch; until then batches are split. Otherwise, or
        when the batch size is already 1, the error is raised.
        """
        while True:
            size = self.batch_size
            try:
                return self._run_micro_batches(fn, batch, size, optimizer, backward)
            except BaseException as exc:
                if not is_cuda_oom(exc):
                    raise
                new_size = self._after_oom(exc, size)
                if new_size is None:
                    raise
            # Out of the except block: the traceback (and the tensors its frames hold) is gone.
            release_cached_memory()
            if optimizer is not None:
                optimizer.zero_grad()
            self._window_samples = 0
            self.sync_gradients = False

    # -- step internals ----------------------------------------------------------------------

    def _run_micro_batches(
        self,
        fn: Callable[[Any], Any],
        batch: Any,
        size: int | None,
        optimizer: Any,
        backward: Callable[[Any], object] | None,
    ) -> list[Any]:
        total = batch_samples(batch)
        if size is None or total <= size:
            micro_batches: Sequence[Any] = (batch,)
        else:
            micro_batches = [slice_batch(batch, i, i + size) for i in range(0, total, size)]
        effective = self._effective
        do_backward = backward or _default_backward
        results: list[Any] = []
        self.sync_gradients = False
        for micro in micro_batches:
            samples = total if len(micro_batches) == 1 else batch_samples(micro)
            loss = fn(micro)
            if loss is not None:
                scale = samples / effective if effective else 1.0
                do_backward(loss * scale if scale != 1.0 else loss)
            results.append(loss)
            self._window_samples += samples
            if effective is None or self._window_samples >= effective:
                self._window_samples = 0
                self.sync_gradients = True
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad()
        return results

    def _after_oom(self, exc: BaseException, size: int | None) -> int | None:
        """Report an OOM at micro-batch ``size``; return the halved size, or None to raise."""
        effective = self._effective
        new_size: int | None = None
        if self._oom_policy == "halve" and size is not None and effective is not None:
            fitting = [d for d in divisors(effective) if d <= size // 2]
            spec = self._specs[BATCH_SIZE]
            low = spec.min if spec.min is not None else 1
            fitting = [d for d in fitting if d >= low]
            new_size = fitting[-1] if fitting else None
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if new_size is None:
            self.report_oom(exc, message=f"CUDA out of memory at batch_size={size}: {text}")
            return None
        accumulation = (effective or new_size) // new_size
        self.report_oom(
            exc,
            message=(
                f"CUDA out of memory at batch_size={size}; halved to batch_size={new_size} "
                f"with {accumulation} accumulation steps (effective {effective}): {text}"
            ),
        )
        logger.warning(
            "gpuwatchd: CUDA out of memory at batch_size=%s; retrying with batch_size=%s "
            "and %s accumulation steps",
            size,
            new_size,
            accumulation,
        )
        self._set_local_knob(BATCH_SIZE, new_size, "an out-of-memory error halved batch_size")
        return new_size

    def _set_local_knob(self, name: str, value: KnobValue, why: str) -> None:
        """Change a knob from the job itself (reported to the daemon in the next report)."""
        with self._lock:
            superseded = self._pending.pop(name, None)
            current = dict(self._current)
            current[name] = value
            self._current = current
        if superseded is not None:
            text = f"superseded: {why} to {value!r} before it was applied"
            reply = error_reply(superseded.request_id, ErrorCode.CONFLICT, text)
            self._outbox.append((superseded.generation, reply))
            self._connection.wake()

    # -- drain / stop ------------------------------------------------------------------------

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

    def _send_stop_acks(self, stops: Iterable[_Command], at: str, error: str | None) -> None:
        number = _trial_number(self._trial) if self._trial_scoped else None
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
        number = _trial_number(self._trial)
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

    # -- used by WatchedLoader and TrialScope (training thread) -------------------------------

    def _set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def _epoch_finished(self) -> None:
        if self._epoch_done == self._epoch:
            return
        self._epoch_done = self._epoch
        self.epoch_end()

    def _begin_trial(self, trial: object) -> None:
        _mark_worker(trial)
        self._trial = trial
        self._trial_scoped = True
        self._primary_claimed = False
        self._epoch = 0
        self._epoch_done = -1

    def _end_trial(self, trial: object, exc: BaseException | None) -> None:
        if exc is None:
            state = "COMPLETE"
        elif is_trial_pruned(exc):
            state = "PRUNED"
        else:
            state = "FAIL"
        # With a StudyCallback, Optuna's own final state is reported there; but a trial
        # whose exception Optuna re-raises never reaches the callbacks: report FAIL here.
        if not self._trial_events_by_callback or state == "FAIL":
            self.report_trial(_trial_number(trial), state)
        if self.stop_requested and not self._stop_applied:
            self._apply_stop("trial_end")  # the trial ended before its next step
        if self.drain_requested:
            self._ack_drains("trial_end")
        self._trial_scoped = False
        if self.should_stop or self.drain_requested:
            study = getattr(trial, "study", None)
            stop = getattr(study, "stop", None)
            if callable(stop):
                try:
                    stop()  # Optuna: no new trial starts in this study.optimize() call
                except Exception:
                    logger.debug("gpuwatchd: study.stop() failed", exc_info=True)
        self._trial = None

    def _take_pending(self) -> tuple[dict[str, Any], list[_Change]] | None:
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

    def _commit(self, knobs: dict[str, Any], changes: Iterable[_Change]) -> None:
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
            self._outbox.append((change.generation, ok_reply(change.request_id, result)))
            logger.info(
                "gpuwatchd: applied %s=%r (was %r)",
                change.knob,
                change.value,
                previous[change.knob],
            )
        self._connection.wake()

    def _reject(self, changes: Iterable[_Change], reason: str) -> None:
        with self._lock:
            self._applying = False
        for change in changes:
            message = (
                f"{change.knob}={change.value!r} not applied: {reason}; "
                f"kept {change.knob}={self._current[change.knob]!r}"
            )
            reply = error_reply(change.request_id, ErrorCode.BAD_REQUEST, message)
            self._outbox.append((change.generation, reply))
        self._connection.wake()

    # -- Session (background thread) ---------------------------------------------------------

    def hello_message(self, request_id: int) -> dict[str, Any]:
        """The ``hello`` request of protocol v1 with the current knob values and trial."""
        current = self._current
        trial = _trial_info(self._trial)
        self._trial_sent = trial
        return request(
            request_id,
            "hello",
            role="job",
            job=self.job,
            pid=os.getpid(),
            cuda_devices=list(self._cuda_devices),
            knobs={name: spec.as_hello(current[name]) for name, spec in self._specs.items()},
            study=_study_name(self._study, self._trial),
            trial=trial,
        )

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
        trial = _trial_info(self._trial)
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
                    self._drains.append(_Command(message.id, generation))
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
                    self._stops.append(_Command(message.id, generation))
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
                self._pending[name] = _Change(name, value, message.id, generation)
        if superseded is not None:
            text = f"superseded by request {message.id!r} before it was applied"
            replies.append(error_reply(superseded.request_id, ErrorCode.CONFLICT, text))
        if applied_now:
            result = {"knob": name, "value": value, "previous": current, "applied": True}
            replies.append(ok_reply(message.id, result))
        return replies


def _mark_worker(trial: object) -> None:
    """Write ``$GPUWATCHD_WORKER_ID`` into the trial's ``gpuwatchd:worker_id`` user attr.

    Only in a worker the daemon launched (the variable is set) and for a trial with
    Optuna's ``set_user_attr``. It is one storage write per trial, made whether or not
    the daemon is reachable: the daemon reads it back when the worker dies, even when
    it was down at the time (:func:`gpuwatchd.study.trials_of_worker`). A storage error
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


class TrialScope:
    """The context manager returned by :meth:`Watch.trial` (see there)."""

    def __init__(self, watch: Watch, trial: object) -> None:
        self.watch = watch
        self.trial = trial

    def __enter__(self) -> Watch:
        self.watch._begin_trial(self.trial)
        return self.watch

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.watch._end_trial(self.trial, exc)


def attach(
    job: str | None = None,
    knobs: Mapping[str, object] | None = None,
    trial: object = None,
    socket: str | os.PathLike[str] | None = None,
    *,
    study: str | None = None,
    report_interval_s: float = 0.5,
    effective_batch_size: int | None = None,
    oom: OomPolicy = "raise",
    on_stop: Callable[[str | None], object] | None = None,
) -> Watch:
    """Attach this training process to gpuwatchd; use the result in a ``with`` block.

    - ``job``: the job's name; default ``$GPUWATCHD_JOB`` (set by the supervisor for
      managed workers), else the script's name.
    - ``knobs``: ``{name: value}`` or ``{name: {"value": v, "min": a, "max": b}}``; see
      :func:`gpuwatchd.hook._knobs.parse_knobs` for kinds and default bounds
      (``num_workers`` [0, 64], ``prefetch_factor`` [1, 64], ``persistent_workers`` bool,
      ``batch_size`` [1, ``effective_batch_size``]).
    - ``trial``: an Optuna trial (anything with ``.number`` and ``.params``) for the
      whole process; its number, params and ``trial.study.study_name`` are reported.
      For several trials in one process use :meth:`Watch.trial` per trial instead.
    - ``socket``: the control socket; default ``$GPUWATCHD_SOCKET``, else
      ``/run/gpuwatchd/control.sock``.
    - ``study``: the Optuna study name when no trial carries it.
    - ``report_interval_s``: seconds between reports, at least 0.25 (4 per second).
    - ``effective_batch_size``: samples per optimizer step, kept when ``batch_size``
      changes (gradient accumulation); default: the initial ``batch_size``. Every
      ``batch_size`` must divide it.
    - ``oom``: ``"raise"`` (default) or ``"halve"``: what :meth:`Watch.step` does after
      a CUDA out-of-memory error it reported.
    - ``on_stop``: ``on_stop(reason)``, called on the training thread when the daemon's
      ``stop`` is applied (e.g. to save a checkpoint); its errors are logged.

    Raises :class:`gpuwatchd.errors.KnobError` for a bad ``knobs`` declaration, an
    ``effective_batch_size`` without a ``batch_size`` knob or not a multiple of it, or
    ``oom="halve"`` without a ``batch_size`` knob. Nothing connects until the ``with``
    block is entered; without a daemon the job runs untouched, one warning is logged on
    ``logging.getLogger("gpuwatchd.hook")`` and the hook keeps retrying in the
    background (0.5 s doubling to 10 s).
    """
    raw = dict(knobs or {})
    effective = _effective_batch_size(raw, effective_batch_size)
    defaults: dict[str, tuple[KnobValue, KnobValue]] = {}
    if effective is not None:
        defaults[BATCH_SIZE] = (1, effective)
    specs = parse_knobs(raw if knobs is not None else None, defaults)
    if BATCH_SIZE in specs:
        spec = specs[BATCH_SIZE]
        if spec.kind != "int" or effective is None or effective % int(spec.value):
            raise KnobError(
                f"batch_size {spec.value!r} must be an integer dividing the effective batch "
                f"size {effective}",
                knob=BATCH_SIZE,
            )
    path = os.fspath(socket) if socket is not None else _default_socket_path()
    return Watch(
        job=job or _default_job_name(),
        knobs=specs,
        socket_path=path,
        trial=trial,
        study=study,
        report_interval_s=report_interval_s,
        cuda_devices=cuda_devices_from_env(),
        effective_batch_size=effective,
        oom=oom,
        on_stop=on_stop,
    )


def _effective_batch_size(knobs: Mapping[str, object], given: int | None) -> int | None:
    raw = knobs.get(BATCH_SIZE)
    initial = raw.get("value") if isinstance(raw, Mapping) else raw
    if raw is None:
        if given is not None:
            raise KnobError("effective_batch_size needs a batch_size knob", knob=BATCH_SIZE)
        return None
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given < 1:
            raise KnobError(f"effective_batch_size must be a positive integer, not {given!r}")
        return given
    if isinstance(initial, bool) or not isinstance(initial, int) or initial < 1:
        return None  # parse_knobs or attach() says what is wrong with it
    return initial
