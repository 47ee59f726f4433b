"""CUDA out-of-memory handling in :meth:`Watch.step <gpuwatchd.hook.Watch.step>`: count
and report the error, and with ``oom="halve"`` halve ``batch_size`` keeping the effective
batch through gradient accumulation. :class:`OomHandling` is a base of ``Watch``."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from gpuwatchd.control.protocol import ErrorCode, error_reply
from gpuwatchd.hook._connection import Connection
from gpuwatchd.hook._cuda import is_cuda_oom, release_cached_memory
from gpuwatchd.hook._host import KnobChange
from gpuwatchd.hook._knobs import KnobSpec, divisors
from gpuwatchd.hook._loader import batch_samples, slice_batch
from gpuwatchd.hook._session import BATCH_SIZE
from gpuwatchd.model import KnobValue

__all__ = ["OomHandling", "OomPolicy"]

logger = logging.getLogger("gpuwatchd.hook")

OomPolicy = Literal["raise", "halve"]


def _default_backward(loss: Any) -> None:
    loss.backward()


class OomHandling:
    """The training-step methods of :class:`~gpuwatchd.hook.Watch` (see the module doc);
    the attributes are the watch's, set in ``Watch.__init__``."""

    sync_gradients: bool
    _specs: dict[str, KnobSpec]
    _current: dict[str, KnobValue]
    _effective: int | None
    _oom_policy: OomPolicy
    _oom_events: int
    _window_samples: int
    _lock: threading.Lock
    _pending: dict[str, KnobChange]
    _outbox: deque[tuple[int, dict[str, Any]]]
    _connection: Connection

    if TYPE_CHECKING:

        @property
        def batch_size(self) -> int | None: ...

        def report_event(self, kind: Literal["oom"], *, message: str = "") -> None: ...

    def report_oom(self, exc: BaseException, *, message: str | None = None) -> None:
        """Count a CUDA out-of-memory error and send an ``oom`` event to the daemon.

        ``message`` defaults to the exception's text (cut to 1000 characters).
        """
        self._oom_events += 1
        self.report_event("oom", message=message if message is not None else str(exc))

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
