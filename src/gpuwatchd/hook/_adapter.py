"""What the framework adapters share: step timing from batch-start/batch-end hooks.

Frameworks (Lightning, the Hugging Face Trainer) own their training loop, so the hook
cannot time ``next()`` on the loader; it times the interval between two batch starts
(the step) and the gap between a batch end and the next batch start (the batch fetch,
i.e. the data wait, plus the framework's own bookkeeping). Only
:func:`time.perf_counter` is read: no CUDA synchronisation.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwatchd.hook._watch import Watch

__all__ = ["StepTimer"]


class StepTimer:
    """Records one step into ``watch`` per batch, from batch start/end calls.

    A step spans from one batch start to the next (or to the epoch's end); its data
    wait is the gap between the previous batch end and its own start (0 for the first
    batch of an epoch, whose fetch includes starting the DataLoader workers).
    """

    __slots__ = ("_last_end_s", "_samples", "_start_s", "_wait_s", "watch")

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self._start_s = -1.0
        self._last_end_s = -1.0
        self._wait_s = 0.0
        self._samples = 0

    def batch_start(self, samples: int) -> None:
        """A batch of ``samples`` samples starts now (records the previous step)."""
        now_s = perf_counter()
        if self._start_s >= 0.0:
            self.watch.record_step(now_s - self._start_s, self._wait_s, self._samples)
        self._wait_s = now_s - self._last_end_s if self._last_end_s >= 0.0 else 0.0
        self._start_s = now_s
        self._samples = samples

    def batch_end(self) -> None:
        """The current batch's step (forward, backward, optimizer) is done."""
        self._last_end_s = perf_counter()

    def epoch_end(self) -> None:
        """The epoch ended: record its last step and forget the epoch's timestamps."""
        if self._start_s >= 0.0:
            end_s = self._last_end_s if self._last_end_s >= self._start_s else perf_counter()
            self.watch.record_step(end_s - self._start_s, self._wait_s, self._samples)
        self._start_s = -1.0
        self._last_end_s = -1.0
