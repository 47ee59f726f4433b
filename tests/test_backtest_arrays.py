"""Backtests over arrays give the per-sample engine's events, to the bit, on the real traces.

``gpuwatchd replay`` computes a trace's findings and decisions over arrays
(gpuwatchd/backtest_arrays.py) instead of stepping a PolicyEngine through every frame;
these tests run both on the three real traces of tests/data/traces, under the packaged
defaults, the pinned policies of test_backtest.py and a seeded generator of policies
(hysteresis, ``statistic: mean``, idle_gpu, vram_above by percent and by size,
exec, notify, global scope, cooldowns, rate limits, dry runs), on the traces as
recorded and with NA stretches, a lost GPU, memory.total and pauses added, and
compare every event.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from conftest import TRACES
from gpuwatchd.backtest import BacktestResult, backtest_file, run_backtest
from gpuwatchd.model import NA
from gpuwatchd.policy.schema import PolicySet, parse_policies
from gpuwatchd.policyfiles import default_policy_path, load_policies
from gpuwatchd.sampling.replay import Frame, Trace, parse_trace
from gpuwatchd.windows import Window
from gpuwatchd.windows_arrays import ColumnMeans

TRACE_FILES = sorted(TRACES.glob("*.csv"))
PINNED = (Path(__file__).parent / "test_backtest.py").read_text()
PINNED = PINNED[PINNED.index('POLICIES = """\\\n') + 16 :]
PINNED = PINNED[: PINNED.index('"""')]


def both(trace: Trace, policies: PolicySet, max_gap_s: float | None = 10.0) -> BacktestResult:
    """Backtest ``trace`` both ways; assert the same events; return the arrays' result."""
    steps = run_backtest(trace, policies, engine="steps", max_gap_s=max_gap_s)
    arrays = run_backtest(trace, policies, engine="arrays", max_gap_s=max_gap_s)
    assert arrays.summary.vectorized and not steps.summary.vectorized
    assert len(arrays.events) == len(steps.events)
    for i, (got, want) in enumerate(zip(arrays.events, steps.events, strict=True)):
        assert got == want, f"event {i} differs"
    assert dataclasses.replace(arrays.summary, engine_s=0.0, vectorized=False) == (
        dataclasses.replace(steps.summary, engine_s=0.0)
    )
    return arrays


@pytest.fixture(scope="module")
def traces() -> dict[str, Trace]:
    return {p.name: parse_trace(p) for p in TRACE_FILES}


@pytest.mark.parametrize("name", [p.name for p in TRACE_FILES])
def test_real_traces_under_the_defaults_and_the_pinned_policies(
    traces: dict[str, Trace], name: str
) -> None:
    defaults = load_policies([default_policy_path()])
    pinned = parse_policies(PINNED, "pinned.yaml")
    found = both(traces[name], defaults)
    assert found.summary.findings_started > 0  # the defaults report the idle start and end
    assert both(traces[name], pinned).summary.decisions > 0
    both(traces[name], pinned, max_gap_s=None)
    both(traces[name], pinned, max_gap_s=1.0)


def test_replay_command_path_reads_columns_and_gives_the_same_events(
    traces: dict[str, Trace],
) -> None:
    """backtest_file (what `gpuwatchd replay` runs) on the H100 trace, both ways."""
    pinned = parse_policies(PINNED, "pinned.yaml")
    path = str(TRACES / "h100x8_gpt350m_ckpt10_100ms.csv")
    fast = backtest_file(path, pinned)
    assert fast.summary.vectorized
    slow = run_backtest(traces[path.rsplit("/", 1)[-1]], pinned, engine="steps")
    assert fast.events == slow.events
    assert fast.summary.findings_started == slow.summary.findings_started == 81


def test_window_means_equal_a_window_to_the_bit() -> None:
    """ColumnMeans against Window itself, across its compactions (uneven sampling, pauses,
    repeated times, gaps, a max_samples bound)."""
    rng = np.random.default_rng(13)
    for case in range(12):
        n = int(rng.integers(300, 3000))
        steps = rng.uniform(0.02, 0.3, n)
        steps[rng.integers(0, n, 10)] = rng.uniform(5, 40, 10)
        steps[rng.integers(0, n, 10)] = 0.0
        times = 1.75e9 + np.cumsum(steps)
        values = rng.uniform(0, 100, (n, 2))
        values[rng.random((n, 2)) < 0.05] = np.nan
        horizon, max_samples = [(20.0, 4096), (5.0, 100), (60.0, 300)][case % 3]
        for_s = horizon / (1 + case % 2)
        means = ColumnMeans(times, values, horizon, max_samples)
        windows = [Window(horizon, max_samples) for _ in range(2)]
        for step in range(n):
            for g, window in enumerate(windows):
                value = values[step, g]
                window.append(float(times[step]), None if np.isnan(value) else float(value))
            got = means.mean_at(step, for_s)
            for g, window in enumerate(windows):
                want = window.mean_since(float(times[step]) - for_s)
                assert (None if np.isnan(got[g]) else float(got[g])) == want, (case, step, g)


# -- generated policies on altered traces -----------------------------------------------


def _condition(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["low", "low", "idle", "vram_pct", "vram_bytes"])
    for_ = rng.choice(["0s", "1s", "2s", "10s", "20s", "1m"])
    mean = rng.random() < 0.4
    statistic = ", statistic: mean" if mean else ""
    if kind == "low":
        percent = rng.choice([5, 15, 20, 50, 90])
        clear = f", clear: {min(100, percent + rng.choice([5, 30]))}" if rng.random() < 0.4 else ""
        return "low_utilization", f"{{percent: {percent}{clear}{statistic}, for: {for_}}}"
    if kind == "idle":
        clear = ", clear: 30" if mean and rng.random() < 0.5 else ""
        params = f"percent: {rng.choice([5, 10])}, busy_percent: 50{clear}{statistic}"
        return "idle_gpu", f"{{{params}, for: {for_}}}"
    if kind == "vram_pct":
        percent = rng.choice([20, 45, 50, 95])
        clear = f", clear: {percent - 10}" if rng.random() < 0.4 else ""
        return "vram_above", f"{{percent: {percent}{clear}, for: {for_}}}"
    size = rng.choice(["1GiB", "3GiB", "30GiB"])
    clear = ", clear: 500MiB" if rng.random() < 0.3 else ""
    return "vram_above", f"{{bytes: {size}{clear}, for: {for_}}}"


def _policies(rng: random.Random) -> str:
    lines = ["policies:"]
    used: dict[str, str] = {}
    for i in range(rng.randint(1, 4)):
        conditions: dict[str, str] = {}
        for _ in range(rng.choice([1, 1, 2])):
            detector, params = _condition(rng)
            params = used.setdefault(detector, params)  # one set of params per detector
            conditions[detector] = params
        if rng.random() < 0.1:
            conditions["host_cpu_above"] = "{percent: 90, for: 15s}"  # never met in a trace
            conditions["allocated_but_idle"] = "{for: 15s}"  # no Slurm job in a trace
        actions = rng.choice(
            [
                ["log: {level: info}"],
                ["exec: {argv: [echo, '{subject}', '{gpu_index}']}", "log: {level: warning}"],
                ["exec: {argv: [/bin/true, '{policy}']}"],
                ["place_on_idle_gpu: {}", "log: {level: info}"],
                ["log: {level: info}", "log: {level: warning, message: twice}"],
                ["notify: {urls: ['json://127.0.0.1:9/hook']}", "log: {level: info}"],
                ["notify: {urls: ['json://127.0.0.1:9/a']}", "exec: {argv: [/bin/true]}"],
            ]
        )
        lines += [f"  - name: p{i}", "    when:"]
        lines += [f"      {d}: {p}" for d, p in conditions.items()]
        lines.append("    do:")
        lines += [f"      - {a}" for a in actions]
        lines.append(f"    cooldown: {rng.choice(['0s', '5s', '1m', '10m'])}")
        if rng.random() < 0.3 and "place_on_idle_gpu" not in actions[0]:
            lines.append(f"    scope: {rng.choice(['gpu', 'global'])}")
        if rng.random() < 0.3:
            per = rng.choice(["1m", "1h"])
            lines.append(f"    limit: {{max: {rng.randint(1, 3)}, per: {per}}}")
        if rng.random() < 0.2:
            lines.append("    dry_run: true")
    return "\n".join(lines) + "\n"


def _altered(trace: Trace, rng: random.Random) -> Trace:
    """``trace`` with memory.total known, NA stretches on one GPU, a lost GPU for a few
    frames and a pause of 30 s (a replayed trace can hold all of these)."""
    total = 80 * 2**30 if trace.gpu_count == 8 else 12 * 2**30
    frames = list(trace.frames)
    n = len(frames)
    na = {(rng.randrange(n), rng.randrange(trace.gpu_count)) for _ in range(3)}
    lost_at, lost_gpu = rng.randrange(n), rng.randrange(trace.gpu_count)
    pause_at = rng.randrange(1, n)
    out = []
    for i, frame in enumerate(frames):
        shift = 30.0 if i >= pause_at else 0.0
        samples = []
        for k, s in enumerate(frame.samples):
            s = dataclasses.replace(s, memory_total_bytes=total, timestamp_s=s.timestamp_s + shift)
            if any(a <= i < a + 40 and g == k for a, g in na):
                s = dataclasses.replace(s, utilization_gpu_pct=NA, memory_used_bytes=NA)
            if lost_at <= i < lost_at + 5 and k == lost_gpu:
                s = dataclasses.replace(
                    s, utilization_gpu_pct=NA, memory_used_bytes=NA, error="GPU is lost"
                )
            samples.append(s)
        out.append(Frame(frame.timestamp_s + shift, tuple(samples)))
    return Trace(trace.path, trace.gpu_count, tuple(out))


@pytest.mark.parametrize(
    "cases", [12, pytest.param(40, marks=pytest.mark.long)], ids=lambda n: f"{n}-policy-sets"
)
def test_generated_policies_on_altered_traces(traces: dict[str, Trace], cases: int) -> None:
    """Seeded policy sets (12 in ``make test``; the first 12 of the 40 that ``make
    test-long`` runs), each on a real trace as recorded and altered, both ways."""
    rng = random.Random(20260725)
    names = sorted(traces)
    vectorized = 0
    for case in range(cases):
        text = _policies(rng)
        policies = parse_policies(text, f"generated-{case}.yaml")
        trace = traces[names[case % len(names)]]
        if trace.gpu_count == 8:  # a third of the H100 trace keeps this test short
            trace = Trace(trace.path, 8, trace.frames[: len(trace.frames) // 3])
        for variant in (trace, _altered(trace, rng)):
            try:
                both(variant, policies, max_gap_s=rng.choice([10.0, None]))
            except ValueError:  # two conditions with one detector and threshold: steps
                auto = run_backtest(variant, policies)
                assert not auto.summary.vectorized
                assert auto.events == run_backtest(variant, policies, engine="steps").events
            else:
                vectorized += 1
    assert vectorized >= cases * 2 * 7 // 8  # most sets take the array path (70 of 80)


@pytest.mark.parametrize("name", [p.name for p in TRACE_FILES])
@pytest.mark.parametrize("chunk_frames", [1, 97, 1500])
def test_trace_fed_in_chunks_gives_the_same_events(
    traces: dict[str, Trace], name: str, chunk_frames: int
) -> None:
    """ArrayBacktest fed the trace chunk by chunk (windows, streaks, holds, findings and
    cooldowns carried across chunks) gives the per-sample engine's events."""
    trace = traces[name]
    defaults = load_policies([default_policy_path()])
    for policies in (defaults, parse_policies(PINNED, "p.yaml")):
        if chunk_frames == 1 and policies is not defaults:
            continue  # one frame per chunk: the defaults only (slow)
        assert_chunked_alike(trace, policies, chunk_frames)


def assert_chunked_alike(trace: Trace, policies: PolicySet, chunk_frames: int) -> None:
    """ArrayBacktest fed ``trace`` in chunks gives the per-sample engine's events."""
    from gpuwatchd.backtest_arrays import ArrayBacktest
    from gpuwatchd.policy.engine import PolicyEngine
    from gpuwatchd.sampling.columns import TraceColumns

    columns = TraceColumns.from_trace(trace)
    assert columns is not None
    want = run_backtest(trace, policies, engine="steps").events
    # none of these policies has two conditions with one detector and threshold
    run = ArrayBacktest(PolicyEngine(policies, max_gap_s=10.0), f"replay: {trace.path}", False)
    for first in range(0, columns.frame_count, chunk_frames):
        assert run.feed(columns.frames_between(first, first + chunk_frames))
    made, _, _ = run.finish()
    events = made.kept
    assert len(events) == len(want)
    for i, (got, expected) in enumerate(zip(events, want, strict=True)):
        assert got == expected, f"event {i} differs"


def test_generated_policies_on_altered_traces_in_chunks(traces: dict[str, Trace]) -> None:
    """The seeded policies and altered traces of the test above, fed in chunks of
    random sizes (NA stretches, a lost GPU and a pause fall anywhere, on a chunk's
    edge too)."""
    rng = random.Random(20261127)
    for _ in range(12):
        name = rng.choice(sorted(traces))
        policies = parse_policies(_policies(rng), "generated.yaml")
        assert_chunked_alike(_altered(traces[name], rng), policies, rng.choice([3, 64, 701]))
