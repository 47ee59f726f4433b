"""Window means over whole columns (numpy), equal to the bit to :class:`~.windows.Window`'s (pure).

The backtest of a trace given as arrays (:mod:`gpuwatchd.backtest_arrays`) needs, at
the few frames where a finding starts, clears or a policy decides, the mean a
:class:`~gpuwatchd.windows.Window` of the same horizon and ``max_samples`` would
return from ``mean_since``. That mean is a difference of running sums, and the
window rebases its running sums when it drops evicted samples (``Window._compact``),
which changes their rounding. :class:`ColumnMeans` replays the same eviction and
rebasing over the whole column with the same float operations in the same order
(running sums are sequential: ``numpy.cumsum`` is, unlike ``numpy.sum``), so the
means are identical, not merely close. Specification: docs/modules.md#gpuwatchdwindows
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

__all__ = ["ColumnMeans", "MeansCarry"]

_COMPACT_MIN: Final = 256
"""``Window._compact`` runs once the evicted prefix holds this many samples and at
least half of the buffer (windows.py)."""


@dataclass(frozen=True, slots=True)
class MeansCarry:
    """What a window holds after the last frame of a chunk, for the next chunk's
    :class:`ColumnMeans`: its buffer from the last compaction on (``times_s``:
    ``(rows,)``; ``values``: ``(rows, columns)``, NaN for a gap; ``held``: the running
    sums as the buffer holds them)."""

    times_s: Any
    values: Any
    held: Any


class ColumnMeans:
    """Means over the last ``for_s`` seconds of every column of ``values``, as windows see them.

    ``times_s``: float64 ``(frames,)``, non-decreasing (the windows' sample times: one
    per frame, every column appended at every frame from frame 0 on). ``values``:
    float64 ``(frames, columns)``, NaN for a gap (an NA sample). ``horizon_s`` and
    ``max_samples`` are the window's. :meth:`mean_at` equals ``Window.mean_since`` at
    that frame, to the bit. ``carry`` (from the previous chunk's :meth:`carry`) continues
    the same windows over a trace read in chunks: steps count from this chunk's first
    frame. Raises ValueError for mismatched shapes.
    """

    def __init__(
        self,
        times_s: Any,
        values: Any,
        horizon_s: float,
        max_samples: int,
        carry: MeansCarry | None = None,
    ) -> None:
        if values.ndim != 2 or values.shape[0] != times_s.shape[0]:
            raise ValueError(f"values {values.shape} do not match times {times_s.shape}")
        prefix = 0 if carry is None else int(carry.times_s.shape[0])
        if carry is not None and prefix:
            times_s = np.concatenate((carry.times_s, times_s))
            values = np.concatenate((carry.values, values))
        self._prefix = prefix
        self._raw = values
        n = times_s.shape[0]
        self._times = times_s
        valid = ~np.isnan(values)
        self._counts = np.cumsum(valid, axis=0, dtype=np.int64)
        filled = np.where(valid, values, 0.0)  # x + 0.0 == x: a gap leaves the sum as it is
        steps = np.arange(n, dtype=np.int64)
        # the head (first retained sample) after each append, as Window.append moves it
        head = np.searchsorted(times_s, times_s - horizon_s, side="left").astype(np.int64)
        head = np.maximum(head, steps + 1 - max_samples)
        self._head = head
        moved = np.empty(n, dtype=bool)
        moved[0] = head[0] != 0
        moved[1:] = head[1:] != head[:-1]
        self._orig = np.empty_like(filled)
        self._comp_t: list[int] = []  # step of each compaction
        self._comp_off: list[int] = []  # first retained sample after it (global index)
        self._comp_base: list[Any] = []  # the running sums subtracted by it, per column
        offset = 0
        begin = prefix
        initial = np.zeros((1, values.shape[1]))
        if carry is not None and prefix:
            self._orig[:prefix] = carry.held
            initial = carry.held[-1:].copy()
        while begin < n:
            at = _next_compaction(head, moved, offset, begin, n)
            end = n if at is None else at + 1
            block = np.concatenate((initial, filled[begin:end]))
            self._orig[begin:end] = np.cumsum(block, axis=0)[1:]
            if at is None:
                break
            base = self._value(int(head[at]) - 1, at - 1)
            self._comp_t.append(at)
            self._comp_off.append(int(head[at]))
            self._comp_base.append(base)
            initial = (self._orig[at] - base)[None, :]
            offset = int(head[at])
            begin = at + 1

    def _value(self, k: int, step: int) -> Any:
        """The running sums of sample ``k`` as the buffer holds them after ``step``."""
        value = self._orig[k]
        first = bisect_left(self._comp_t, k)
        last = bisect_right(self._comp_t, step)
        for j in range(first, last):
            value = value - self._comp_base[j]
        return value

    def carry(self) -> MeansCarry:
        """The windows' state after this chunk's last frame, for the next chunk."""
        n = self._times.shape[0]
        first = self._comp_off[-1] if self._comp_off else 0
        rows = np.arange(first, n, dtype=np.int64)
        held = self._values(rows, np.full(rows.shape[0], n - 1, dtype=np.int64))
        return MeansCarry(self._times[first:].copy(), self._raw[first:].copy(), held)

    def mean_at(self, step: int, for_s: float) -> Any:
        """float64 ``(columns,)``: each column's mean of the valid samples with time >=
        ``times_s[step] - for_s`` as of ``step``; NaN where there is none."""
        step += self._prefix
        i = int(np.searchsorted(self._times, self._times[step] - for_s, side="left"))
        i = max(i, int(self._head[step]))
        j = bisect_right(self._comp_t, step)
        offset = self._comp_off[j - 1] if j else 0
        end = self._value(step, step)
        counts = self._counts[step] - (self._counts[i - 1] if i > 0 else 0)
        before = self._value(i - 1, step) if i > offset else 0.0
        with np.errstate(invalid="ignore", divide="ignore"):
            means = (end - before) / counts.astype(np.float64)
        return np.where(counts > 0, means, np.nan)

    def means(self, for_s: float) -> Any:
        """float64 ``(frames, columns)``: :meth:`mean_at` of every frame at once."""
        times = self._times
        n = times.shape[0]
        steps = np.arange(self._prefix, n, dtype=np.int64)
        first = np.searchsorted(times, times[steps] - for_s, side="left").astype(np.int64)
        first = np.maximum(first, self._head[steps])
        done = np.searchsorted(np.array(self._comp_t, dtype=np.int64), steps, side="right")
        offsets = np.concatenate(([0], np.array(self._comp_off, dtype=np.int64)))[done]
        end = self._values(steps, steps)
        before = self._values(first - 1, steps)
        before = np.where((first > offsets)[:, None], before, 0.0)
        counts = self._counts[steps] - np.where((first > 0)[:, None], self._counts[first - 1], 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            means = (end - before) / counts.astype(np.float64)
        return np.where(counts > 0, means, np.nan)

    def _values(self, samples: Any, steps: Any) -> Any:
        """:meth:`_value` of each ``samples[r]`` as of ``steps[r]`` (rows; vectorised)."""
        values = self._orig[samples]
        if not self._comp_t:
            return values
        comp_t = np.array(self._comp_t, dtype=np.int64)
        bases = np.stack(self._comp_base)
        lo = np.searchsorted(comp_t, samples, side="left")
        hi = np.searchsorted(comp_t, steps, side="right")
        r = 0
        while True:
            rows = np.flatnonzero(lo + r < hi)
            if rows.size == 0:
                return values
            values[rows] = values[rows] - bases[lo[rows] + r]
            r += 1


def _next_compaction(head: Any, moved: Any, offset: int, begin: int, n: int) -> int | None:
    """The first step >= ``begin`` at which ``Window.append`` compacts a buffer whose
    first sample is ``offset``: the head moved, and the evicted prefix holds at least
    ``_COMPACT_MIN`` samples and half of the buffer."""
    chunk = 1024
    while begin < n:
        end = min(n, begin + chunk)
        h = head[begin:end]
        steps = np.arange(begin, end, dtype=np.int64)
        evicted = h - offset
        hit = moved[begin:end] & (evicted >= _COMPACT_MIN) & (2 * evicted >= steps + 1 - offset)
        found = np.flatnonzero(hit)
        if found.size:
            return begin + int(found[0])
        begin = end
        chunk *= 2
    return None
