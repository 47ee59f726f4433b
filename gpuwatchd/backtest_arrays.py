"""Backtests over arrays: the per-sample engine's events, computed a whole trace at a time (pure).

:func:`backtest_columns` gives, for a trace as :class:`~gpuwatchd.sampling.columns.TraceColumns`,
the same events as :func:`gpuwatchd.backtest.run_backtest` stepping a
:class:`~gpuwatchd.policy.engine.PolicyEngine` through every frame, in a fraction of
the time. A replayed trace has GPU samples only (no host sample, no job, no job
event), so only the GPU detectors (``vram_above``, ``low_utilization``, ``idle_gpu``)
can report; their verdicts are computed per column (:mod:`gpuwatchd.detectors.arrays`);
findings are built only at the frames where the set of findings changes; and the
engine's own decision code (``PolicyEngine.fire``: groups, cooldowns, rate limits,
actions) runs only at the frames where a policy can decide, which it finds from its
conditions' verdicts and its cooldowns. It returns None (use the per-sample engine)
for what it does not cover: detectors other than those (a later addition), two
conditions with the same detector and threshold (the ambiguous keys of
backtest._Keys), times that go backwards, infinite or negative values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuwatchd.backtest_events import (
    DecisionTaken,
    EventList,
    EventsMade,
    FindingCleared,
    FindingStarted,
    finding_order,
)
from gpuwatchd.detectors import (
    AllocatedButIdle,
    DataStarved,
    EccDbe,
    GpuLost,
    GpuRecovered,
    GpuThrottled,
    HostCpuAbove,
    HostCpuBelow,
    HostMemoryAbove,
    JobCrashed,
    JobStalled,
    RowRemap,
    TrialsSucceededInRow,
    WorkerGivenUp,
    Xid,
)
from gpuwatchd.detectors.arrays import ColumnDetector, DetectorCarry, column_detector
from gpuwatchd.model import Decision, Finding, Snapshot
from gpuwatchd.policy import action_names
from gpuwatchd.policy.engine import CompiledPolicy, DetectorKey, PolicyEngine
from gpuwatchd.sampling.columns import TraceColumns
from gpuwatchd.windows_arrays import ColumnMeans, MeansCarry

__all__ = ["ARRAY_METRICS", "ArrayBacktest", "backtest_columns"]

_SILENT_IN_TRACES = (
    HostCpuAbove,
    HostCpuBelow,
    HostMemoryAbove,
    DataStarved,
    JobCrashed,
    TrialsSucceededInRow,
    WorkerGivenUp,
    JobStalled,
    Xid,
    EccDbe,
    RowRemap,
    GpuLost,
    GpuThrottled,
    GpuRecovered,
    AllocatedButIdle,
)
"""Detectors of the host, of jobs' reports, of job events, of managed jobs, of hardware
faults (Xid errors, ECC, row remapping, lost GPUs, clock event reasons) and of Slurm
allocations (attached jobs, GPU processes' environment): a CSV trace
(:class:`TraceColumns`) has none of those."""

ARRAY_METRICS = ("utilization_gpu_pct", "memory_used_bytes", "memory_total_bytes")
"""The :class:`TraceColumns` metrics the array backtest reads (:func:`_metric_columns`);
a reader streaming a trace to it may leave the others out (NaN)."""

_SLACK_S = 1e-3
"""Cooldown ends are looked for this much early: a step too early only costs a call."""


def _metric_columns(columns: TraceColumns) -> dict[str, Any]:
    """The GPU window metrics (windows.GPU_METRICS) as columns, NaN where a window
    gets a gap: the same extractors, the same float operations."""
    used, total = columns.memory_used_bytes, columns.memory_total_bytes
    with np.errstate(invalid="ignore", divide="ignore"):
        pct = 100.0 * used / total
    known = ~np.isnan(used) & ~np.isnan(total) & (total > 0)
    util = columns.utilization_gpu_pct
    return {
        "utilization_gpu_pct": util,
        # A CSV trace has no SM activity (GPM): ``sm_active`` never matches and ``auto``
        # judges utilization.gpu, as the windows do with SM activity NA.
        "sm_active_pct": np.full(util.shape, np.nan),
        "busy_auto_pct": util,
        "memory_used_pct": np.where(known, pct, np.nan),
        "memory_used_bytes": used,
        "compute_processes": columns.compute_processes,
    }


def _usable(values: Any) -> bool:
    """Finite, non-negative where known (a -0.0 or an infinity would round or sum
    differently from the windows' running sums)."""
    known = values[~np.isnan(values)]
    return bool(np.all(np.isfinite(known)) and not np.any(np.signbit(known)))


def backtest_columns(
    columns: TraceColumns,
    engine: PolicyEngine,
    status: str,
    ambiguous: bool,
    max_events: int | None = None,
) -> EventsMade | None:
    """``(events made, findings started, decisions)`` of ``columns`` through the fresh
    ``engine``, or None when the trace or the policies need the per-sample engine.

    ``status`` is the snapshots' ``gpu_status``; ``ambiguous`` is True when two
    conditions share a detector and threshold (backtest._Keys); ``max_events`` keeps
    the first that many events (None: all; the rest counted, :class:`EventList`).
    """
    run = ArrayBacktest(engine, status, ambiguous, max_events)
    if not run.feed(columns):
        return None
    return run.finish()


class ArrayBacktest:
    """A backtest over arrays fed a trace in chunks of frames, in time order: the same
    events as :func:`backtest_columns` on the whole trace (the windows' running sums,
    the detectors' streaks and holds, the findings that hold and the engine's cooldowns
    are carried from one chunk to the next), in memory that does not grow with the trace.

    :meth:`feed` each chunk (a :class:`TraceColumns` with the same GPUs), then
    :meth:`finish`. ``engine``, ``status``, ``ambiguous``, ``max_events`` as in
    :func:`backtest_columns`: past ``max_events`` events are counted
    (:attr:`EventList.omitted <gpuwatchd.backtest_events.EventList>`), not kept, and the
    counts of findings and decisions still cover every one.
    """

    def __init__(
        self, engine: PolicyEngine, status: str, ambiguous: bool, max_events: int | None = None
    ) -> None:
        self._engine = engine
        self._status = status
        self._ambiguous = ambiguous
        self._means: dict[str, MeansCarry] = {}
        self._carry: dict[DetectorKey, DetectorCarry] = {}
        self._hit: list[Any] | None = None  # per detector: bool (gpus,) at the last frame
        self._last: dict[tuple[int, int], Finding] = {}  # findings holding at the last frame
        self._started: dict[tuple[int, int], float] = {}
        self._start_s: float | None = None
        self._end_s = 0.0
        self._events_made = EventList(max_events)
        self.started_count = 0
        self.decision_count = 0

    def feed(self, columns: TraceColumns) -> bool:
        """Backtest the next chunk; False when it needs the per-sample engine (then the
        whole trace does: nothing more may be fed)."""
        engine = self._engine
        times = columns.timestamps_s
        n = columns.frame_count
        if self._ambiguous or n == 0 or bool(np.any(np.diff(times) < 0)):
            return False
        previous_s = None if self._start_s is None else self._end_s
        if previous_s is not None and float(times[0]) < previous_s:
            return False
        if self._start_s is None:
            self._start_s = float(times[0])
        metrics = _metric_columns(columns)
        gaps = np.zeros(n, dtype=bool)
        if engine.max_gap_s is not None:
            gaps[1:] = np.diff(times) > engine.max_gap_s
            if previous_s is not None:
                gaps[0] = float(times[0]) - previous_s > engine.max_gap_s
        windows = engine.windows
        needs = windows.needs
        means: dict[str, ColumnMeans] = {}

        def means_of(metric: str) -> ColumnMeans:
            got = means.get(metric)
            if got is None:
                horizon = needs["gpu", metric]
                got = means[metric] = ColumnMeans(
                    times, metrics[metric], horizon, windows.max_samples, self._means.get(metric)
                )
            return got

        detectors: dict[DetectorKey, ColumnDetector] = {}
        shown: set[tuple[str, str]] = set()
        for key, detector in engine.detectors.items():
            if isinstance(detector, _SILENT_IN_TRACES):
                continue
            # PolicyEngine.step drops a finding whose (detector, subject, message) another
            # detector reported: thresholds that print alike may collide; step those.
            threshold = getattr(detector, "threshold", None)
            label = (detector.name, f"{threshold:g}" if isinstance(threshold, float) else "")
            if label in shown:
                return False
            shown.add(label)
            metric = getattr(detector, "metric", None)
            if metric not in metrics or not _usable(metrics[metric]):
                return False
            made = column_detector(
                detector,
                metrics,
                times,
                gaps,
                columns.uuids,
                columns.indexes,
                means_of,
                self._carry.get(key),
            )
            if made is None:
                return False
            detectors[key] = made
        decisions = _decisions(columns, engine, detectors, self._status)
        found = list(detectors.values())
        self._events(columns, found, decisions)
        for key, made in detectors.items():
            self._carry[key] = made.carry()
            means_of(made.detector.metric)
        self._means = {metric: got.carry() for metric, got in means.items()}
        last = n - 1
        self._hit = [d.hit[last].copy() for d in found]
        self._last = {
            (di, g): d.finding(last, g)
            for di, d in enumerate(found)
            for g in np.flatnonzero(d.hit[last]).tolist()
        }
        self._end_s = float(times[last])
        return True

    def _events(
        self,
        columns: TraceColumns,
        detectors: list[ColumnDetector],
        decisions: dict[int, list[tuple[int, list[Decision]]]],
    ) -> None:
        """The chunk's events, frame by frame where something happens (backtest.run_backtest)."""
        times = columns.timestamps_s
        start = self._start_s
        assert start is not None
        out = self._events_made
        started = self._started
        previous = self._hit
        steps: set[int] = set(decisions)
        if detectors:
            stacked = np.concatenate([d.hit for d in detectors], axis=1)
            changed = np.flatnonzero(np.any(stacked[1:] != stacked[:-1], axis=1)) + 1
            steps.update(changed.tolist())
            before = np.zeros(stacked.shape[1], dtype=bool)
            if previous is not None and previous:
                before = np.concatenate(previous)
            if bool(np.any(stacked[0] != before)):
                steps.add(0)
        for step in sorted(steps):
            now = float(times[step])
            offset = now - start
            for di, d in enumerate(detectors):
                if step > 0:
                    was = d.hit[step - 1]
                elif previous is not None:
                    was = previous[di]
                else:
                    continue
                for g in np.flatnonzero(was & ~d.hit[step]).tolist():
                    last = d.finding(step - 1, g) if step > 0 else self._last[(di, g)]
                    out.append(FindingCleared(now, offset, last, started.pop((di, g))))
            new: list[tuple[tuple[int, int], Finding]] = []
            for di, d in enumerate(detectors):
                if step > 0:
                    fresh = d.hit[step] & ~d.hit[step - 1]
                elif previous is not None:
                    fresh = d.hit[step] & ~previous[di]
                else:
                    fresh = d.hit[step]
                new.extend(((di, g), d.finding(step, g)) for g in np.flatnonzero(fresh).tolist())
            new.sort(key=lambda item: finding_order(item[1]))
            for key, finding in new:
                out.append(FindingStarted(now, offset, finding))
                started[key] = now
            self.started_count += len(new)
            for _, made in sorted(decisions.get(step, ()), key=lambda item: item[0]):
                out.extend(DecisionTaken(now, offset, decision) for decision in made)
                self.decision_count += len(made)

    def finish(self) -> EventsMade:
        """The events of the whole trace (the first ``max_events``): those of every
        chunk, then a clear with ``end_of_trace`` for each finding still holding at the
        last frame."""
        end = self._end_s
        start = self._start_s if self._start_s is not None else end
        for key, finding in sorted(self._last.items(), key=lambda item: finding_order(item[1])):
            self._events_made.append(
                FindingCleared(end, end - start, finding, self._started[key], end_of_trace=True)
            )
        self._last = {}
        return self._events_made, self.started_count, self.decision_count


def _decisions(
    columns: TraceColumns,
    engine: PolicyEngine,
    detectors: dict[DetectorKey, ColumnDetector],
    status: str,
) -> dict[int, list[tuple[int, list[Decision]]]]:
    """``{frame: [(policy position, its decisions)]}``: the engine's own ``fire`` run at
    every frame where a policy can decide. In a trace only ``log`` and ``exec`` can
    (the other actions need jobs, managed jobs or job events), a policy's state
    (cooldowns, rate limit) is its own, and between two of its decisions nothing
    changes it: so each policy goes from one frame where a target of it is reported
    and no longer cooling down to the next."""
    out: dict[int, list[tuple[int, list[Decision]]]] = {}
    for position, compiled in enumerate(engine.compiled):
        made = _policy_decisions(columns, engine, detectors, status, compiled)
        for step, decided in made:
            out.setdefault(step, []).append((position, decided))
    return out


def _slots(
    columns: TraceColumns, compiled: CompiledPolicy, found: list[ColumnDetector]
) -> tuple[list[str], Any] | None:
    """The cooldown targets a policy can decide about and, for each frame and target
    (an int array ``(frames + 1, targets)``), the first frame at or after it where the
    target is reported (``frames`` for none; the last row is all ``frames``); None when
    the policy never decides in a trace. ``log`` acts alone or not at
    all (beside other actions it narrates them); ``notify`` per subject, as ``log``;
    ``exec`` per GPU (scope gpu) or once (scope global); the other actions need jobs."""
    policy = compiled.policy
    actions = {a.action for a in policy.actions}
    if not actions or policy.scope == "job":
        return None  # job scope: its groups are jobs, and a trace has none
    log, notify, run = action_names.LOG, action_names.NOTIFY, action_names.EXEC
    acting = actions & {run, notify} if compiled.narrated else {log}
    if not acting:
        return None  # its log narrates actions that need jobs
    subjects = ["gpu:" + u for u in columns.uuids]
    if policy.scope == "gpu":
        each = np.logical_and.reduce([d.hit for d in found])
        reported = each
    else:
        every = np.logical_and.reduce([d.hit.any(axis=1) for d in found])
        reported = np.logical_or.reduce([d.hit for d in found]) & every[:, None]
    targets: list[str] = []
    columns_of: list[Any] = []
    for kind in sorted(acting & {log, notify}):
        targets += [f"{kind}:{s}" for s in subjects]
        columns_of.append(reported)
    if run in acting:
        if policy.scope == "gpu":
            targets += subjects
            columns_of.append(reported)
        else:
            targets.append("global")
            columns_of.append(every[:, None])
    at = np.concatenate(columns_of, axis=1)
    n = at.shape[0]
    frame = np.arange(n, dtype=np.int32)[:, None]
    following = np.full((n + 1, at.shape[1]), n, dtype=np.int32)
    following[:n] = np.where(at, frame, n)
    # the first reported frame at or after each: a running minimum from the end
    following[::-1] = np.minimum.accumulate(following[::-1], axis=0)
    return targets, following


def _policy_decisions(
    columns: TraceColumns,
    engine: PolicyEngine,
    detectors: dict[DetectorKey, ColumnDetector],
    status: str,
    compiled: CompiledPolicy,
) -> list[tuple[int, list[Decision]]]:
    found = [detectors.get(k) for k in compiled.keys]
    if not found or any(d is None for d in found):
        return []  # a condition on the host, a job or job events: never met in a trace
    usable = [d for d in found if d is not None]
    slots = _slots(columns, compiled, usable)
    if slots is None:
        return []
    targets, following = slots
    policy = compiled.policy
    times = columns.timestamps_s
    n = columns.frame_count
    cooldown_s = policy.cooldown_s
    every_target = np.arange(len(targets))
    # cooldowns and rate limits carried from the chunks before (none for the first)
    free = np.zeros(len(targets), dtype=np.int64)
    if cooldown_s > 0:
        for i, target in enumerate(targets):
            last = engine.last_action_s(policy.name, target)
            if last is not None:
                free[i] = int(np.searchsorted(times, last + cooldown_s - _SLACK_S))
    begin = 0
    limit = policy.limit
    firings = engine.firing_times_s(policy.name)
    if limit is not None and len(firings) >= limit.max:
        begin = int(np.searchsorted(times, firings[-limit.max] + limit.per_s - _SLACK_S))
    out: list[tuple[int, list[Decision]]] = []
    while True:
        # the first frame where a target is reported and neither cooling nor rate-limited
        lowest = np.minimum(np.maximum(free, begin), n)
        step = int(following[lowest, every_target].min())
        if step >= n:
            return out
        now = float(times[step])
        by_key = {
            key: [d.finding(step, g) for g in np.flatnonzero(d.hit[step]).tolist()]
            for key, d in zip(compiled.keys, usable, strict=True)
        }
        snapshot = Snapshot(now, columns.samples(step), None, (), status)
        decided = engine.fire(compiled, by_key, snapshot, now)
        if decided:
            out.append((step, decided))
        if cooldown_s > 0:
            for i, target in enumerate(targets):
                last = engine.last_action_s(policy.name, target)
                if last is not None:
                    free[i] = int(np.searchsorted(times, last + cooldown_s - _SLACK_S))
        begin = step + 1
        limit = policy.limit
        firings = engine.firing_times_s(policy.name)
        if limit is not None and len(firings) >= limit.max:
            until = firings[-limit.max] + limit.per_s - _SLACK_S
            begin = max(begin, int(np.searchsorted(times, until)))
