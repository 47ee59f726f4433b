"""``attach()`` and the ``Watch`` object: the job-side half of gpuwatchd.

A ``Watch`` is built from its parts, each with its own state: the daemon session
(:mod:`._session`), the hook thread's connection (:mod:`._connection`) and the OOM
handler of its training step (:mod:`._oom`); threading model and safe points:
docs/hook-internals.md.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, TypeVar

from gpuwatchd.control.protocol import (
    DEFAULT_SOCKET_PATH,
    EVENT_MESSAGE_MAX_CHARS,
    JOB_ENV,
    SOCKET_ENV,
    TRIAL_STATES,
)
from gpuwatchd.errors import KnobError
from gpuwatchd.hook._connection import Connection, Wakeup
from gpuwatchd.hook._cuda import (
    crash_kind,
    is_trial_pruned,
)
from gpuwatchd.hook._exit import note_block_end, register_exit_line
from gpuwatchd.hook._host import KnobChange
from gpuwatchd.hook._knobs import KnobSpec, parse_knobs
from gpuwatchd.hook._loader import (
    LoaderFactory,
    WatchedLoader,
    set_live_loader_knob,
)
from gpuwatchd.hook._oom import OomHandler, OomPolicy
from gpuwatchd.hook._session import BATCH_SIZE, DaemonSession, mark_worker, trial_number
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

FIRST_CONNECT_WAIT_S: Final = 0.5
"""How long entering ``attach()`` waits for the first connect attempt (a Unix socket
connect is immediate when the daemon is there or absent)."""
HELLO_WAIT_S: Final = 2.0
"""How long entering ``attach()`` then waits, when connected, for the ``hello`` reply that
hands back the job's remembered knob values (a daemon answers in milliseconds)."""
LOADER_KNOBS: Final = frozenset(
    {"num_workers", "prefetch_factor", "persistent_workers", BATCH_SIZE}
)
"""Knobs that are DataLoader arguments (the others are the job's own, read from ``knobs``)."""


def _default_socket_path() -> str:
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET_PATH


def _default_job_name() -> str:
    env = os.environ.get(JOB_ENV)
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


class Watch:
    """The job's link to gpuwatchd, returned by :func:`attach`; use it as a context manager.

    Read by the training loop: :attr:`knobs` (current values), :attr:`epoch`,
    :attr:`connected`, :attr:`batch_size`, :attr:`accumulation_steps`,
    :attr:`sync_gradients`, :attr:`should_stop`, :attr:`stop_requested`,
    :attr:`drain_requested`. See the module docstring for where knob changes and the
    daemon's ``drain``/``stop`` are applied. Loader wrappers and framework adapters
    drive it through :attr:`stop_pending`, :meth:`stop_exception`, :meth:`set_epoch`,
    :meth:`epoch_finished`, :meth:`take_pending_knobs`, :meth:`commit_knobs`,
    :meth:`reject_knobs` and :meth:`leave_trial_states_to_callback`.

    Its parts, built here in dependency order: the hook thread's :class:`Wakeup`, the
    :class:`DaemonSession` (knob values, pending changes and commands, records, events),
    the :class:`Connection` (the thread, serving the session) and the
    :class:`OomHandler` of :meth:`step` (reading and changing the session's
    ``batch_size``). The watch keeps what only the training loop uses: the loaders'
    epoch bookkeeping, the trials reported and the ``on_stop`` callbacks.
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
        self.socket_path = socket_path
        wakeup = Wakeup()
        self._session = DaemonSession(
            job=job,
            specs=knobs,
            wakeup=wakeup,
            trial=trial,
            study=study,
            cuda_devices=cuda_devices or (),
            effective_batch_size=effective_batch_size,
        )
        self._connection = Connection(socket_path, self._session, wakeup, report_interval_s)
        self._oom = OomHandler(oom, self._session)
        self._on_stop: list[Callable[[str | None], object]] = [on_stop] if on_stop else []
        self._reported_trials: deque[int] = deque(maxlen=1024)
        self._reported_lock = threading.Lock()  # Optuna's n_jobs > 1 threads report at once
        self._epoch_done = -1
        self._primary_claimed = False
        self._closed = False
        self._trial_events_by_callback = False

    # -- public API (training thread) ------------------------------------------------------

    @property
    def job(self) -> str:
        """The job's name, as ``hello`` sends it."""
        return self._session.job

    @property
    def knobs(self) -> dict[str, Any]:
        """Current (applied) knob values, ``{name: value}`` (a copy)."""
        return dict(self._session.current)

    @property
    def pending_knobs(self) -> dict[str, Any]:
        """Knob changes the daemon asked for that the next epoch start will apply."""
        return self._session.pending_values()

    @property
    def epoch(self) -> int:
        """0-based index of the current epoch of the primary (first) loader."""
        return self._session.epoch

    @property
    def steps(self) -> int:
        """Training steps recorded since attach."""
        return self._session.steps

    @property
    def connected(self) -> bool:
        """True while connected to the daemon (``hello`` sent)."""
        return self._connection.connected

    @property
    def batch_size(self) -> int | None:
        """The current ``batch_size`` knob (the micro-batch size), None without one."""
        return self._oom.batch_size

    @property
    def effective_batch_size(self) -> int | None:
        """Samples per optimizer step (``batch_size * accumulation_steps``), kept constant
        when the batch size changes; None without a ``batch_size`` knob."""
        return self._session.effective_batch_size

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step: ``effective_batch_size // batch_size`` (1
        without a ``batch_size`` knob)."""
        size = self.batch_size
        effective = self._session.effective_batch_size
        if size is None or effective is None:
            return 1
        return max(1, effective // size)

    @property
    def sync_gradients(self) -> bool:
        """True when the last :meth:`step` completed an accumulation window (the optimizer
        was stepped, or should be when :meth:`step` got no optimizer)."""
        return self._oom.sync_gradients

    @property
    def oom_events(self) -> int:
        """CUDA out-of-memory errors caught (by :meth:`step`/:meth:`report_oom`) since attach."""
        return self._session.oom_events

    @property
    def stop_requested(self) -> bool:
        """The daemon sent ``stop`` (see :attr:`stop_reason`); applied at the next step."""
        return self._session.stop_requested

    @property
    def stop_reason(self) -> str | None:
        """The reason the daemon's ``stop`` gave, if any."""
        return self._session.stop_reason

    @property
    def drain_requested(self) -> bool:
        """The daemon sent ``drain``: finish the current epoch (or trial), start no new one."""
        return self._session.drain_requested

    @property
    def should_stop(self) -> bool:
        """True once a ``stop`` or ``drain`` has been applied: training should end now."""
        return self._session.stop_applied or self._session.drain_applied

    def start(self) -> Watch:
        """Start the background thread and wait briefly (0.5 s at most) for the first connect,
        then, when connected, for the daemon's ``hello`` reply (2 s at most): knob values
        the daemon remembers for this job (changed by a policy or an operator in its
        earlier processes) become pending changes, applied before the first loader is
        built (or by :meth:`apply_knobs`).

        A trial given to :func:`attach` (one trial for the whole process) gets its
        ``gpuwatchd:worker_id`` here, as :meth:`trial` does for each of its trials. In a
        managed worker the first start registers the process's exit line
        (:mod:`gpuwatchd.hook._exit`): a ``detach`` is not an exit, the exit line is.
        """
        if self._closed:
            raise RuntimeError("this Watch was closed; call attach() again")
        register_exit_line()
        if self._session.trial is not None and not self._session.trial_scoped:
            mark_worker(self._session.trial)
        self._connection.start()
        self._connection.wait_first_attempt(FIRST_CONNECT_WAIT_S)
        self._connection.wait_hello(HELLO_WAIT_S)
        return self

    def close(self, timeout_s: float = 1.0) -> None:
        """Acknowledge commands not applied yet, flush a last report (best effort), close
        the socket and stop the thread. Returns within about ``timeout_s`` seconds."""
        if not self._closed:
            self._session.ack_drains("exit")
            self._session.ack_pending_stops("exit", None)
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

        ``detach`` tells the daemon that this block ended without an exception; it is
        not taken as the end of the process (the Optuna integration attaches per trial):
        the exit line of :mod:`gpuwatchd.hook._exit` is.
        """
        note_block_end(exc)
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
        self._session.record_step(step_time_s, data_wait_s, samples)

    def apply_knobs(self, live_loaders: Iterable[Any] | None = None) -> dict[str, Any]:
        """Apply pending knob changes now (a safe point) and acknowledge them; return the
        current values.

        For loops that build their own loaders; :meth:`loader` does this at each epoch
        start. With ``live_loaders`` (DataLoaders a framework built, see
        :func:`gpuwatchd.hook._loader.find_dataloaders`), ``num_workers`` and
        ``prefetch_factor`` are set on them in place; a change of ``batch_size`` or
        ``persistent_workers`` is then refused (a built DataLoader cannot take it).
        """
        session = self._session
        taken = session.take_pending()
        loaders = list(live_loaders) if live_loaders is not None else []
        if taken is None:
            self._sync_live(loaders)
            return self.knobs
        knobs, changes = taken
        if live_loaders is None:
            session.commit(knobs, changes)
            return self.knobs
        applied: list[KnobChange] = []
        for change in changes:
            if change.knob in LOADER_KNOBS:
                try:
                    for live in loaders:
                        set_live_loader_knob(live, change.knob, change.value)
                except (KnobError, ValueError, TypeError, AttributeError) as exc:
                    knobs[change.knob] = session.current[change.knob]
                    session.reject([change], str(exc))
                    continue
            applied.append(change)
        session.commit(knobs, applied)
        self._sync_live(loaders)
        return self.knobs

    def _sync_live(self, loaders: list[Any]) -> None:
        """Give live DataLoaders this watch's ``num_workers``/``prefetch_factor`` (a new
        Trainer builds its loaders with the script's values)."""
        current = self._session.current
        for name in ("num_workers", "prefetch_factor"):
            if name not in current:
                continue
            value = current[name]
            for live in loaders:
                if getattr(live, name, None) == value:
                    continue
                try:
                    set_live_loader_knob(live, name, value)
                except (KnobError, ValueError, TypeError, AttributeError) as exc:
                    logger.warning("gpuwatchd: cannot set %s=%r on a loader: %s", name, value, exc)

    def safe_point(self) -> bool:
        """A step boundary: apply a pending ``stop`` (run ``on_stop``, acknowledge it).

        Returns True when training should end now (a stop was applied, now or before, or
        a drain was applied). Cheap when nothing is pending: for custom loops, call it
        after each step. The primary loader and the adapters call it for you.
        """
        if self._session.attention:
            self._apply_stop("step")
        return self.should_stop

    def epoch_end(self) -> bool:
        """An epoch ended: apply a pending ``drain`` (outside a trial); True when training
        should end (a drain or stop was applied). Called by the primary loader and the
        adapters; call it yourself at the end of each epoch in a custom loop."""
        if self._session.drain_requested and not self._session.trial_scoped:
            self._session.ack_drains("epoch_end")
        return self.should_stop

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
        ``host_oom``, ``optuna_error``, ``other``), ``detach`` (the block ended cleanly).
        ``message`` is cut to :data:`EVENT_MESSAGE_MAX_CHARS` characters.
        ``trial_number`` defaults to the current trial's. Kept
        while disconnected (at most 256 events, oldest dropped). Never blocks.
        """
        self._session.queue_event(
            kind,
            message=message,
            number=trial_number,
            trial_state=trial_state,
            crash_kind=crash_kind,
        )

    def report_trial(self, number: int | None, state: str | None) -> None:
        """Send a ``trial`` event: trial ``number`` ended in Optuna ``TrialState`` ``state``
        (``COMPLETE``, ``PRUNED`` or ``FAIL``; other states are not final and ignored).

        At most one event per trial number: a second report of the same trial is ignored,
        also from another thread (Optuna's ``n_jobs > 1``) at the same moment.
        """
        if state not in TRIAL_STATES:
            return
        if number is not None:
            with self._reported_lock:
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

    def report_oom(self, exc: BaseException, *, message: str | None = None) -> None:
        """Count a CUDA out-of-memory error and send an ``oom`` event to the daemon.

        ``message`` defaults to the exception's text (cut to 1000 characters).
        """
        self._oom.report_oom(exc, message=message)

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
        return self._oom.step(fn, batch, optimizer, backward=backward)

    # -- for loader wrappers and framework adapters (training thread) -----------------------
    # WatchedLoader (through the LoaderHost protocol of _host.py), the Lightning and
    # transformers callbacks and the Optuna StudyCallback drive the watch through these.

    @property
    def stop_pending(self) -> bool:
        """True while a daemon ``stop`` waits for the next safe point; cheap (one attribute
        read), meant to be read once per batch before calling :meth:`safe_point`."""
        return self._session.attention

    def stop_exception(self) -> BaseException | None:
        """The exception that ends the current trial once a ``stop`` is applied inside
        :meth:`trial` with optuna imported (an ``optuna.TrialPruned``, for the caller to
        raise); None outside a trial or without optuna."""
        return self._session.stop_exception()

    def set_epoch(self, epoch: int) -> None:
        """The training loop starts epoch ``epoch`` (0-based, the primary loader's or the
        framework's own counter); the step records that follow carry it."""
        self._session.epoch = epoch

    def epoch_finished(self) -> None:
        """The current epoch ran to its end: :meth:`epoch_end` (a safe point for ``drain``),
        once per epoch number however often it is called."""
        epoch = self._session.epoch
        if self._epoch_done == epoch:
            return
        self._epoch_done = epoch
        self.epoch_end()

    def take_pending_knobs(self) -> tuple[dict[str, Any], list[KnobChange]] | None:
        """Take the knob changes the daemon asked for, for a loader to apply now: ``(all
        knob values with the changes applied, the changes)``, or None when none is pending.
        The caller then calls :meth:`commit_knobs` or :meth:`reject_knobs` with them."""
        return self._session.take_pending()

    def commit_knobs(self, knobs: dict[str, Any], changes: Iterable[KnobChange]) -> None:
        """The loader now runs with ``knobs`` (from :meth:`take_pending_knobs`): they become
        :attr:`knobs` and ``changes`` are acknowledged to the daemon as applied."""
        self._session.commit(knobs, changes)

    def reject_knobs(self, changes: Iterable[KnobChange], reason: str) -> None:
        """The loader could not apply ``changes`` (from :meth:`take_pending_knobs`): each
        daemon request among them is answered ``bad_request`` with ``reason`` (a value
        handed back at ``hello`` is logged as a warning); :attr:`knobs` stay as they were."""
        self._session.reject(changes, reason)

    def leave_trial_states_to_callback(self) -> None:
        """A study callback (:class:`gpuwatchd.hook.optuna.StudyCallback`) reports each
        trial's final Optuna state from now on: the :meth:`trial` context then sends only
        the ``FAIL`` of an exception Optuna re-raises (callbacks never see those trials)."""
        self._trial_events_by_callback = True

    # -- the watch's own steps (training thread) ---------------------------------------------

    def _run_on_stop(self) -> str | None:
        errors: list[str] = []
        for callback in list(self._on_stop):
            try:
                callback(self._session.stop_reason)
            except Exception as exc:
                logger.exception("gpuwatchd: the on_stop callback failed; stopping all the same")
                errors.append(f"{type(exc).__name__}: {exc}")
        return "; ".join(errors) or None

    def _apply_stop(self, at: str) -> None:
        """Apply a requested stop now: ``on_stop`` (the first time), then the acks."""
        taken = self._session.take_stops()
        if taken is None:
            return
        stops, first = taken
        error = self._run_on_stop() if first else None
        self._session.ack_stops(stops, at, error)

    def _begin_trial(self, trial: object) -> None:
        mark_worker(trial)
        self._session.trial = trial
        self._session.trial_scoped = True
        self._primary_claimed = False
        self._session.epoch = 0
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
            self.report_trial(trial_number(trial), state)
        session = self._session
        if session.stop_requested and not session.stop_applied:
            self._apply_stop("trial_end")  # the trial ended before its next step
        if session.drain_requested:
            session.ack_drains("trial_end")
        session.trial_scoped = False
        if self.should_stop or session.drain_requested:
            study = getattr(trial, "study", None)
            stop = getattr(study, "stop", None)
            if callable(stop):
                try:
                    stop()  # Optuna: no new trial starts in this study.optimize() call
                except Exception:
                    logger.debug("gpuwatchd: study.stop() failed", exc_info=True)
        session.trial = None


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
