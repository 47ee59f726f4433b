"""``gpuwatchd replay TRACE.csv...`` (or ``--prometheus URL``): backtest policies on
nvidia-smi CSV traces, Parquet, or dcgm-exporter's series in Prometheus and print (or draw)
every finding and decision (docs/backtests.md, docs/plots.md).

Traces are replayed one after another, each as fast as possible with its own timestamps;
a trace that cannot be read is reported and the next one replayed. Exit status: 0, or 1
when a trace could not be read or the policies are not valid.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from gpuwatchd.cli.daemon_commands import (
    Subparsers,
    count_arg,
    non_negative_duration_arg,
    positive_duration_arg,
    positive_int_arg,
)
from gpuwatchd.cli.errors import report_error, stdout_to_devnull
from gpuwatchd.errors import GpuwatchError
from gpuwatchd.units import format_bytes

if TYPE_CHECKING:
    from gpuwatchd.backtest import BacktestEvent, BacktestResult
    from gpuwatchd.policy.schema import PolicySet

__all__ = ["DEFAULT_MAX_EVENTS", "EXIT_WITHOUT_TEARDOWN", "add_parser", "run"]

EXIT_WITHOUT_TEARDOWN = True
"""``gpuwatchd replay`` ends with ``os._exit`` after flushing its output
(gpuwatchd/cli/main.py ``entry``): its plot and traces are closed before it returns."""

DEFAULT_MAX_EVENTS = 10_000
"""Events printed per trace (host) without ``--events all``: the rest are counted. The
month of 64 GPUs of bench/replay.py makes 546,083 events: 1,704 MiB peak RSS with every
one kept and printed, 717 MiB with this bound (before the batched Parquet reader; 259 MiB
with it: docs/backtests.md)."""

_HUMAN_HEADER = (
    f"{'TIME':<21}  {'OFFSET':>8}  {'EVENT':<8}  {'GPU':<5}  {'DETECTOR / POLICY':<24}  "
    f"{'VALUE':>9}  DETAIL"
)


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """Add ``replay`` and its options to ``sub`` (the ``gpuwatchd`` subparsers)."""
    replay = sub.add_parser(
        "replay",
        help="backtest policies on nvidia-smi CSV traces: every finding and decision",
        description="Feed every sample of each trace through the policies as fast as "
        "possible and print each finding's start and clearing and each decision, with the "
        "trace's own timestamps, then a summary. Traces are replayed independently, in order.",
    )
    replay.add_argument("traces", nargs="*", metavar="TRACE.csv")
    prometheus = replay.add_argument_group(
        "Prometheus", "backtest dcgm-exporter's series kept in Prometheus instead of TRACE files"
    )
    prometheus.add_argument(
        "--prometheus", metavar="URL", help="Prometheus (or Thanos/Mimir) base URL, http(s)://"
    )
    prometheus.add_argument(
        "--start", metavar="TIME", help="RFC 3339 (2025-07-26T23:53:30Z) or Unix seconds"
    )
    prometheus.add_argument("--end", metavar="TIME", help="as --start")
    prometheus.add_argument(
        "--step",
        type=positive_duration_arg,
        default=15.0,
        metavar="DURATION",
        help="query_range resolution (default 15s, dcgm-exporter's usual scrape interval)",
    )
    prometheus.add_argument(
        "--series",
        choices=("dcgm-exporter", "gpuwatchd"),
        default="dcgm-exporter",
        help="whose series: dcgm-exporter's DCGM_FI_* (default) or gpuwatchd's own",
    )
    prometheus.add_argument(
        "--match",
        metavar="SELECTOR",
        help="label matchers for the series read, e.g. '{Hostname=~\"gpu-.*\"}'",
    )
    replay.add_argument(
        "--policies",
        action="append",
        metavar="PATH",
        help="policy file or directory (repeatable; default the packaged default.yaml)",
    )
    replay.add_argument(
        "--gpus",
        type=positive_int_arg,
        metavar="N",
        help="GPUs whose rows are interleaved (when the trace has no index column and "
        "the count cannot be inferred)",
    )
    replay.add_argument(
        "--max-gap",
        type=non_negative_duration_arg,
        metavar="SECONDS",
        help="a longer pause between samples resets every streak (default 10s, with "
        "--prometheus 1.5 x --step when longer; 0: off)",
    )
    replay.add_argument(
        "--events",
        type=_events_arg,
        default=DEFAULT_MAX_EVENTS,
        metavar="N|all",
        help=f"print the first N events per trace (default {DEFAULT_MAX_EVENTS:,}; the rest "
        "are counted in the summary, events_omitted) or all of them",
    )
    replay.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the trace: FILE.png/.svg (matplotlib) or .html (plotly), one panel "
        "per GPU with finding spans and decisions (the 'plot' extra; one trace only)",
    )
    return replay


def _events_arg(value: str) -> int | None:
    """``--events``: ``all`` (None) or a whole number >= 0 (argparse type)."""
    return None if value == "all" else count_arg(value)


def _gpu_list(indexes: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``"0-3"``, ``[0, 2, 5]`` -> ``"0,2,5"``, ``[]`` -> ``"-"``."""
    if not indexes:
        return "-"
    if len(indexes) > 2 and list(indexes) == list(range(indexes[0], indexes[-1] + 1)):
        return f"{indexes[0]}-{indexes[-1]}"
    return ",".join(map(str, indexes))


def _value_text(value: float, threshold: float) -> str:
    if abs(threshold) >= 2**20:  # a size in bytes (vram_above bytes:)
        return format_bytes(value)
    return f"{value:.2f}" if abs(threshold) <= 1.0 else f"{value:.1f}"


def _human_line(event: BacktestEvent) -> str:
    from gpuwatchd.backtest import FindingCleared, FindingStarted, format_trace_time
    from gpuwatchd.policy import action_names

    when = f"{format_trace_time(event.timestamp_s, 1):<21}  {f'+{event.offset_s:.1f}s':>8}"
    if isinstance(event, FindingStarted):
        f = event.finding
        gpu = "-" if f.gpu_index is None else str(f.gpu_index)
        return (
            f"{when}  {'started':<8}  {gpu:<5}  {f.detector:<24}  "
            f"{_value_text(f.value, f.threshold):>9}  {f.message}"
        )
    if isinstance(event, FindingCleared):
        f = event.last
        gpu = "-" if f.gpu_index is None else str(f.gpu_index)
        detail = f"held {event.held_s:.1f}s"
        if event.end_of_trace:
            detail += "; the trace ends while it holds"
        return f"{when}  {'cleared':<8}  {gpu:<5}  {f.detector:<24}  {'':>9}  {detail}"
    d = event.decision
    gpus = _gpu_list(sorted({f.gpu_index for f in d.findings if f.gpu_index is not None}))
    params = d.params
    if d.action == action_names.LOG:
        detail = f"{params.get('level', 'info')}: {params.get('message', '')}"
    elif d.action in (action_names.SET_KNOB, action_names.TUNE_LOADER):
        detail = (
            f"job {d.job}: {params.get('knob')} {params.get('previous')} -> {params.get('value')}"
        )
        if "verdict" in params:
            detail += f" ({params['verdict']})"
    else:
        detail = json.dumps(dict(params), sort_keys=True, default=str)
        if d.job is not None:
            detail = f"job {d.job}: {detail}"
    if d.dry_run:
        detail += " (dry run)"
    what = f"{d.policy}/{d.action}"
    return f"{when}  {'decision':<8}  {gpus:<5}  {what:<24}  {'':>9}  {detail}"


def _human_report(result: BacktestResult) -> Iterator[str]:
    from gpuwatchd.backtest import format_trace_time

    s = result.summary
    skipped = f"; {s.skipped_lines} rows of incomplete samples skipped" if s.skipped_lines else ""
    yield (
        f"== {s.path}: {s.gpu_count} GPUs, {s.frames} samples from "
        f"{format_trace_time(s.start_s, 1)} over {s.duration_s:.1f} s{skipped}"
    )
    if result.events:
        yield _HUMAN_HEADER
    for event in result.events:
        yield _human_line(event)
    if s.events_omitted:
        yield f"... {s.events_omitted} more events not shown (--events all prints them)"
    rate = s.gpu_samples_per_s
    rate_text = f"{rate:,.0f} GPU-samples/s" if rate != float("inf") else "instant"
    yield (
        f"summary: {s.frames} samples x {s.gpu_count} GPUs = {s.gpu_samples} GPU-samples "
        f"({s.duration_s:.1f} s of trace) replayed in {s.engine_s:.3f} s ({rate_text}; "
        f"parse {s.parse_s:.3f} s); {s.findings_started} findings started, "
        f"{s.decisions} decisions"
    )


def _replay_plot(
    path: str, policies: Any, args: argparse.Namespace, max_gap_s: float | None
) -> BacktestResult:
    """Backtest ``path`` and draw it to ``args.plot`` (docs/plots.md)."""
    from gpuwatchd.backtest import run_backtest
    from gpuwatchd.plot import from_backtest, render
    from gpuwatchd.sampling.replay import parse_trace

    trace = parse_trace(path, gpus=args.gpus)
    result = run_backtest(trace, policies, max_gap_s=max_gap_s)
    render(from_backtest(trace, result.events), args.plot)
    print(f"gpuwatchd: plot written to {args.plot}", file=sys.stderr)
    return result


def run(args: argparse.Namespace) -> int:
    """Run ``gpuwatchd replay`` with parsed ``args``; 0, or 1 when a trace could not be read.

    Raises:
        GpuwatchError: ``--plot`` with more than one trace or an unusable plot file.
        PolicyError: a policy file is not valid (file:line).
    """
    from gpuwatchd.backtest import DEFAULT_MAX_GAP_S
    from gpuwatchd.policyfiles import default_policy_path, load_policies

    if args.prometheus is not None:
        if args.traces:
            raise GpuwatchError("give TRACE files or --prometheus, not both")
        return _replay_prometheus(args)
    if not args.traces:
        raise GpuwatchError("give TRACE files, or --prometheus URL --start TIME --end TIME")
    if args.plot is not None and len(args.traces) != 1:
        raise GpuwatchError("--plot draws one trace; give exactly one TRACE.csv")
    if args.plot is not None:
        from gpuwatchd.plot import check_output

        check_output(args.plot)  # before the work: suffix and the 'plot' extra
    policies = load_policies(args.policies or [default_policy_path()])  # PolicyError: exit 1
    max_gap_s = DEFAULT_MAX_GAP_S if args.max_gap is None else (args.max_gap or None)
    return _replay_traces(args, policies, max_gap_s)


def _replay_traces(args: argparse.Namespace, policies: PolicySet, max_gap_s: float | None) -> int:
    """Replay ``args.traces`` one after another, printing each result; 0, or 1 when a
    trace could not be read (its error printed, the next one replayed). Stops when
    stdout's reader has gone (``| head``), with the status so far."""
    from gpuwatchd.backtest import backtest_file, backtest_parquet
    from gpuwatchd.errors import ReplayError
    from gpuwatchd.sampling.parquet import parquet_files

    status = 0
    printed = False
    for path in args.traces:
        try:
            files = parquet_files(path)
            results: Iterable[BacktestResult]
            if files is not None:
                if args.plot is not None:
                    raise ReplayError(f"{path}: --plot draws a CSV trace, not Parquet")
                # each host printed when done: a host's events are not held past it
                results = backtest_parquet(
                    files, policies, gpus=args.gpus, max_gap_s=max_gap_s, max_events=args.events
                )
            elif args.plot is not None:
                results = [_replay_plot(path, policies, args, max_gap_s)]
            else:
                results = [
                    backtest_file(
                        path, policies, gpus=args.gpus, max_gap_s=max_gap_s, max_events=args.events
                    )
                ]
            for result in results:
                if not _print_result(
                    result, None if files is not None else path, args.json, printed
                ):
                    return status
                printed = True
        except ReplayError as exc:  # the next trace is still replayed
            if args.json:
                report_error("gpuwatchd", True, "replay", str(exc))
            else:
                print(f"gpuwatchd: error: {exc}", file=sys.stderr)
            status = 1
    return status


def _print_result(result: BacktestResult, label: str | None, as_json: bool, after: bool) -> bool:
    """Write a result's events and summary (``--json``: one object per line) to stdout;
    ``label`` names the trace in JSON (default the summary's path, the host); ``after``:
    another report came before (the human form puts a blank line between two). False
    when stdout's reader has gone (``gpuwatchd replay DAY.csv | head``, as ``record``
    takes it): stdout then writes to /dev/null, so that the exit's flush does not fail
    again, and nothing more need be replayed."""
    try:
        _write_result(result, label, as_json, after)
    except BrokenPipeError:
        stdout_to_devnull()
        return False
    return True


def _write_result(result: BacktestResult, label: str | None, as_json: bool, after: bool) -> None:
    from gpuwatchd.backtest import event_record, summary_record

    write = sys.stdout.write
    name = result.summary.path if label is None else label
    # line by line: --events all holds the events, not their text as well
    if as_json:
        start = result.summary.start_s
        for event in result.events:
            write(json.dumps(event_record(event, name, start), separators=(",", ":")) + "\n")
        write(json.dumps(summary_record(result.summary), separators=(",", ":")) + "\n")
    else:
        if after:
            write("\n")
        for line in _human_report(result):
            write(line + "\n")
    sys.stdout.flush()


def _replay_prometheus(args: argparse.Namespace) -> int:
    """``replay --prometheus URL --start --end [--step] [--match]``: 0, or 1 when the
    series cannot be read (the error printed, as for a trace).

    Raises:
        GpuwatchError: a missing --start/--end, or --plot over several hosts.
        PolicyError: a policy file is not valid (file:line).
    """
    from gpuwatchd.backtest import backtest_prometheus, max_gap_at_step, run_backtest
    from gpuwatchd.errors import ReplayError
    from gpuwatchd.policyfiles import default_policy_path, load_policies
    from gpuwatchd.sampling import prometheus
    from gpuwatchd.sampling.trace import Trace

    if args.start is None or args.end is None:
        raise GpuwatchError("--prometheus needs --start TIME and --end TIME")
    if args.plot is not None:
        from gpuwatchd.plot import check_output

        check_output(args.plot)
    policies = load_policies(args.policies or [default_policy_path()])
    # Frames are --step apart: a gap is a step without any value of the host (none within
    # Prometheus's lookback), so the default resets streaks after a missing step.
    max_gap_s = max_gap_at_step(args.step) if args.max_gap is None else (args.max_gap or None)
    try:
        query = prometheus.PrometheusRange(
            prometheus.check_url(args.prometheus),
            prometheus.parse_time(args.start, "--start"),
            prometheus.parse_time(args.end, "--end"),
            args.step,
            prometheus.check_match(args.match),
            args.series,
        )
        if args.plot is None:
            results = backtest_prometheus(
                query, policies, max_gap_s=max_gap_s, max_events=args.events
            )
        else:
            traces = prometheus.read_prometheus(query)
            if len(traces) != 1:
                raise ReplayError(
                    f"--plot draws one host; {len(traces)} here: narrow --match to one Hostname"
                )
            trace = traces[0] if isinstance(traces[0], Trace) else traces[0].to_trace()
            results = [run_backtest(trace, policies, max_gap_s=max_gap_s)]
            from gpuwatchd.plot import from_backtest, render

            render(from_backtest(trace, results[0].events), args.plot)
            print(f"gpuwatchd: plot written to {args.plot}", file=sys.stderr)
    except ReplayError as exc:
        if args.json:
            report_error("gpuwatchd", True, "replay", str(exc))
        else:
            print(f"gpuwatchd: error: {exc}", file=sys.stderr)
        return 1
    for position, result in enumerate(results):
        if not _print_result(result, None, args.json, position > 0):
            break
    return 0
