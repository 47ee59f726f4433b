"""Backtests: a recorded nvidia-smi trace through a fresh policy engine (``gpuwatchd replay``).

Specification: docs/modules.md#gpuwatchdbacktest
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from gpuwatchd.backtest_events import (
    BacktestEvent,
    DecisionTaken,
    EventList,
    EventsMade,
    FindingCleared,
    FindingStarted,
    finding_order,
)
from gpuwatchd.model import Finding, Snapshot
from gpuwatchd.policy.engine import PolicyEngine
from gpuwatchd.policy.schema import PolicySet
from gpuwatchd.sampling.readahead import read_ahead
from gpuwatchd.sampling.replay import Trace, parse_trace

if TYPE_CHECKING:
    from gpuwatchd.sampling.columns import TraceColumns
    from gpuwatchd.sampling.prometheus import PrometheusRange

__all__ = [
    "DEFAULT_MAX_GAP_S",
    "BacktestEvent",
    "BacktestResult",
    "BacktestSummary",
    "DecisionTaken",
    "FindingCleared",
    "FindingStarted",
    "backtest_file",
    "backtest_parquet",
    "backtest_prometheus",
    "backtest_stream",
    "event_record",
    "format_trace_time",
    "max_gap_at_step",
    "run_backtest",
    "summary_record",
]

DEFAULT_MAX_GAP_S: Final = 10.0
"""Longest pause between two frames (trace seconds) that does not reset the streaks.

Longer than the nvidia-smi stalls in the real traces (<= 8.8 s, tests/data/traces), far
shorter than any ``for:`` worth a policy (the defaults use 15 s to 5 min)."""


def max_gap_at_step(step_s: float) -> float:
    """The default ``max_gap_s`` of a trace whose frames are ``step_s`` apart (a backtest
    from Prometheus at ``--step``): 1.5 steps, at least :data:`DEFAULT_MAX_GAP_S`. A
    missing step (no value of the host within Prometheus's lookback) resets the streaks,
    and a step longer than 10 s does not reset them at every frame."""
    return max(DEFAULT_MAX_GAP_S, 1.5 * step_s)


FindingKey = tuple[object, ...]
"""``(detector, subject, threshold)`` (plus ``for:`` seconds where that is ambiguous)."""


def format_trace_time(timestamp_s: float, digits: int = 3) -> str:
    """``timestamp_s`` (UTC seconds, as parse_trace reads them) in nvidia-smi's format.

    ``digits`` decimals of the second: ``"2025/07/26 23:55:17.245"`` (3, as in the
    trace), ``"2025/07/26 23:55:17.2"`` (1). Rounds to the nearest; never ``:60``.
    """
    scale = 10**digits
    ticks = round(timestamp_s * scale)
    whole, fraction = divmod(ticks, scale)
    text = time.strftime("%Y/%m/%d %H:%M:%S", time.gmtime(whole))
    return f"{text}.{fraction:0{digits}d}" if digits > 0 else text


@dataclass(frozen=True, slots=True)
class BacktestSummary:
    """Counts and timings of one replayed trace.

    ``gpu_samples`` = frames x GPUs. ``parse_s`` and ``engine_s`` are wall seconds
    (of the ``timer`` given) spent parsing the file and in the engine loop;
    ``start_s``/``duration_s`` are trace time.
    """

    path: str
    gpu_count: int
    frames: int
    gpu_samples: int
    skipped_lines: int
    start_s: float
    duration_s: float
    findings_started: int
    decisions: int
    engine_s: float
    parse_s: float = 0.0
    vectorized: bool = False
    """True when the events were computed over arrays (:mod:`gpuwatchd.backtest_arrays`),
    False when the engine stepped through every frame; the events are the same."""
    events_omitted: int = 0
    """Events made past ``max_events`` (counted, not kept in :attr:`BacktestResult.events`;
    ``findings_started`` and ``decisions`` count them too)."""

    @property
    def gpu_samples_per_s(self) -> float:
        """GPU-samples through the engine per wall second (inf for an instant run)."""
        return self.gpu_samples / self.engine_s if self.engine_s > 0 else math.inf


@dataclass(frozen=True, slots=True)
class BacktestResult:
    """The events of one replayed trace, in trace order (the first ``max_events`` the
    backtest was given; ``summary.events_omitted`` counts the rest), and its summary."""

    events: tuple[BacktestEvent, ...]
    summary: BacktestSummary


def _key(finding: Finding) -> FindingKey:
    return (finding.detector, finding.subject, finding.threshold)


_EPS_S: Final = 1e-6


class _Keys:
    """Tracking keys of a frame's findings (see the module doc on shared identities)."""

    def __init__(self, engine: PolicyEngine) -> None:
        conditions: list[tuple[str, float, float]] = []
        for detector in engine.detectors.values():
            threshold = getattr(detector, "threshold", None)
            if isinstance(threshold, (int, float)):
                for_s = float(getattr(detector, "for_s", 0.0))
                conditions.append((detector.name, float(threshold), for_s))
        seen: set[tuple[str, float]] = set()
        ambiguous: set[tuple[str, float]] = set()
        for name, threshold, _ in conditions:
            (ambiguous if (name, threshold) in seen else seen).add((name, threshold))
        self.ambiguous = frozenset(ambiguous)
        self._for_s = {
            pair: [for_s for name, threshold, for_s in conditions if (name, threshold) == pair]
            for pair in ambiguous
        }

    def of(self, findings: Sequence[Finding]) -> dict[FindingKey, Finding]:
        """``{key: finding}`` for one frame's findings."""
        if not self.ambiguous:
            return {(f.detector, f.subject, f.threshold): f for f in findings}
        out: dict[FindingKey, Finding] = {}
        rank: dict[FindingKey, int] = {}
        for f in findings:
            base = _key(f)
            pair = (f.detector, f.threshold)
            if pair not in self.ambiguous:
                out[base] = f
                continue
            held_s = f.timestamp_s - f.since_s + _EPS_S
            firing = [for_s for for_s in self._for_s[pair] if for_s <= held_s]
            j = rank.get(base, 0)
            rank[base] = j + 1
            level: object = firing[j] if j < len(firing) else f"#{j}"
            key: FindingKey = (*base, level)
            out[key] = f
        return out


Engine = Literal["auto", "arrays", "steps"]
"""How :func:`run_backtest` computes: ``steps`` (a :class:`PolicyEngine` step per frame),
``arrays`` (:mod:`gpuwatchd.backtest_arrays`; ValueError where it does not apply) or
``auto`` (arrays where they apply and numpy is installed, else steps)."""


def run_backtest(
    trace: Trace | TraceColumns,
    policies: PolicySet,
    *,
    max_gap_s: float | None = DEFAULT_MAX_GAP_S,
    timer: Callable[[], float] = time.perf_counter,
    engine: Engine = "auto",
    max_events: int | None = None,
) -> BacktestResult:
    """Replay ``trace`` through a fresh :class:`PolicyEngine` under ``policies``.

    Returns every finding start and clear and every decision, in trace order; within
    one frame clears come first, then starts (by GPU index, detector), then decisions
    in the engine's order. ``max_gap_s`` (trace seconds, None = never) resets the
    streaks after a longer pause between frames (see the module doc). ``timer`` only
    measures :attr:`BacktestSummary.engine_s`. ``engine`` picks the computation
    (:data:`Engine`; the events are the same either way). ``trace`` may be a
    :class:`~gpuwatchd.sampling.columns.TraceColumns` (what :func:`backtest_file`
    reads). ``max_events`` keeps the first that many events (None: all); the rest are
    counted in the summary's ``events_omitted``, so a long trace's events do not fill the
    memory. Raises nothing for a parsed trace and validated policies, except
    ValueError for ``engine="arrays"`` where arrays do not apply or a negative
    ``max_events``.
    """
    began = timer()
    if engine != "steps":
        done = _run_arrays(trace, policies, max_gap_s, engine == "arrays", max_events)
        if done is not None:
            return _result(trace, done, timer() - began, True)
    if not isinstance(trace, Trace):
        trace = trace.to_trace()
    made = _run_steps(trace, policies, max_gap_s, max_events)
    return _result(trace, made, timer() - began, False)


def _run_arrays(
    trace: Trace | TraceColumns,
    policies: PolicySet,
    max_gap_s: float | None,
    required: bool,
    max_events: int | None,
) -> EventsMade | None:
    try:
        import numpy  # noqa: F401  (the ``replay`` extra)
    except ImportError:
        if required:
            raise ValueError("engine='arrays' needs numpy (the replay extra)") from None
        return None
    from gpuwatchd import backtest_arrays
    from gpuwatchd.sampling.columns import TraceColumns as Columns

    columns = trace if isinstance(trace, Columns) else Columns.from_trace(trace)
    done = None
    if columns is not None:
        engine = PolicyEngine(policies, max_gap_s=max_gap_s)
        ambiguous = bool(_Keys(engine).ambiguous)
        status = f"replay: {columns.path}"
        done = backtest_arrays.backtest_columns(columns, engine, status, ambiguous, max_events)
    if done is None and required:
        raise ValueError("engine='arrays' does not apply to this trace and these policies")
    return done


def _result(
    trace: Trace | TraceColumns, made: EventsMade, engine_s: float, vectorized: bool
) -> BacktestResult:
    events, started_count, decision_count = made
    frames = len(trace.frames) if isinstance(trace, Trace) else trace.frame_count
    summary = BacktestSummary(
        path=trace.path,
        gpu_count=trace.gpu_count,
        frames=frames,
        gpu_samples=frames * trace.gpu_count,
        skipped_lines=len(trace.skipped_lines),
        start_s=trace.start_s,
        duration_s=trace.duration_s,
        findings_started=started_count,
        decisions=decision_count,
        engine_s=engine_s,
        vectorized=vectorized,
        events_omitted=events.omitted,
    )
    return BacktestResult(tuple(events.kept), summary)


def _run_steps(
    trace: Trace, policies: PolicySet, max_gap_s: float | None, max_events: int | None
) -> EventsMade:
    """The events of ``trace`` with a :meth:`PolicyEngine.step` per frame."""
    engine = PolicyEngine(policies, max_gap_s=max_gap_s)
    step = engine.step
    tracker = _Keys(engine)
    keys = tracker.of
    simple = not tracker.ambiguous
    status = f"replay: {trace.path}"
    start = trace.start_s
    events = EventList(max_events)
    append = events.append
    previous: dict[FindingKey, Finding] = {}  # the findings of the previous frame
    started: dict[FindingKey, float] = {}  # trace time each active finding started
    started_count = 0
    decision_count = 0
    for frame in trace.frames:
        now = frame.timestamp_s
        result = step(Snapshot(now, frame.samples, None, (), status))
        findings = result.findings
        if findings or previous:
            current: dict[FindingKey, Finding]
            if simple:
                current = {(f.detector, f.subject, f.threshold): f for f in findings}
            else:
                current = keys(findings)
            if current.keys() != previous.keys():
                offset = now - start
                for key, last in previous.items():
                    if key not in current:
                        append(FindingCleared(now, offset, last, started.pop(key)))
                new = sorted(
                    [(k, f) for k, f in current.items() if k not in previous],
                    key=lambda item: finding_order(item[1]),
                )
                for key, finding in new:
                    append(FindingStarted(now, offset, finding))
                    started[key] = now
                started_count += len(new)
            previous = current
        if result.decisions:
            offset = now - start
            for decision in result.decisions:
                append(DecisionTaken(now, offset, decision))
            decision_count += len(result.decisions)
    end = trace.frames[-1].timestamp_s
    for key, last in sorted(previous.items(), key=lambda item: finding_order(item[1])):
        append(FindingCleared(end, end - start, last, started[key], end_of_trace=True))
    return events, started_count, decision_count


def backtest_file(
    path: str,
    policies: PolicySet,
    *,
    gpus: int | None = None,
    max_gap_s: float | None = DEFAULT_MAX_GAP_S,
    timer: Callable[[], float] = time.perf_counter,
    block_bytes: int | None = None,
    max_events: int | None = None,
) -> BacktestResult:
    """Parse the trace at ``path`` (``gpus`` as in :func:`parse_trace`) and backtest it.

    A CSV log the columnar reader streams (gpuwatchd/sampling/replay_arrow.py
    ``stream_columns``) is read ``block_bytes`` at a time (default
    ``replay_arrow.BLOCK_BYTES``), the next block read while the current one is
    backtested (gpuwatchd/sampling/readahead.py), chunk by chunk over arrays, in memory
    that does not grow with the trace; any other is read whole. The summary's
    ``parse_s`` is the reading time; ``max_events`` as in :func:`run_backtest`. Raises
    :class:`~gpuwatchd.errors.ReplayError` (``path:line: message``) for a bad trace.
    """
    from gpuwatchd.sampling import replay_arrow

    if gpus is not None and gpus < 1:
        parse_trace(path, gpus=gpus)  # raises ReplayError, as without columns
    try:
        from gpuwatchd.backtest_arrays import ARRAY_METRICS
    except ImportError:  # no numpy (the ``replay`` extra): the row parser reads it
        blocks = None
    else:
        blocks = replay_arrow.csv_blocks(
            path, block_bytes or replay_arrow.BLOCK_BYTES, metrics=ARRAY_METRICS
        )
    if blocks is not None:
        # the next block parsed in a worker thread while the backtest works on this one
        # (pyarrow's CSV reader releases the GIL); Parquet's reading is too light to gain
        chunks = read_ahead(replay_arrow.stream_columns(path, blocks, gpus))
        try:
            streamed = backtest_stream(path, chunks, policies, max_gap_s, timer, max_events)
        finally:
            chunks.close()  # declined midway: the worker stops before the whole-file read
        if streamed is not None:
            return streamed
    began = timer()
    # As arrays (numpy), the backtest needs no GpuSample per GPU and frame; anything
    # the columnar reader does not take goes through parse_trace's row parser.
    trace: Trace | TraceColumns | None = replay_arrow.read_columns(path, gpus)
    if trace is None:
        trace = parse_trace(path, gpus=gpus, columnar=True)
    parse_s = timer() - began
    # The trace (a day of 8 GPUs: 691,200 samples) lives through the whole run; frozen,
    # the collector's full passes skip it instead of walking it again and again.
    gc.freeze()
    try:
        result = run_backtest(
            trace, policies, max_gap_s=max_gap_s, timer=timer, max_events=max_events
        )
    finally:
        gc.unfreeze()
    return BacktestResult(result.events, dataclasses.replace(result.summary, parse_s=parse_s))


def backtest_stream(
    path: str,
    chunks: Iterator[TraceColumns],
    policies: PolicySet,
    max_gap_s: float | None = DEFAULT_MAX_GAP_S,
    timer: Callable[[], float] = time.perf_counter,
    max_events: int | None = None,
) -> BacktestResult | None:
    """Backtest a trace given as consecutive chunks of frames (``TraceColumns`` with the
    same GPUs, read as they are asked for) over arrays
    (gpuwatchd/backtest_arrays.py ``ArrayBacktest``), or None when the trace must be
    read whole: the reader cannot frame it in chunks (``replay_arrow.NotColumnar``, a
    malformed block), or the policies or values need the per-sample engine. Summary
    ``engine_s``: seconds in the backtest; ``parse_s``: the rest (reading; with
    ``chunks`` read ahead, gpuwatchd/sampling/readahead.py, the reading the backtest
    waited for). The first
    ``max_events`` events are kept (None: all), the rest counted (``events_omitted``)."""
    began = timer()
    run = _StreamedRun(path, policies, max_gap_s, max_events)
    try:
        for chunk in chunks:
            if not run.feed(chunk, timer):
                return None
    except _stream_errors():
        return None
    return run.result(timer, timer() - began - run.engine_s)


class _StreamedRun:
    """One trace's :class:`~gpuwatchd.backtest_arrays.ArrayBacktest` fed chunk by chunk,
    with its counts (frames, GPUs, trace times) and the wall seconds it took."""

    def __init__(
        self, path: str, policies: PolicySet, max_gap_s: float | None, max_events: int | None
    ) -> None:
        from gpuwatchd.backtest_arrays import ArrayBacktest

        engine = PolicyEngine(policies, max_gap_s=max_gap_s)
        self.path = path
        self.run = ArrayBacktest(
            engine, f"replay: {path}", bool(_Keys(engine).ambiguous), max_events
        )
        self.engine_s = 0.0
        self.frames = self.gpu_count = 0
        self.start_s = self.end_s = 0.0

    def feed(self, chunk: TraceColumns, timer: Callable[[], float]) -> bool:
        """Backtest the next chunk (one without frames is skipped); False when the trace
        needs the per-sample engine (ArrayBacktest.feed)."""
        if not chunk.frame_count:
            return True
        at = timer()
        fed = self.run.feed(chunk)
        self.engine_s += timer() - at
        if not self.frames:
            self.start_s = chunk.start_s
        self.frames += chunk.frame_count
        self.gpu_count = chunk.gpu_count
        self.end_s = float(chunk.timestamps_s[-1])
        return fed

    def result(self, timer: Callable[[], float], parse_s: float) -> BacktestResult | None:
        """The result once every chunk is fed (None when none had a frame)."""
        if not self.frames:
            return None
        at = timer()
        events, started_count, decision_count = self.run.finish()
        self.engine_s += timer() - at
        summary = BacktestSummary(
            path=self.path,
            gpu_count=self.gpu_count,
            frames=self.frames,
            gpu_samples=self.frames * self.gpu_count,
            skipped_lines=0,
            start_s=self.start_s,
            duration_s=self.end_s - self.start_s,
            findings_started=started_count,
            decisions=decision_count,
            engine_s=self.engine_s,
            parse_s=parse_s,
            vectorized=True,
            events_omitted=events.omitted,
        )
        return BacktestResult(tuple(events.kept), summary)


def backtest_parquet(
    files: Sequence[str],
    policies: PolicySet,
    *,
    gpus: int | None = None,
    max_gap_s: float | None = DEFAULT_MAX_GAP_S,
    timer: Callable[[], float] = time.perf_counter,
    max_events: int | None = None,
) -> Iterator[BacktestResult]:
    """Backtest the Parquet ``files`` (gpuwatchd/sampling/parquet.py): one result per
    host, in host order, each by a fresh engine (a host's GPUs are each other's peers
    for ``idle_gpu``; cooldowns and rate limits are per host, as on the fleet's
    daemons), in memory that does not grow with the files' length. Where every row
    group is one host's (``parquet.host_row_groups``), the hosts are streamed one after
    another, each result made as soon as its host is done (the caller may print it and
    let it go before the next); else the files are read once, each record batch's rows
    routed to their host's array backtest (``parquet.HostStreams``), and the results
    made at the end. A host whose rows cannot be framed a batch at a time, or whose
    values or policies the array backtest does not take, is read whole
    (:func:`run_backtest`). Each summary's ``parse_s`` is its host's read time (routed:
    the reading shared out by GPU-samples); ``max_events`` per host, as in
    :func:`run_backtest`. Raises :class:`~gpuwatchd.errors.ReplayError` (on iterating)
    for a file that cannot be read or a host whose rows do not make a trace."""
    from gpuwatchd.backtest_arrays import ARRAY_METRICS
    from gpuwatchd.sampling.parquet import host_row_groups, read_parquet, stream_parquet

    hosts = host_row_groups(files)
    if hosts is None:
        yield from _route_parquet(files, policies, gpus, max_gap_s, timer, max_events)
        return
    for host in sorted(hosts):
        row_groups = dict(hosts[host])
        chunks = stream_parquet(list(row_groups), host, gpus, ARRAY_METRICS, row_groups=row_groups)
        streamed = backtest_stream(host, chunks, policies, max_gap_s, timer, max_events)
        if streamed is None:
            began = timer()
            traces = read_parquet(list(row_groups), gpus, {host}, row_groups)
            (streamed,) = _backtest_each(
                traces, policies, max_gap_s, timer, timer() - began, max_events
            )
        yield streamed


def _route_parquet(
    files: Sequence[str],
    policies: PolicySet,
    gpus: int | None,
    max_gap_s: float | None,
    timer: Callable[[], float],
    max_events: int | None,
) -> list[BacktestResult]:
    """:func:`backtest_parquet` of files whose row groups mix hosts: read once, each
    host's chunks fed to its own array backtest; the hosts that need it read whole."""
    from gpuwatchd.backtest_arrays import ARRAY_METRICS
    from gpuwatchd.sampling.parquet import HostStreams, read_parquet

    began = timer()
    runs: dict[str, _StreamedRun] = {}
    whole: set[str] = set()
    streams = HostStreams(files, gpus, ARRAY_METRICS)
    try:
        for host, chunk in streams:
            run = runs.get(host)
            if run is None:
                run = runs[host] = _StreamedRun(host, policies, max_gap_s, max_events)
            if chunk is None or not run.feed(chunk, timer):
                whole.add(host)
                streams.drop(host)
    except _stream_errors():  # a batch the reader declined: every host whole (it raises)
        runs, whole = {}, set()
    out = _results(runs, whole, timer, timer() - began)
    if whole or not runs:
        began = timer()
        traces = read_parquet(files, gpus, whole or None)
        out += _backtest_each(traces, policies, max_gap_s, timer, timer() - began, max_events)
    return sorted(out, key=lambda result: result.summary.path)


def _stream_errors() -> tuple[type[Exception], ...]:
    """What reading a trace in chunks raises where it must be read whole instead."""
    import pyarrow as pa  # type: ignore[import-untyped]

    from gpuwatchd.sampling.replay_arrow import NotColumnar

    return (NotColumnar, pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError,
            UnicodeDecodeError, ValueError, KeyError, TypeError)  # fmt: skip


def _results(
    runs: Mapping[str, _StreamedRun],
    declined: Collection[str],
    timer: Callable[[], float],
    took_s: float,
) -> list[BacktestResult]:
    """The results of the streamed ``runs`` but the ``declined`` hosts', in host order;
    the reading time (``took_s`` less the backtests') shared out by GPU-samples."""
    kept = {host: run for host, run in runs.items() if host not in declined}
    parse_s = took_s - sum(run.engine_s for run in runs.values())
    total = sum(run.frames * run.gpu_count for run in kept.values()) or 1
    out = []
    for host in sorted(kept):
        run = kept[host]
        result = run.result(timer, parse_s * run.frames * run.gpu_count / total)
        if result is not None:
            out.append(result)
    return out


def backtest_prometheus(
    query: PrometheusRange,
    policies: PolicySet,
    *,
    max_gap_s: float | None = DEFAULT_MAX_GAP_S,
    timer: Callable[[], float] = time.perf_counter,
    max_events: int | None = None,
) -> list[BacktestResult]:
    """Backtest dcgm-exporter's series read from Prometheus (gpuwatchd/sampling/prometheus.py):
    one result per ``Hostname``, in host order, each by a fresh engine (as
    :func:`backtest_parquet`). The series are streamed a ``query_range`` request at a time
    into each host's array backtest (``stream_prometheus``), in memory that does not grow
    with the range; they are read whole (``read_prometheus``) and backtested host by host
    where a host has SM activity series or the values or policies need the per-sample
    engine (then read again). Each summary's ``parse_s`` is its share of the reading time
    (HTTP and JSON); ``max_events`` per host, as in :func:`run_backtest`. Raises
    :class:`~gpuwatchd.errors.ReplayError` for a server that cannot be reached or answers
    with an error or no series."""
    from gpuwatchd.sampling.prometheus import read_prometheus

    streamed = _stream_prometheus(query, policies, max_gap_s, timer, max_events)
    if streamed is not None:
        return streamed
    began = timer()
    traces = read_prometheus(query)
    return _backtest_each(traces, policies, max_gap_s, timer, timer() - began, max_events)


def _stream_prometheus(
    query: PrometheusRange,
    policies: PolicySet,
    max_gap_s: float | None,
    timer: Callable[[], float],
    max_events: int | None,
) -> list[BacktestResult] | None:
    """:func:`backtest_prometheus` streamed, or None where the series must be read whole."""
    from gpuwatchd.sampling.prometheus import ProfilingSeries, stream_prometheus

    began = timer()
    runs: dict[str, _StreamedRun] = {}
    chunks = stream_prometheus(query)
    try:
        for chunk in chunks:
            for host, columns in chunk.items():
                run = runs.get(host)
                if run is None:
                    run = runs[host] = _StreamedRun(host, policies, max_gap_s, max_events)
                if not run.feed(columns, timer):
                    return None
    except ProfilingSeries:
        return None
    finally:
        chunks.close()
    return _results(runs, (), timer, timer() - began)


def _backtest_each(
    traces: Sequence[Trace | TraceColumns],
    policies: PolicySet,
    max_gap_s: float | None,
    timer: Callable[[], float],
    parse_s: float,
    max_events: int | None,
) -> list[BacktestResult]:
    """Each trace through a fresh engine; ``parse_s`` shared out by GPU-samples."""
    total = sum(_gpu_samples(t) for t in traces) or 1
    out = []
    for trace in traces:
        result = run_backtest(
            trace, policies, max_gap_s=max_gap_s, timer=timer, max_events=max_events
        )
        share = parse_s * result.summary.gpu_samples / total
        summary = dataclasses.replace(result.summary, parse_s=share)
        out.append(BacktestResult(result.events, summary))
    return out


def _gpu_samples(trace: Trace | TraceColumns) -> int:
    frames = len(trace.frames) if isinstance(trace, Trace) else trace.frame_count
    return frames * trace.gpu_count


# -- JSON records (``gpuwatchd replay --json``; stable, documented in docs/backtests.md)-


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return str(value)


def _ms(seconds: float) -> float:
    return round(seconds, 3)


def _finding_fields(finding: Finding, start_s: float) -> dict[str, Any]:
    return {
        "detector": finding.detector,
        "subject": finding.subject,
        "gpu_index": finding.gpu_index,
        "gpu_uuid": finding.gpu_uuid,
        "job": finding.job,
        "value": round(finding.value, 3),
        "threshold": finding.threshold,
        "since": format_trace_time(finding.since_s),
        "since_offset_s": _ms(finding.since_s - start_s),
        "message": finding.message,
    }


def _gpu_indexes(findings: Sequence[Finding]) -> list[int]:
    return sorted({f.gpu_index for f in findings if f.gpu_index is not None})


def event_record(event: BacktestEvent, trace_path: str, start_s: float) -> dict[str, Any]:
    """The JSON object of one event (one line of ``gpuwatchd replay --json``).

    Common keys: ``kind``, ``trace`` (path), ``time`` (nvidia-smi format, ms),
    ``timestamp_s`` (trace time, UTC seconds), ``offset_s`` (from the trace start).
    ``finding_started``: ``detector``, ``subject``, ``gpu_index``, ``gpu_uuid``, ``job``,
    ``value``, ``threshold``, ``since``, ``since_offset_s``, ``message``.
    ``finding_cleared``: the same (of the last finding seen), plus ``started_offset_s``,
    ``held_s`` and ``end_of_trace``. ``decision``: ``policy``, ``action``, ``params``,
    ``job``, ``gpu_uuid``, ``gpu_indexes`` (of its findings), ``detectors``,
    ``dry_run``, ``reason``. ``start_s`` is the trace's first frame time.
    """
    record: dict[str, Any] = {
        "kind": event.kind,
        "trace": trace_path,
        "time": format_trace_time(event.timestamp_s),
        "timestamp_s": _ms(event.timestamp_s),
        "offset_s": _ms(event.offset_s),
    }
    if isinstance(event, FindingStarted):
        record.update(_finding_fields(event.finding, start_s))
    elif isinstance(event, FindingCleared):
        record.update(_finding_fields(event.last, start_s))
        record["started_offset_s"] = _ms(event.started_s - start_s)
        record["held_s"] = _ms(event.held_s)
        record["end_of_trace"] = event.end_of_trace
    else:
        decision = event.decision
        record.update(
            {
                "policy": decision.policy,
                "action": decision.action,
                "params": _jsonable(decision.params),
                "job": decision.job,
                "gpu_uuid": decision.gpu_uuid,
                "gpu_indexes": _gpu_indexes(decision.findings),
                "detectors": sorted({f.detector for f in decision.findings}),
                "dry_run": decision.dry_run,
                "reason": decision.reason,
            }
        )
    return record


def summary_record(summary: BacktestSummary) -> dict[str, Any]:
    """The JSON object of a trace's summary (the last line per trace of ``--json``).

    Keys: ``kind`` (``"summary"``), ``trace``, ``gpus``, ``frames``, ``gpu_samples``,
    ``skipped_lines``, ``start`` (nvidia-smi format), ``start_s``, ``duration_s`` (trace
    time), ``findings_started``, ``decisions``, ``parse_s``, ``engine_s`` (wall
    seconds), ``gpu_samples_per_s`` (through the engine; null for an instant run) and
    ``vectorized`` (true: computed over arrays, :attr:`BacktestSummary.vectorized`),
    ``events_omitted`` (events past ``--events``, not printed).
    """
    rate = summary.gpu_samples_per_s
    return {
        "kind": "summary",
        "trace": summary.path,
        "gpus": summary.gpu_count,
        "frames": summary.frames,
        "gpu_samples": summary.gpu_samples,
        "skipped_lines": summary.skipped_lines,
        "start": format_trace_time(summary.start_s),
        "start_s": _ms(summary.start_s),
        "duration_s": _ms(summary.duration_s),
        "findings_started": summary.findings_started,
        "decisions": summary.decisions,
        "parse_s": round(summary.parse_s, 6),
        "engine_s": round(summary.engine_s, 6),
        "gpu_samples_per_s": round(rate) if math.isfinite(rate) else None,
        "vectorized": summary.vectorized,
        "events_omitted": summary.events_omitted,
    }
