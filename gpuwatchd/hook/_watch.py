"""``attach()`` and the ``Watch`` object: the job-side half of gpuwatchd.

The watch's daemon session is in :mod:`._session`, its OOM handling in :mod:`._oom`;
threading model and safe points: docs/hook-internals.md.
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

from gpuwatchd.errors import KnobError
from gpuwatchd.hook._connection import Connection
from gpuwatchd.hook._cuda import (
    crash_kind,
    is_trial_pruned,
)
from gpuwatchd.hook._exit import note_block_end, register_exit_line
from gpuwatchd.hook._host import Command, KnobChange
from gpuwatchd.hook._knobs import KnobSpec, parse_knobs
from gpuwatchd.hook._loader import (
    LoaderFactory,
    WatchedLoader,
    set_live_loader_knob,
)
from gpuwatchd.hook._oom import OomHandling, OomPolicy
from gpuwatchd.hook._session import (
    BATCH_SIZE,
    DaemonSession,
    mark_worker,
)
from gpuwatchd.hook._session import (
    trial_number as _trial_number,
)
from gpuwatchd.hook._stats import StepRecord
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

DEFAULT_SOCKET_PATH: Final = "/run/gpuwatchd/control.sock"
"""systemd ``RuntimeDirectory=gpuwatchd`` + ``control.sock`` (docs/design.md, "Configuration")."""
RECORDS_MAX: Final = 16384
"""Step records kept between two reports; older ones are dropped when the thread lags."""
EVENTS_MAX: Final = 256
"""Job events (OOM, trial, crash) kept for the daemon, also across a reconnect; oldest dropped."""
EVENT_MESSAGE_MAX_CHARS: Final = 1000
"""The daemon refuses longer event messages (``control.server.EVENT_MESSAGE_MAX_CHARS``)."""
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


class Watch(DaemonSession, OomHandling):
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
        self._refused_knobs: set[str] = set()  # knobs a daemon's hello refused
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
        self._pending: dict[str, KnobChange] = {}
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
        self._stops: list[Command] = []
        self._drains: list[Command] = []
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
        if self._trial is not None and not self._trial_scoped:
            mark_worker(self._trial)
        self._connection.start()
        self._connection.wait_first_attempt(FIRST_CONNECT_WAIT_S)
        self._connection.wait_hello(HELLO_WAIT_S)
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
        loaders = list(live_loaders) if live_loaders is not None else []
        if taken is None:
            self._sync_live(loaders)
            return self.knobs
        knobs, changes = taken
        if live_loaders is None:
            self._commit(knobs, changes)
            return self.knobs
        applied: list[KnobChange] = []
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
        self._sync_live(loaders)
        return self.knobs

    def _sync_live(self, loaders: list[Any]) -> None:
        """Give live DataLoaders this watch's ``num_workers``/``prefetch_factor`` (a new
        Trainer builds its loaders with the script's values)."""
        for name in ("num_workers", "prefetch_factor"):
            if name not in self._current:
                continue
            value = self._current[name]
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
        ``trial_number`` defaults to the current trial's. Kept
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

    # -- used by WatchedLoader and TrialScope (training thread) -------------------------------

    def _set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def _epoch_finished(self) -> None:
        if self._epoch_done == self._epoch:
            return
        self._epoch_done = self._epoch
        self.epoch_end()

    def _begin_trial(self, trial: object) -> None:
        mark_worker(trial)
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
