"""``attach()`` and the ``Watch`` object: the job-side half of gpuwatchd.

Threading model: the training thread calls :meth:`Watch.record_step` (one tuple
appended to a bounded deque, oldest dropped) and, at epoch starts, takes pending
knob changes under a lock that the background thread holds only for a few dict
operations. All socket I/O runs on the background thread of
:class:`gpuwatchd.hook._connection.Connection`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeVar

from gpuwatchd.control.protocol import ErrorCode, Request, error_reply, ok_reply, request
from gpuwatchd.errors import KnobError
from gpuwatchd.hook._connection import Connection
from gpuwatchd.hook._knobs import KnobSpec, check_value, parse_knobs
from gpuwatchd.hook._loader import LoaderFactory, WatchedLoader
from gpuwatchd.hook._stats import StepRecord, summarize
from gpuwatchd.model import KnobValue

__all__ = ["DEFAULT_SOCKET_PATH", "Watch", "attach", "cuda_devices_from_env"]

logger = logging.getLogger("gpuwatchd.hook")

T = TypeVar("T")

DEFAULT_SOCKET_PATH: Final = "/run/gpuwatchd/control.sock"
"""systemd ``RuntimeDirectory=gpuwatchd`` + ``control.sock`` (design.md)."""
RECORDS_MAX: Final = 16384
"""Step records kept between two reports; older ones are dropped when the thread lags."""
FIRST_CONNECT_WAIT_S: Final = 0.5
"""How long entering ``attach()`` waits for the first connect attempt (a Unix socket
connect is immediate when the daemon is there or absent)."""


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
    params = getattr(trial, "params", None) or {}
    return {
        "number": number if isinstance(number, int) and not isinstance(number, bool) else None,
        "params": {str(k): _json_plain(v) for k, v in dict(params).items()},
    }


def _study_name(study: str | None, trial: object) -> str | None:
    if study is not None:
        return study
    name = getattr(getattr(trial, "study", None), "study_name", None)
    return name if isinstance(name, str) else None


@dataclass(frozen=True, slots=True)
class _Change:
    """A ``set_knob`` accepted but not applied yet."""

    knob: str
    value: KnobValue
    request_id: str | int
    generation: int


class Watch:
    """The job's link to gpuwatchd, returned by :func:`attach`; use it as a context manager.

    Attributes read by the training loop: :attr:`knobs` (current values),
    :attr:`epoch`, :attr:`connected`, :attr:`stop_requested`, :attr:`drain_requested`.
    The daemon's ``drain``/``stop`` are only recorded (and acknowledged): the loop
    decides what to do with them.
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
    ) -> None:
        self.job = job
        self.socket_path = socket_path
        self._specs = dict(knobs)
        self._current: dict[str, KnobValue] = {n: s.value for n, s in self._specs.items()}
        self._trial = trial
        self._study = study
        self._cuda_devices = list(cuda_devices) if cuda_devices is not None else []
        self._lock = threading.Lock()
        self._pending: dict[str, _Change] = {}
        self._applying = False  # pending changes taken by an epoch start, not yet committed
        self._outbox: deque[tuple[int, dict[str, Any]]] = deque(maxlen=1024)
        self._records: deque[StepRecord] = deque(maxlen=RECORDS_MAX)
        self._steps_total = 0
        self._epoch = 0
        self._loaders = 0
        self._closed = False
        self.stop_requested = False
        """The daemon sent ``stop`` (see :attr:`stop_reason`)."""
        self.stop_reason: str | None = None
        self.drain_requested = False
        """The daemon sent ``drain``: finish the current unit of work, start no new one."""
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
        """0-based index of the current epoch: how often the first loader was iterated, - 1."""
        return self._epoch

    @property
    def steps(self) -> int:
        """Training steps recorded since attach."""
        return self._steps_total

    @property
    def connected(self) -> bool:
        """True while connected to the daemon (``hello`` sent)."""
        return self._connection.connected

    def start(self) -> Watch:
        """Start the background thread and wait briefly (0.5 s at most) for the first connect."""
        if self._closed:
            raise RuntimeError("this Watch was closed; call attach() again")
        self._connection.start()
        self._connection.wait_first_attempt(FIRST_CONNECT_WAIT_S)
        return self

    def close(self, timeout_s: float = 1.0) -> None:
        """Flush a last report (best effort), close the socket and stop the thread.

        Returns within about ``timeout_s`` seconds whatever the daemon does.
        """
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
        self.close()

    def loader(self, factory: LoaderFactory[T]) -> WatchedLoader[T]:
        """Wrap ``factory(knobs) -> DataLoader`` (any iterable of batches) for timing and knobs.

        ``knobs`` is a dict of the current knob values. The factory is called now and
        again at an epoch start after a knob change; the old loader is dropped, so a
        DataLoader's worker processes shut down. Errors of the first call propagate; a
        failing rebuild keeps the old loader and answers the daemon with ``bad_request``.
        The first loader created counts epochs (:attr:`epoch`).
        """
        primary = self._loaders == 0
        self._loaders += 1
        return WatchedLoader(self, factory, primary=primary)

    def record_step(self, step_time_s: float, data_wait_s: float, samples: int = 1) -> None:
        """Record one training step (for loops that do not use :meth:`loader`).

        ``step_time_s``: wall seconds of the whole step, data wait included;
        ``data_wait_s``: seconds spent waiting for the batch; ``samples``: batch size.
        Cheap and non-blocking: one append to a bounded deque.
        """
        self._steps_total += 1
        self._records.append((step_time_s, data_wait_s, samples, self._epoch))

    def apply_knobs(self) -> dict[str, Any]:
        """Apply pending knob changes now and acknowledge them; return the current values.

        For loops that build their own loaders; :meth:`loader` does this at each epoch start.
        """
        taken = self._take_pending()
        if taken is not None:
            self._commit(*taken)
        return self.knobs

    # -- used by WatchedLoader (training thread) -----------------------------------------

    def _set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

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
        """The ``hello`` request of protocol v1 with the current knob values."""
        current = self._current
        return request(
            request_id,
            "hello",
            role="job",
            job=self.job,
            pid=os.getpid(),
            cuda_devices=list(self._cuda_devices),
            knobs={name: spec.as_hello(current[name]) for name, spec in self._specs.items()},
            study=_study_name(self._study, self._trial),
            trial=_trial_info(self._trial),
        )

    def take_report(self) -> dict[str, Any] | None:
        """Drain the step records into one ``report`` object (None without steps)."""
        records: list[StepRecord] = []
        pop = self._records.popleft
        try:
            while True:
                records.append(pop())
        except IndexError:
            pass
        return summarize(records, self._steps_total)

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
        """Drop the knob changes asked by connection ``generation``: no one can be told."""
        with self._lock:
            for name in [n for n, c in self._pending.items() if c.generation == generation]:
                logger.debug("gpuwatchd: dropped pending %s: its daemon connection is gone", name)
                del self._pending[name]

    def handle_request(self, message: Request, generation: int) -> list[dict[str, Any]]:
        """Answer a daemon request: ``set_knob`` (maybe deferred), ``drain``, ``stop``."""
        if message.op == "set_knob":
            return self._handle_set_knob(message, generation)
        if message.op == "drain":
            self.drain_requested = True
            return [ok_reply(message.id, {"drain_requested": True})]
        if message.op == "stop":
            reason = message.params.get("reason")
            self.stop_reason = reason if isinstance(reason, str) else None
            self.stop_requested = True
            return [ok_reply(message.id, {"stop_requested": True})]
        return [
            error_reply(
                message.id,
                ErrorCode.UNKNOWN_OP,
                f"a job connection does not handle op {message.op!r} "
                "(it handles set_knob, drain, stop)",
            )
        ]

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
            value = check_value(spec, message.params["value"])
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


def attach(
    job: str | None = None,
    knobs: Mapping[str, object] | None = None,
    trial: object = None,
    socket: str | os.PathLike[str] | None = None,
    *,
    study: str | None = None,
    report_interval_s: float = 0.5,
) -> Watch:
    """Attach this training process to gpuwatchd; use the result in a ``with`` block.

    - ``job``: the job's name; default ``$GPUWATCHD_JOB`` (set by the supervisor for
      managed workers), else the script's name.
    - ``knobs``: ``{name: value}`` or ``{name: {"value": v, "min": a, "max": b}}``; see
      :func:`gpuwatchd.hook._knobs.parse_knobs` for kinds and default bounds
      (``num_workers`` [0, 64], ``prefetch_factor`` [1, 64], ``persistent_workers`` bool).
    - ``trial``: an Optuna trial (anything with ``.number`` and ``.params``); its number,
      params and ``trial.study.study_name`` are reported in ``hello``.
    - ``socket``: the control socket; default ``$GPUWATCHD_SOCKET``, else
      ``/run/gpuwatchd/control.sock``.
    - ``study``: the Optuna study name when no trial carries it.
    - ``report_interval_s``: seconds between reports, at least 0.25 (4 per second).

    Raises :class:`gpuwatchd.errors.KnobError` for a bad ``knobs`` declaration. Nothing
    connects until the ``with`` block is entered; without a daemon the job runs
    untouched, one warning is logged on ``logging.getLogger("gpuwatchd.hook")`` and the
    hook keeps retrying in the background (0.5 s doubling to 10 s).
    """
    specs = parse_knobs(knobs)
    path = os.fspath(socket) if socket is not None else _default_socket_path()
    return Watch(
        job=job or _default_job_name(),
        knobs=specs,
        socket_path=path,
        trial=trial,
        study=study,
        report_interval_s=report_interval_s,
        cuda_devices=cuda_devices_from_env(),
    )
