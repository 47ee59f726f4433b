"""What the framework adapters share: the watch they own, and step timing.

:class:`WatchOwner`: an adapter either uses a watch the user entered, or attaches
one itself when training starts (knobs defaulting to the framework's DataLoader)
and closes it when training ends.

Frameworks (Lightning, the Hugging Face Trainer) own their training loop, so the hook
cannot time ``next()`` on the loader; it times the interval between two batch starts
(the step) and the gap between a batch end and the next batch start (the batch fetch,
i.e. the data wait, plus the framework's own bookkeeping). Only
:func:`time.perf_counter` is read: no CUDA synchronisation.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from time import perf_counter
from typing import Any

from gpuwatchd.hook._watch import Watch, attach

__all__ = ["StepTimer", "WatchOwner"]


class WatchOwner:
    """The :class:`Watch` a framework callback reports through, a member of the callback.

    Holds either the user's ``watch`` (entered by the user, never closed here) or the
    :func:`~gpuwatchd.hook.attach` arguments (``job``, ``knobs``, ``socket``,
    ``report_interval_s``, ``on_stop``) for :meth:`attach_if_needed`, which attaches at
    training start; :meth:`detach` closes only a watch attached here. :attr:`timer`
    times the steps while a watch is there.
    """

    def __init__(
        self,
        watch: Watch | None,
        *,
        job: str | None,
        knobs: Mapping[str, object] | None,
        socket: str | os.PathLike[str] | None,
        report_interval_s: float,
        on_stop: Callable[[str | None], object] | None,
    ) -> None:
        self.watch = watch
        self._owned = watch is None
        self._attach_args: dict[str, Any] = {
            "job": job,
            "knobs": knobs,
            "socket": socket,
            "report_interval_s": report_interval_s,
            "on_stop": on_stop,
        }
        self.timer = StepTimer(watch) if watch is not None else None

    def attach_if_needed(self, default_knobs: Callable[[], Mapping[str, object]]) -> bool:
        """Attach now when owned and not attached; True when it attached.

        ``default_knobs`` gives the knobs when the caller passed none (read from the
        framework's live DataLoader or arguments).
        """
        if self.watch is not None:
            return False
        args = dict(self._attach_args)
        if args["knobs"] is None:
            args["knobs"] = default_knobs()
        self.watch = attach(**args).start()
        self.timer = StepTimer(self.watch)
        return True

    def detach(self) -> None:
        """Close the watch if this adapter attached it."""
        if self._owned and self.watch is not None:
            self.watch.close()
            self.watch = None
            self.timer = None


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
