"""CUDA out-of-memory handling in :meth:`Watch.step <gpuwatchd.hook.Watch.step>`: count
and report the error, and with ``oom="halve"`` halve ``batch_size`` keeping the effective
batch through gradient accumulation. :class:`OomHandler` is a member of ``Watch``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

from gpuwatchd.hook._cuda import is_cuda_oom, release_cached_memory
from gpuwatchd.hook._knobs import divisors
from gpuwatchd.hook._loader import batch_samples, slice_batch
from gpuwatchd.hook._session import BATCH_SIZE, DaemonSession

__all__ = ["OomHandler", "OomPolicy"]

logger = logging.getLogger("gpuwatchd.hook")

OomPolicy = Literal["raise", "halve"]


def _default_backward(loss: Any) -> None:
    loss.backward()


class OomHandler:
    """The training step of :class:`~gpuwatchd.hook.Watch`: gradient accumulation and
    what a CUDA out-of-memory error does (see the module doc).

    ``policy``: ``"raise"`` or ``"halve"``; ``session``: the job's
    :class:`~gpuwatchd.hook._session.DaemonSession`, whose ``batch_size`` knob and
    effective batch size the step reads, to which an OOM is reported and which takes a
    halved ``batch_size``. Its own state: the samples of the current accumulation window
    and :attr:`sync_gradients`. Training thread only.
    """

    def __init__(self, policy: OomPolicy, session: DaemonSession) -> None:
        self.policy: OomPolicy = policy
        self._session = session
        self._window_samples = 0
        self.sync_gradients = False
        """True when the last :meth:`step` completed an accumulation window."""

    @property
    def batch_size(self) -> int | None:
        """The session's current ``batch_size`` knob, None without one."""
        value = self._session.current.get(BATCH_SIZE)
        return int(value) if value is not None else None

    def report_oom(self, exc: BaseException, *, message: str | None = None) -> None:
        """Count a CUDA out-of-memory error and send an ``oom`` event to the daemon.

        ``message`` defaults to the exception's text (cut to 1000 characters).
        """
        self._session.note_oom(message if message is not None else str(exc))

    def step(
        self,
        fn: Callable[[Any], Any],
        batch: Any,
        optimizer: Any = None,
        *,
        backward: Callable[[Any], object] | None = None,
    ) -> list[Any]:
        """One training step (:meth:`Watch.step <gpuwatchd.hook.Watch.step>`, which
        documents it); raises what ``fn`` raises, a CUDA OOM it cannot halve past too."""
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
        effective = self._session.effective_batch_size
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
        effective = self._session.effective_batch_size
        new_size: int | None = None
        if self.policy == "halve" and size is not None and effective is not None:
            fitting = [d for d in divisors(effective) if d <= size // 2]
            spec = self._session.specs[BATCH_SIZE]
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
        self._session.set_local_knob(
            BATCH_SIZE, new_size, "an out-of-memory error halved batch_size"
        )
        return new_size
