"""Timeline pictures: per-GPU utilization and memory with finding spans and decisions.

``gpuwatchd replay TRACE --plot FILE`` and ``gpuwatchctl events --plot FILE`` build a
:class:`Timeline` and :func:`render` it: PNG/SVG by matplotlib (Agg, no display), HTML by
plotly, one panel per GPU. Both come with the ``plot`` extra and are imported only
here, when a picture is asked for. Specification: docs/plots.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gpuwatchd.errors import GpuwatchError

__all__ = [
    "FORMATS",
    "MAX_NAMED_LABELS",
    "MAX_POINTS",
    "Mark",
    "Span",
    "Timeline",
    "check_output",
    "decision_label",
    "from_backtest",
    "from_journal",
    "render",
]

FORMATS: Final = (".png", ".svg", ".html")
"""File suffixes :func:`render` writes."""
MAX_POINTS: Final = 2000
"""Samples per GPU drawn at most (a longer series is thinned to every n-th sample)."""
_GIB: Final = 2**30
_COLOURS: Final = ("#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass(frozen=True, slots=True)
class Span:
    """A finding held from ``start_s`` to ``end_s`` (Unix/trace seconds) on GPU ``gpu``
    (``None``: host or job findings, drawn on every panel)."""

    gpu: int | None
    detector: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class Mark:
    """A decision at ``time_s`` for GPU ``gpu`` (``None``: every panel); ``label`` is
    ``policy/action`` with the job and trial when known, and the outcome. ``named``: the
    decision names a job or trial, so its label is written beside its line (not only
    in the first decision's note or the HTML's hover text)."""

    gpu: int | None
    time_s: float
    label: str
    named: bool = False


MAX_NAMED_LABELS: Final = 12
"""Job/trial labels written per panel at most (the rest stay in the HTML hover text)."""


def decision_label(policy: object, action: object, job: object, params: object) -> tuple[str, bool]:
    """``policy/action job J trial T`` from a decision's fields (``params`` a mapping,
    e.g. a crash action's ``{"trial_number": 7}``); and whether a job or trial is named."""
    label = f"{policy}/{action}"
    named = False
    if job:
        label += f" job {job}"
        named = True
    trial = params.get("trial_number") if isinstance(params, dict) else None
    if isinstance(trial, int) and not isinstance(trial, bool):
        label += f" trial {trial}"
        named = True
    return label, named


@dataclass(slots=True)
class Timeline:
    """What one picture shows. ``times_s`` (seconds) and, per GPU, ``util_pct[g]`` (%)
    and ``memory_bytes[g]`` of the same length; empty series when none is known (the
    journal keeps findings and decisions, not samples)."""

    title: str
    gpu_count: int
    times_s: list[float] = field(default_factory=list)
    util_pct: list[list[float | None]] = field(default_factory=list)
    memory_bytes: list[list[float | None]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)

    @property
    def start_s(self) -> float:
        """The earliest time shown (seconds); the x axes count minutes from it."""
        candidates = [*self.times_s[:1], *(s.start_s for s in self.spans)]
        candidates += [m.time_s for m in self.marks]
        return min(candidates) if candidates else 0.0


def from_backtest(trace: Any, events: Iterable[Any]) -> Timeline:
    """A :class:`Timeline` of a parsed trace (:class:`gpuwatchd.sampling.replay.Trace`)
    and its backtest events (:data:`gpuwatchd.backtest.BacktestEvent`)."""
    frames = trace.frames
    step = max(1, len(frames) // MAX_POINTS)
    picked = frames[::step]
    timeline = Timeline(title=Path(str(trace.path)).name, gpu_count=trace.gpu_count)
    timeline.times_s = [f.timestamp_s for f in picked]
    for gpu in range(trace.gpu_count):
        timeline.util_pct.append([_num(f.samples[gpu].utilization_gpu_pct) for f in picked])
        timeline.memory_bytes.append([_num(f.samples[gpu].memory_used_bytes) for f in picked])
    for event in events:
        if event.kind == "finding_cleared":
            finding = event.last
            timeline.spans.append(
                Span(finding.gpu_index, finding.detector, event.started_s, event.timestamp_s)
            )
        elif event.kind == "decision":
            decision = event.decision
            gpus = sorted({f.gpu_index for f in decision.findings if f.gpu_index is not None})
            label, named = decision_label(
                decision.policy, decision.action, decision.job, dict(decision.params)
            )
            for gpu in gpus or [None]:
                timeline.marks.append(Mark(gpu, event.timestamp_s, label, named))
    return timeline


def from_journal(events: Sequence[dict[str, Any]], gpu_count: int, now_s: float) -> Timeline:
    """A :class:`Timeline` of journal events (``events`` op records, docs/journal.md).

    A finding still open is drawn up to ``now_s``; ``gpu_count`` panels at least (more
    when an event names a higher GPU index).
    """
    started: dict[object, dict[str, Any]] = {}
    outcomes: dict[object, str] = {}
    timeline = Timeline(title="gpuwatchd journal", gpu_count=gpu_count)
    for event in events:
        kind = event.get("kind")
        gpu = event.get("gpu_index")
        if isinstance(gpu, int) and gpu >= timeline.gpu_count:
            timeline.gpu_count = gpu + 1
        if kind == "finding_started":
            started[event.get("finding_id")] = event
        elif kind == "finding_cleared":
            begun = started.pop(event.get("finding_id"), None) or event
            timeline.spans.append(_journal_span(begun, float(event["time_s"])))
        elif kind == "outcome":
            outcomes[event.get("decision_id")] = str(event.get("outcome"))
    for begun in started.values():
        timeline.spans.append(_journal_span(begun, now_s))
    for event in events:
        if event.get("kind") != "decision":
            continue
        label, named = decision_label(
            event.get("policy"), event.get("action"), event.get("job"), event.get("params")
        )
        outcome = outcomes.get(event.get("decision_id"))
        if outcome:
            label += f": {outcome}"
        gpu = event.get("gpu_index")
        timeline.marks.append(
            Mark(gpu if isinstance(gpu, int) else None, float(event["time_s"]), label, named)
        )
    return timeline


def _journal_span(event: dict[str, Any], end_s: float) -> Span:
    gpu = event.get("gpu_index")
    start = event.get("time_s")
    return Span(
        gpu if isinstance(gpu, int) else None,
        str(event.get("detector")),
        float(start) if isinstance(start, (int, float)) else end_s,
        end_s,
    )


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None  # NA -> None


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise GpuwatchError(
            f"plots need the 'plot' extra ({exc.name} is missing): pip install 'gpuwatchd[plot]'"
        ) from None


def check_output(path: str | Path) -> None:
    """Check, before any work, that ``path`` has a suffix of :data:`FORMATS` and that its
    library (matplotlib or plotly) is installed; raises
    :class:`~gpuwatchd.errors.GpuwatchError` naming the ``plot`` extra otherwise."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise GpuwatchError(f"{path}: a plot is .png, .svg or .html, not {suffix or 'nothing'}")
    _import("plotly.subplots" if suffix == ".html" else "matplotlib.figure")


def render(timeline: Timeline, path: str | Path) -> Any:
    """Write ``timeline`` to ``path`` (``.png``/``.svg``: matplotlib, ``.html``: plotly,
    self-contained); return the figure (matplotlib ``Figure`` or plotly ``Figure``).

    Raises :class:`~gpuwatchd.errors.GpuwatchError` for another suffix, a missing
    ``plot`` extra, or a file that cannot be written.
    """
    check_output(path)
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".html":
            return _plotly(timeline, path)
        return _matplotlib(timeline, path)
    except OSError as exc:
        raise GpuwatchError(f"{path}: cannot write the plot: {exc.strerror}") from None


def _colour(detector: str, colours: dict[str, str]) -> str:
    return colours.setdefault(detector, _COLOURS[len(colours) % len(_COLOURS)])


def _minutes(timeline: Timeline, seconds: float) -> float:
    return (seconds - timeline.start_s) / 60.0


def _matplotlib(timeline: Timeline, path: Path) -> Any:
    figure_mod = _import("matplotlib.figure")
    _import("matplotlib.backends.backend_agg")  # Agg: no display needed
    n = max(1, timeline.gpu_count)
    fig = figure_mod.Figure(figsize=(11, 1.3 * n + 0.9), dpi=80, layout="constrained")
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    xs = [_minutes(timeline, t) for t in timeline.times_s]
    colours: dict[str, str] = {}
    for gpu, ax in enumerate(axes):
        ax.set_gid(f"gpu{gpu}")  # the panel's id in an SVG: <g id="gpu3">
        ax.set_ylim(0, 105)
        ax.set_ylabel(f"GPU {gpu}\nutil %", fontsize=8)
        ax.tick_params(labelsize=7)
        if gpu < len(timeline.util_pct):
            ax.plot(xs, _nan(timeline.util_pct[gpu]), color="#1f77b4", lw=0.8)
            mem = ax.twinx()
            mem.plot(xs, _nan(timeline.memory_bytes[gpu], _GIB), color="#2ca02c", lw=0.8)
            mem.set_ylabel("mem GiB", fontsize=7, color="#2ca02c")
            mem.tick_params(labelsize=7)
        for k, span in enumerate(timeline.spans):
            if span.gpu in (gpu, None):
                ax.axvspan(
                    _minutes(timeline, span.start_s),
                    _minutes(timeline, span.end_s),
                    color=_colour(span.detector, colours),
                    alpha=0.18 if span.gpu is not None else 0.08,
                    lw=0,
                    gid=f"gpu{gpu}-finding{k}-{span.detector}",
                )
        named = 0
        for k, mark in enumerate(timeline.marks):
            if mark.gpu in (gpu, None):
                x = _minutes(timeline, mark.time_s)
                ax.axvline(x, color="black", ls="--", lw=0.7, gid=f"gpu{gpu}-decision{k}")
                if mark.named and named < MAX_NAMED_LABELS:
                    named += 1
                    ax.text(
                        x,
                        3,
                        mark.label,
                        rotation=90,
                        fontsize=6,
                        va="bottom",
                        ha="right",
                        gid=f"gpu{gpu}-decision{k}-label",
                    )
    if timeline.marks:
        first = timeline.marks[0]
        axes[0].annotate(
            first.label + (f" (+{len(timeline.marks) - 1})" if len(timeline.marks) > 1 else ""),
            (_minutes(timeline, first.time_s), 100),
            fontsize=7,
            va="top",
        )
    patches = _import("matplotlib.patches")
    handles = [patches.Patch(color=c, alpha=0.4, label=d) for d, c in colours.items()]
    if handles:
        axes[0].legend(handles=handles, fontsize=7, loc="upper right", title="findings")
    axes[-1].set_xlabel("minutes since start", fontsize=8)
    fig.suptitle(f"{timeline.title}: utilization (blue), memory (green)", fontsize=9)
    fig.savefig(path)
    return fig


def _nan(values: list[float | None], scale: float = 1.0) -> list[float]:
    return [float("nan") if v is None else v / scale for v in values]


def _plotly(timeline: Timeline, path: Path) -> Any:
    subplots = _import("plotly.subplots")
    go = _import("plotly.graph_objects")
    n = max(1, timeline.gpu_count)
    fig = subplots.make_subplots(
        rows=n,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.02,
        subplot_titles=[f"GPU {g}" for g in range(n)],
        specs=[[{"secondary_y": True}] for _ in range(n)],
    )
    xs = [_minutes(timeline, t) for t in timeline.times_s]
    colours: dict[str, str] = {}
    for gpu in range(n):
        row = gpu + 1
        if gpu < len(timeline.util_pct):
            fig.add_trace(
                go.Scatter(x=xs, y=timeline.util_pct[gpu], name=f"GPU {gpu} utilization %"),
                row=row,
                col=1,
            )
            mem = [None if v is None else v / _GIB for v in timeline.memory_bytes[gpu]]
            fig.add_trace(
                go.Scatter(x=xs, y=mem, name=f"GPU {gpu} memory GiB"),
                row=row,
                col=1,
                secondary_y=True,
            )
        for span in timeline.spans:
            if span.gpu in (gpu, None):
                fig.add_vrect(
                    x0=_minutes(timeline, span.start_s),
                    x1=_minutes(timeline, span.end_s),
                    fillcolor=_colour(span.detector, colours),
                    opacity=0.2,
                    line_width=0,
                    row=row,
                    col=1,
                )
        marks = [m for m in timeline.marks if m.gpu in (gpu, None)]
        if marks:
            fig.add_trace(
                go.Scatter(
                    x=[_minutes(timeline, m.time_s) for m in marks],
                    y=[100.0] * len(marks),
                    mode="markers",
                    marker={"symbol": "triangle-down", "color": "black"},
                    text=[m.label for m in marks],
                    name=f"GPU {gpu} decisions",
                ),
                row=row,
                col=1,
            )
        fig.update_yaxes(range=[0, 105], row=row, col=1, secondary_y=False)
    fig.update_layout(
        title=f"{timeline.title}: utilization, memory, findings (shaded), decisions (▼)",
        height=180 * n + 100,
        showlegend=False,
    )
    fig.update_xaxes(title_text="minutes since start", row=n, col=1)
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)
    return fig
