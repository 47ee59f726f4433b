"""GPU detectors over whole columns (numpy): which frames each one reports on (pure).

For the backtest of a trace given as arrays (:mod:`gpuwatchd.backtest_arrays`):
:func:`column_detector` wraps a ``vram_above``, ``low_utilization`` or ``idle_gpu``
instance and computes, for every frame and GPU at once, whether it reports a finding
and since which frame its condition holds -- the same verdicts its ``evaluate`` gives
tick by tick (window semantics of docs/modules.md#gpuwatchddetectors: ``for:``, the
``clear`` level, streaks broken by an NA sample or a pause longer than ``max_gap_s``).
:meth:`ColumnDetector.finding` builds the very :class:`~gpuwatchd.model.Finding` the
detector would have returned at one frame (means from :mod:`gpuwatchd.windows_arrays`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuwatchd.detectors.base import EPS_S, Detector, ThresholdDetector
from gpuwatchd.detectors.gpu import IdleGpu, LowUtilization, VramAbove
from gpuwatchd.model import Finding
from gpuwatchd.windows_arrays import ColumnMeans

__all__ = ["ColumnDetector", "DetectorCarry", "column_detector"]

MeansOf = Callable[[str], ColumnMeans]
"""The :class:`ColumnMeans` of a GPU metric (``utilization_gpu_pct``, ...)."""


@dataclass(frozen=True, slots=True)
class DetectorCarry:
    """A :class:`ColumnDetector`'s state after the last frame of a chunk, per GPU column
    (``(gpus,)`` arrays), for the next chunk of a trace read in chunks: ``holds`` and
    ``streak_since_s`` (the condition and since when it holds), ``plain_hit`` (reported
    before the ``clear`` level's hold), ``hit`` and ``since_s`` (reported, and since
    when); ``seen_s``: when the GPU was first seen since the start or the last gap."""

    holds: Any
    streak_since_s: Any
    plain_hit: Any
    hit: Any
    since_s: Any
    seen_s: float


class ColumnDetector:
    """One GPU detector's verdicts over a whole trace.

    ``hit``: bool ``(frames, gpus)``, True where the detector reports a finding;
    ``since_s``: float ``(frames, gpus)``, the trace time its condition has held since
    (valid where ``hit``). ``carry`` continues the previous chunk (:meth:`carry`).
    ``values``: the metric's column (NaN = NA). ``subjects``, ``uuids``, ``indexes``:
    per GPU column. ``means(metric)`` gives that metric's
    :class:`ColumnMeans` (built on first use).
    """

    def __init__(
        self,
        detector: ThresholdDetector | IdleGpu,
        values: Any,
        times_s: Any,
        gaps: Any,
        uuids: Sequence[str],
        indexes: Sequence[int],
        means: MeansOf,
        carry: DetectorCarry | None = None,
    ) -> None:
        self.detector = detector
        self._in = carry
        self._gaps = gaps
        self.values = values
        self.times_s = times_s
        self.uuids = tuple(uuids)
        self.indexes = tuple(indexes)
        self.subjects = tuple("gpu:" + u for u in uuids)
        self._means = means
        self._cache: dict[int, Any] = {}
        self.window_means: Any = None
        """``statistic: mean``: the judged window means (NaN where not judged)."""
        need_s = detector.for_s - EPS_S
        valid = ~np.isnan(values)
        if getattr(detector, "statistic", "every") == "mean":
            self._judge_means(detector, times_s, gaps)
        elif isinstance(detector, IdleGpu):
            holds = valid & (values <= detector.threshold) & (_others_max(values) >= detector.busy)
            self._streak(holds, need_s)
        elif detector.above:
            strict = valid & (values > detector.threshold)
            self._streak(strict, need_s)
            if detector.clear != detector.threshold:
                self._hold(valid & (values > detector.clear))
        else:
            strict = valid & (values < detector.threshold)
            self._streak(strict, need_s)
            if detector.clear != detector.threshold:
                self._hold(valid & (values < detector.clear))

    def _judge_means(self, detector: ThresholdDetector | IdleGpu, times_s: Any, gaps: Any) -> None:
        """``statistic: mean`` (LowUtilization, IdleGpu): the window mean is judged at each
        frame once the GPU was seen for ``for:`` (since the start or the last gap); it
        matches below the threshold, and once matching, below the clear level."""
        n = times_s.shape[0]
        frames = np.arange(n, dtype=np.int64)
        reset = gaps.copy()
        carried = self._in is not None and not bool(gaps[0])
        reset[0] = not carried
        seen = np.maximum.accumulate(np.where(reset, frames, -1))
        seen_s = times_s[np.maximum(seen, 0)]
        if carried:
            assert self._in is not None
            seen_s = np.where(seen >= 0, seen_s, self._in.seen_s)
        self._seen_last_s = float(seen_s[-1])
        full = times_s - seen_s >= detector.for_s - EPS_S
        means = self._means(detector.metric).means(detector.for_s)
        means = np.where(full[:, None], means, np.nan)
        self.window_means = means
        if isinstance(detector, IdleGpu):
            busy = _others_max(means) >= detector.busy
            strict = (means <= detector.threshold) & busy
            held = (means <= detector.clear) & busy
        else:
            strict = means < detector.threshold
            held = means < detector.clear
        self._streak(strict, -math.inf)
        if detector.clear != detector.threshold:
            self._hold(held)

    def _streak(self, holds: Any, need_s: float) -> None:
        """Set ``hit`` and ``since_s`` from the condition ``holds`` (see :func:`_streaks`),
        continuing the previous chunk's streaks."""
        carry = self._in
        self._holds_last = holds[-1].copy()
        self.hit, self.since_s = _streaks(
            holds,
            self.times_s,
            self._gaps,
            need_s,
            None if carry is None else (carry.holds, carry.streak_since_s),
        )
        self._streak_since_last = self.since_s[-1].copy()
        self._plain_hit_last = self.hit[-1].copy()

    def _hold(self, held: Any) -> None:
        carry = self._in
        _hold(
            self.hit,
            self.since_s,
            held,
            self._gaps,
            None
            if carry is None
            else (carry.plain_hit, carry.streak_since_s, carry.hit, carry.since_s),
        )
        self._plain_hit_last = self._plain_hit_last  # (before the hold, as taken above)

    def carry(self) -> DetectorCarry:
        """The state after this chunk's last frame (:class:`DetectorCarry`)."""
        return DetectorCarry(
            self._holds_last,
            self._streak_since_last,
            self._plain_hit_last,
            self.hit[-1].copy(),
            self.since_s[-1].copy(),
            getattr(self, "_seen_last_s", math.nan),
        )

    def _mean(self, step: int) -> Any:
        means = self._cache.get(step)
        if means is None:
            detector = self.detector
            means = self._cache[step] = self._means(detector.metric).mean_at(step, detector.for_s)
        return means

    def finding(self, step: int, column: int) -> Finding:
        """The finding the detector reports at frame ``step`` for GPU column ``column``
        (where ``hit[step, column]``), equal to the one its ``evaluate`` returns."""
        detector = self.detector
        now = float(self.times_s[step])
        entry = (self.subjects[column], None, self.uuids[column], self.indexes[column])
        if self.window_means is not None:
            since = float(self.since_s[step, column]) - detector.for_s
            mean = float(self.window_means[step, column])
            if isinstance(detector, IdleGpu):
                row = self.window_means[step].tolist()
                peers = [m for k, m in enumerate(row) if k != column and not math.isnan(m)]
                return detector.mean_finding(entry, now, since, mean, peers)
            return detector.finding(entry, now, since, mean, mean >= detector.threshold)
        since = float(self.since_s[step, column])
        value = float(self.values[step, column])
        mean = float(self._mean(step)[column])
        if math.isnan(mean):
            mean = value
        if isinstance(detector, IdleGpu):
            row = [None if math.isnan(v) else float(v) for v in self.values[step]]
            busy = _busy_peer(row, column)
            busy_value = row[busy]
            assert busy_value is not None
            return detector.finding(entry, self.indexes[busy], busy_value, now, since, mean)
        if detector.clear == detector.threshold:
            return detector.finding(entry, now, since, mean)
        held = value <= detector.threshold if detector.above else value >= detector.threshold
        return detector.finding(entry, now, since, mean, held)


def column_detector(
    detector: Detector,
    columns: dict[str, Any],
    times_s: Any,
    gaps: Any,
    uuids: Sequence[str],
    indexes: Sequence[int],
    means: MeansOf,
    carry: DetectorCarry | None = None,
) -> ColumnDetector | None:
    """A :class:`ColumnDetector` for a GPU detector, or None for any other detector.

    ``columns`` maps GPU metric names (windows.GPU_METRICS) to float64 ``(frames, gpus)``
    arrays; ``gaps``: bool ``(frames,)``, True where the streaks break before the frame.
    """
    if type(detector) not in (VramAbove, LowUtilization, IdleGpu):
        return None
    assert isinstance(detector, (ThresholdDetector, IdleGpu))
    return ColumnDetector(
        detector, columns[detector.metric], times_s, gaps, uuids, indexes, means, carry
    )


def _others_max(values: Any) -> Any:
    """``(frames, gpus)``: the largest valid value among the *other* GPUs of each frame
    (-inf where there is none)."""
    filled = np.where(np.isnan(values), -np.inf, values)
    if filled.shape[1] < 2:
        return np.full(filled.shape, -np.inf)
    ordered = np.sort(filled, axis=1)
    top, second = ordered[:, -1], ordered[:, -2]
    first = np.argmax(filled, axis=1)
    others = np.repeat(top[:, None], filled.shape[1], axis=1)
    others[np.arange(filled.shape[0]), first] = second
    return others


def _streaks(
    holds: Any, times_s: Any, gaps: Any, need_s: float, carry: tuple[Any, Any] | None = None
) -> tuple[Any, Any]:
    """``(hit, since_s)`` of a condition ``holds`` (bool ``(frames, gpus)``): a streak
    begins where the condition starts to hold or after a gap; a frame reports when
    its streak has lasted ``need_s`` seconds (``now - start >= need_s``). ``carry``:
    ``(holds, since_s)`` per GPU at the frame before the first (a previous chunk)."""
    n = holds.shape[0]
    begins = holds.copy()
    begins[1:] &= ~holds[:-1] | gaps[1:, None]
    if carry is not None and not bool(gaps[0]):
        begins[0] &= ~carry[0]
    frames = np.arange(n, dtype=np.int64)[:, None]
    since = np.maximum.accumulate(np.where(begins, frames, -1), axis=0)
    since_s = times_s[np.maximum(since, 0)]
    if carry is not None:
        since_s = np.where(since >= 0, since_s, carry[1][None, :])
    hit = holds & (times_s[:, None] - since_s >= need_s)
    return hit, since_s


def _hold(
    hit: Any, since_s: Any, held: Any, gaps: Any, carry: tuple[Any, Any, Any, Any] | None = None
) -> None:
    """Extend each run of ``hit`` (in place) while the ``clear`` level ``held`` holds:
    once reporting, a subject keeps reporting, with the same ``since_s``, until its value
    fails the clear level or a gap breaks the streak (ThresholdDetector's hysteresis).
    ``carry``: ``(plain hit, streak since, hit, since)`` per GPU at the frame before the
    first (a previous chunk; plain: before this extension)."""
    n, width = hit.shape
    breaks = ~held
    breaks[1:] |= gaps[1:, None]
    if carry is not None and bool(gaps[0]):
        breaks[0] = True
    for column in range(width):
        col_hit = hit[:, column]
        col_since = since_s[:, column]
        # a finding starts where the plain verdict reports after not reporting, or
        # reports a new streak (after a gap, with ``for: 0``)
        fresh = col_hit.copy()
        fresh[1:] &= ~col_hit[:-1] | (col_since[1:] != col_since[:-1])
        stops = np.flatnonzero(breaks[:, column])
        covered = -1
        if carry is not None:
            plain_hit, streak_since, last_hit, last_since = (c[column] for c in carry)
            if fresh[0] and plain_hit and col_since[0] == streak_since:
                fresh[0] = False
            if last_hit:  # a run still reporting: on to the first frame that breaks it
                end = int(stops[0]) if stops.size else n
                col_hit[0:end] = True
                col_since[0:end] = last_since
                covered = end - 1
        starts = np.flatnonzero(fresh)
        for start in starts.tolist():
            if start <= covered:
                continue
            j = int(np.searchsorted(stops, start, side="right"))
            end = int(stops[j]) if j < stops.size else n  # the first frame that breaks it
            col_hit[start:end] = True
            col_since[start:end] = col_since[start]
            covered = end - 1


def _busy_peer(values: Sequence[float | None], column: int) -> int:
    """The GPU ``idle_gpu`` names as busy next to ``column``: IdleGpu.evaluate's choice
    (the first busiest GPU, or the first busiest other one when ``column`` is it)."""
    best, best_at = -1.0, -1
    for i, value in enumerate(values):
        if value is not None and value > best:
            best, best_at = value, i
    return best_at if column != best_at else IdleGpu.second_at(values, column)
