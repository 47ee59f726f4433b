"""GPU detectors: ``vram_above``, ``low_utilization``, ``idle_gpu`` (pure).

Specification: docs/modules.md#gpuwatchddetectors
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

from gpuwatchd.detectors.base import EPS_S, Detector, ThresholdDetector
from gpuwatchd.detectors.params import (
    ExclusiveGroup,
    Fail,
    ParamSpec,
    clear_param,
    for_param,
    parse_bool,
    percent_param,
)
from gpuwatchd.errors import UnitError
from gpuwatchd.model import Finding
from gpuwatchd.units import (
    format_bytes,
    format_duration,
    parse_bytes,
    parse_percent,
)
from gpuwatchd.windows import MetricKey, Scope, Windows

STATISTICS = ("every", "mean")
"""How a window detector judges its ``for:`` window: ``every`` sample must match (a break
restarts the streak), or the ``mean`` of the window must (short bursts do not break it)."""


def _parse_statistic(value: object) -> str:
    if value not in STATISTICS:
        raise ValueError(f"expected one of {', '.join(STATISTICS)}, got {value!r}")
    return str(value)


def _statistic_param() -> ParamSpec:
    return ParamSpec(
        "statistic",
        _parse_statistic,
        unit="every|mean",
        help="every (default): every sample of the for: window matches (one sample "
        "above breaks the streak); mean: the window's mean matches, judged at each tick "
        "once the GPU was seen for a whole window, so short bursts within a sustained "
        "condition do not split it into many findings",
    )


class _MeanWindow:
    """Per-GPU state of the ``statistic: mean`` form: when each GPU was first seen (the
    window is judged once it spans ``for:``) and the streak start of each firing GPU."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}
        self.start: dict[str, float] = {}
        self.firing: set[str] = set()

    def means(
        self, windows: Windows, metric: str, for_s: float
    ) -> list[tuple[tuple[Any, ...], float | None]]:
        """Each GPU entry with the mean of its last ``for_s`` seconds (None: not sampled at
        this tick, no valid sample, or not yet seen for ``for_s``)."""
        now = windows.now
        assert now is not None
        seen: dict[str, float] = {}
        out: list[tuple[tuple[Any, ...], float | None]] = []
        for entry in windows.gpus:
            window = entry[1].get(metric)
            if window is None or window.last_t != now:
                out.append((entry, None))
                continue
            first = seen[entry[0]] = self.seen.get(entry[0], now)
            full = now - first >= for_s - EPS_S
            out.append((entry, window.mean_since(now - for_s) if full else None))
        self.seen = seen
        return out

    def update(self, matched: dict[str, float]) -> None:
        """The GPUs that match at this tick, with their streak starts."""
        self.start = matched
        self.firing = set(matched)


UTIL_METRICS: Final[Mapping[str, str]] = {
    "utilization_gpu": "utilization_gpu_pct",
    "sm_active": "sm_active_pct",
    "auto": "busy_auto_pct",
}
"""``metric:`` of ``low_utilization`` and ``idle_gpu`` -> the window metric judged:
``utilization_gpu`` (nvidia-smi ``utilization.gpu``: the share of time any kernel ran),
``sm_active`` (GPM ``NVML_GPM_METRIC_SM_UTIL``, ``DCGM_FI_PROF_SM_ACTIVE``: the share of
SMs busy; NA where the GPU has no GPM, so it never matches there) or ``auto``
(``sm_active`` at each sample where the GPU reports it, else ``utilization.gpu``)."""


def _parse_metric(value: object) -> str:
    if value not in UTIL_METRICS:
        raise ValueError(f"expected one of {', '.join(UTIL_METRICS)}, got {value!r}")
    return str(value)


def _metric_param() -> ParamSpec:
    return ParamSpec(
        "metric",
        _parse_metric,
        unit="utilization_gpu|sm_active|auto",
        help="what is judged: utilization_gpu (default: time any kernel ran), sm_active (share of "
        "SMs busy, GPM; Hopper and later), auto (sm_active where the GPU reports it, else "
        "utilization.gpu); the message names the metric judged",
    )


def _judged(mode: str, entry: tuple[Any, ...]) -> str:
    """The name of the metric judged for GPU ``entry`` (its newest sample, for ``auto``)."""
    if mode == "utilization_gpu":
        return "utilization.gpu"
    if mode == "sm_active":
        return "SM active"
    by_metric = entry[1]
    window = None if by_metric is None else by_metric.get("sm_active_pct")
    return (
        "SM active" if window is not None and window.last_value is not None else ("utilization.gpu")
    )


def _metric_needs(mode: str, metric: str, for_s: float) -> dict[MetricKey, float]:
    needs: dict[MetricKey, float] = {("gpu", metric): for_s}
    if mode == "auto":
        needs["gpu", "sm_active_pct"] = 0.0  # only its newest value: which metric is judged
    return needs


def _parse_percent_or_size(value: object) -> float:
    # ``vram_above``'s ``clear`` is in the unit of its threshold; VramAbove.check re-parses.
    try:
        return parse_percent(value)
    except UnitError:
        return float(parse_bytes(value))


class _GpuDetector(ThresholdDetector):
    scope: ClassVar[Scope] = "gpu"
    label: ClassVar[str] = ""

    def _value_text(self, value: float) -> str:
        return f"{value:.1f} %"

    def finding(
        self, entry: tuple[Any, ...], now: float, since: float, mean: float, held: bool = False
    ) -> Finding:
        """:meth:`ThresholdDetector.finding` for GPU ``entry`` (``(subject, by_metric, uuid,
        index)``): ``GPU <index> <label> <mean> <rule>``."""
        subject, _, uuid, index = entry
        message = f"GPU {index} {self.label} {self._value_text(mean)} {self._rule_text(held)}"
        return Finding(
            self.name, subject, now, since, mean, self.threshold, message, uuid, index, None
        )


class VramAbove(_GpuDetector):
    """GPU memory (nvidia-smi ``memory.used``) above ``percent`` of ``memory.total`` or above
    ``bytes``, per GPU. With ``percent`` a GPU whose ``memory.total`` is unknown (a replayed
    trace without that column) never matches. ``clear`` is in the threshold's unit (a
    percentage with ``percent``, a size with ``bytes``). Default: 90 % for 30 s.
    """

    name = "vram_above"
    label = "memory.used"
    description = "GPU memory used above a percentage of memory.total, or above a size"
    params = (
        percent_param(90, "threshold as percent of memory.total (0..100)"),
        ParamSpec("bytes", parse_bytes, unit="bytes", help="threshold as a size (20GiB)"),
        ParamSpec(
            "clear",
            _parse_percent_or_size,
            unit="percent|bytes",
            help="hysteresis: once firing, holds until memory.used is at or below this, "
            "in the threshold's unit (default: the threshold, no hysteresis)",
        ),
        for_param("30s"),
    )
    groups = (ExclusiveGroup(("percent", "bytes")),)

    def metric_of(self, params: Mapping[str, Any]) -> str:
        """``memory_used_bytes`` with a ``bytes`` threshold, else ``memory_used_pct``."""
        return "memory_used_bytes" if "bytes" in params else "memory_used_pct"

    def _threshold_key(self, params: Mapping[str, Any]) -> str:
        return "bytes" if "bytes" in params else "percent"

    @classmethod
    def check(cls, parsed: dict[str, Any], raw: Mapping[str, object], fail: Fail) -> None:
        """Parse ``clear`` in the threshold's unit, then check its side."""
        if "clear" in raw:
            try:
                if "bytes" in parsed:
                    parsed["clear"] = parse_bytes(raw["clear"])
                else:
                    parsed["clear"] = parse_percent(raw["clear"])
            except UnitError as exc:
                fail("clear", f"clear: {exc} (clear is in the unit of the threshold)")
        super().check(parsed, raw, fail)

    def _value_text(self, value: float) -> str:
        return format_bytes(value) if self.metric == "memory_used_bytes" else f"{value:.1f} %"

    def _level_text(self, level: float) -> str:
        return format_bytes(level) if self.metric == "memory_used_bytes" else f"{level:g} %"


class LowUtilization(_GpuDetector):
    """GPU ``utilization.gpu`` (NVML ``nvmlDeviceGetUtilizationRates().gpu``: percent of the
    sample period a kernel ran) strictly below ``percent``, per GPU. Default: 20 % for 5 min.

    ``metric: sm_active`` judges the share of SMs busy instead (GPM, :data:`UTIL_METRICS`),
    so a GPU running tiny kernels (utilization.gpu 100 %, SM active 8 %) is found;
    ``metric: auto`` judges SM activity where the GPU reports it and utilization.gpu
    elsewhere. The message names the metric judged.

    ``statistic: mean``: the mean over the last ``for:`` is below ``percent`` (with
    ``clear``: once firing, until the mean reaches ``clear``); one finding per sustained
    condition, however often short bursts interrupt it (a rank that idles while the
    others compute, with a burst at each step). The finding's ``since`` is the start of
    the first window that matched.
    """

    name = "low_utilization"
    label = "utilization.gpu"
    description = "GPU utilization.gpu (or SM activity, metric:) strictly below a percentage"
    above = False
    params = (
        percent_param(20, "utilization.gpu (or metric:) threshold (0..100)"),
        clear_param(above=False),
        for_param("5m"),
        _statistic_param(),
        _metric_param(),
    )

    def metric_of(self, params: Mapping[str, Any]) -> str:
        """The window of ``metric:`` (utilization.gpu by default; :data:`UTIL_METRICS`)."""
        return UTIL_METRICS[str(params.get("metric", "utilization_gpu"))]

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.mode: str = str(params.get("metric", "utilization_gpu"))
        super().__init__(params)
        self.statistic: str = str(params.get("statistic", "every"))
        self._mean = _MeanWindow()
        if self.statistic == "mean":
            self._for_text = f" (mean over {format_duration(self.for_s)})"

    def needs(self) -> dict[MetricKey, float]:
        """The judged metric's window (and, ``auto``, SM activity's newest value)."""
        return _metric_needs(self.mode, self.metric, self.for_s)

    def reset(self) -> None:
        """Forget every streak, firing state and (``mean``) when GPUs were first seen."""
        super().reset()
        self._mean = _MeanWindow()

    def finding(
        self, entry: tuple[Any, ...], now: float, since: float, mean: float, held: bool = False
    ) -> Finding:
        """:meth:`ThresholdDetector.finding` for GPU ``entry`` (``(subject, by_metric, uuid,
        index)``), naming the metric judged (``mode``)."""
        subject, _, uuid, index = entry
        label = _judged(self.mode, entry)
        message = f"GPU {index} {label} {self._value_text(mean)} {self._rule_text(held)}"
        return Finding(
            self.name, subject, now, since, mean, self.threshold, message, uuid, index, None
        )

    def streaks(self) -> dict[str, float]:
        """GPUs whose condition holds now -> streak start."""
        return dict(self._mean.start) if self.statistic == "mean" else super().streaks()

    def evaluate(self, windows: Windows) -> list[Finding]:
        """``every``: :meth:`ThresholdDetector.evaluate`; ``mean``: the window mean."""
        if self.statistic != "mean":
            return super().evaluate(windows)
        now = windows.now
        if now is None:
            return []
        state = self._mean
        matched: dict[str, float] = {}
        out: list[Finding] = []
        for entry, mean in state.means(windows, self.metric, self.for_s):
            if mean is None:
                continue
            subject = entry[0]
            firing = subject in state.firing
            if mean >= (self.clear if firing else self.threshold):
                continue
            start = matched[subject] = state.start.get(subject, now - self.for_s)
            out.append(self.finding(entry, now, start, mean, firing and mean >= self.threshold))
        state.update(matched)
        return out


class IdleGpu(Detector):
    """A GPU idle while another GPU of the host is busy, per GPU: the "one GPU of two idle
    because of a worker->GPU assignment bug" pattern.

    ``metric: sm_active`` or ``auto`` judge SM activity (GPM) instead of
    ``utilization.gpu``, for *g* and its peers alike (:data:`UTIL_METRICS`).

    Utilization form (default): GPU *g* matches at a tick when its ``utilization.gpu`` is
    **at or below** ``percent`` and, at the same tick, some **other** GPU's
    ``utilization.gpu`` is **at or above** ``busy_percent``. Process form
    (``no_process: true``, without ``percent``/``busy_percent``): GPU *g* has no compute
    process (NVML ``nvmlDeviceGetComputeRunningProcesses`` is empty) while some other GPU
    has at least one; where NVML cannot list processes (containers without the host PID
    namespace, replayed traces) every list is empty and it never matches.

    Either form must hold for ``for:`` (window semantics of docs/modules.md): an NA
    sample of *g*, or a tick where no other GPU is (known to be) busy, breaks the streak.
    A host with one GPU never matches. The finding's ``value`` is *g*'s mean over
    ``for:`` (utilization %, or processes); its message names the busy GPU.
    Default: at or below 10 % while another is at or above 50 %, for 2 min.

    ``statistic: mean`` (utilization form): the imbalance over window means. GPU *g*
    matches when its mean over the last ``for:`` is at or below ``percent`` (once
    firing: at or below ``clear``) while the mean of at least one other GPU is at or
    above ``busy_percent``; short bursts of *g* (a rank that computes briefly at each
    step while its peers run flat out) do not split the condition. The message names
    *g* and its peers' figures (how many are busy, their average and lowest mean).
    """

    name = "idle_gpu"
    scope: ClassVar[Scope] = "gpu"
    description = "a GPU idle (or without a compute process) while another GPU is busy"
    params = (
        percent_param(10, "idle: utilization.gpu at or below this (0..100)"),
        ParamSpec(
            "busy_percent",
            parse_percent,
            default=50,
            unit="percent",
            help="busy: another GPU's utilization.gpu at or above this (0..100)",
        ),
        ParamSpec(
            "no_process",
            parse_bool,
            default=False,
            unit="bool",
            help="instead: no compute process on this GPU while another GPU has one "
            "(excludes percent and busy_percent)",
        ),
        for_param("2m"),
        _statistic_param(),
        ParamSpec(
            "clear",
            parse_percent,
            unit="percent",
            help="statistic: mean only; hysteresis: once firing, holds until this GPU's "
            "mean is above this (default: percent, no hysteresis)",
        ),
        _metric_param(),
    )

    @classmethod
    def check(cls, parsed: dict[str, Any], raw: Mapping[str, object], fail: Fail) -> None:
        """``no_process: true`` excludes ``percent``/``busy_percent``; busy must exceed idle."""
        if parsed["no_process"]:
            for key in ("percent", "busy_percent"):
                if key in raw:
                    fail(key, f"{key} does not apply with no_process: true")
                parsed.pop(key, None)
            if parsed.get("statistic") == "mean":
                fail("statistic", "statistic: mean does not apply with no_process: true")
            if "metric" in raw:
                fail("metric", "metric does not apply with no_process: true")
            return
        clear = parsed.get("clear")
        if clear is not None:
            if parsed.get("statistic") != "mean":
                fail("clear", "clear applies with statistic: mean only")
            elif clear < parsed["percent"] or clear >= parsed["busy_percent"]:
                fail(
                    "clear",
                    f"clear ({clear:g}) must be at or above percent ({parsed['percent']:g}) "
                    f"and below busy_percent ({parsed['busy_percent']:g})",
                )
        elif parsed["busy_percent"] <= parsed["percent"]:
            fail(
                "busy_percent",
                f"busy_percent ({parsed['busy_percent']:g}) must be above percent "
                f"({parsed['percent']:g})",
            )

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.no_process: bool = bool(params.get("no_process", False))
        self.mode: str = str(params.get("metric", "utilization_gpu"))
        self.metric = "compute_processes" if self.no_process else UTIL_METRICS[self.mode]
        self.threshold: float = 0.0 if self.no_process else float(params["percent"])
        self.busy: float = 1.0 if self.no_process else float(params["busy_percent"])
        self._start: dict[str, float] = {}
        self.statistic: str = str(params.get("statistic", "every"))
        clear = params.get("clear")
        self.clear: float = self.threshold if clear is None else float(clear)
        self._mean = _MeanWindow()

    def needs(self) -> dict[MetricKey, float]:
        """``{("gpu", the judged metric or compute_processes): for_s}`` (``auto``: and SM
        activity's newest value)."""
        if self.no_process:
            return {("gpu", self.metric): self.for_s}
        return _metric_needs(self.mode, self.metric, self.for_s)

    def reset(self) -> None:
        """Forget every streak (and, ``mean``, when GPUs were first seen)."""
        self._start = {}
        self._mean = _MeanWindow()

    def streaks(self) -> dict[str, float]:
        """GPUs whose condition holds now (possibly still warming up) -> streak start."""
        return dict(self._mean.start if self.statistic == "mean" else self._start)

    def evaluate(self, windows: Windows) -> list[Finding]:
        """Update the per-GPU streaks; return a finding per GPU idle for ``for:``."""
        now = windows.now
        if now is None:
            return []
        if self.statistic == "mean":
            return self._evaluate_means(windows, now)
        metric = self.metric
        idle, busy, for_s = self.threshold, self.busy, self.for_s
        values: list[float | None] = []
        best = second = -1.0
        best_at = -1
        low = math.inf
        for i, entry in enumerate(windows.gpus):
            window = entry[1].get(metric)
            value = None if window is None or window.last_t != now else window.last_value
            values.append(value)
            if value is not None:
                if value < low:
                    low = value
                if value > best:
                    best, second, best_at = value, best, i
                elif value > second:
                    second = value
        out: list[Finding] = []
        if best < busy or low > idle:  # none busy, or none idle: no streak goes on
            if self._start:
                self._start = {}
            return out
        old = self._start
        new: dict[str, float] = {}
        need_s = for_s - EPS_S
        for i, value in enumerate(values):
            if value is None or value > idle:
                continue
            other = second if i == best_at else best
            if other < busy:
                continue
            entry = windows.gpus[i]
            subject = entry[0]
            start = old.get(subject, now)
            new[subject] = start
            if now - start >= need_s:
                window = entry[1][metric]
                mean = window.mean_since(now - for_s)
                busy_at = best_at if i != best_at else self.second_at(values, i)
                busy_entry = windows.gpus[busy_at]
                busy_value = values[busy_at]
                assert busy_value is not None
                out.append(
                    self.finding(
                        entry,
                        busy_entry[3],
                        busy_value,
                        now,
                        start,
                        value if mean is None else mean,
                    )
                )
        self._start = new
        return out

    def _evaluate_means(self, windows: Windows, now: float) -> list[Finding]:
        state = self._mean
        means = state.means(windows, self.metric, self.for_s)
        matched: dict[str, float] = {}
        out: list[Finding] = []
        for entry, mean in means:
            if mean is None:
                continue
            subject = entry[0]
            if mean > (self.clear if subject in state.firing else self.threshold):
                continue
            peers = [m for other, m in means if other[0] != subject and m is not None]
            busy = [m for m in peers if m >= self.busy]
            if not busy:
                continue
            start = matched[subject] = state.start.get(subject, now - self.for_s)
            out.append(self.mean_finding(entry, now, start, mean, peers))
        state.update(matched)
        return out

    def mean_finding(
        self, entry: tuple[Any, ...], now: float, since: float, mean: float, peers: list[float]
    ) -> Finding:
        """The ``statistic: mean`` finding of GPU ``entry`` (``(subject, by_metric, uuid,
        index)``, a :class:`~gpuwatchd.windows.Windows` GPU entry) at ``now`` (seconds),
        holding since ``since`` (seconds); ``mean`` is its window mean over ``for:``
        (percent) and ``peers`` the other GPUs' window means (percent, in GPU order; at
        least one at or above ``busy``: ZeroDivisionError when none is). Shared by
        :meth:`evaluate` and the columnar replay (gpuwatchd/detectors/arrays.py)."""
        subject, _, uuid, index = entry
        busy = [m for m in peers if m >= self.busy]
        message = (
            f"GPU {index} {_judged(self.mode, entry)} {mean:.1f} % <= {self.threshold:g} % "
            "(mean over "
            f"{format_duration(self.for_s)}) while {len(busy)} of its {len(peers)} peers "
            f"are busy: mean {sum(busy) / len(busy):.1f} %, lowest {min(busy):.1f} % "
            f">= {self.busy:g} %"
        )
        return Finding(
            self.name, subject, now, since, mean, self.threshold, message, uuid, index, None
        )

    @staticmethod
    def second_at(values: Sequence[float | None], skip: int) -> int:
        """The position in ``values`` (one value per GPU, in GPU order; None where a GPU
        has none) of the first highest value other than position ``skip``; -1 when no
        other GPU has a value. :meth:`evaluate` names this GPU as the busy one when GPU
        ``skip`` is itself the busiest; the columnar replay makes the same choice."""
        at, top = -1, -1.0
        for i, value in enumerate(values):
            if i != skip and value is not None and value > top:
                at, top = i, value
        return at

    def finding(
        self,
        entry: tuple[Any, ...],
        busy_index: int,
        busy_value: float,
        now: float,
        since: float,
        mean: float,
    ) -> Finding:
        """The ``statistic: every`` finding of idle GPU ``entry`` (``(subject, by_metric,
        uuid, index)``, a :class:`~gpuwatchd.windows.Windows` GPU entry) at ``now``
        (seconds), holding since ``since`` (seconds), with ``mean`` its window mean over
        ``for:``; the message names the busy GPU, NVML index ``busy_index``, and its
        newest value ``busy_value``. Both values are percent, or compute-process counts
        with ``no_process``. Shared by :meth:`evaluate` and the columnar replay
        (gpuwatchd/detectors/arrays.py)."""
        subject, _, uuid, index = entry
        if self.no_process:
            message = (
                f"GPU {index} has no compute process while GPU {busy_index} has "
                f"{busy_value:.0f}{self._for_text}"
            )
        else:
            message = (
                f"GPU {index} {_judged(self.mode, entry)} {mean:.1f} % <= {self.threshold:g} % "
                "while "
                f"GPU {busy_index} is at {busy_value:.1f} % >= {self.busy:g} %{self._for_text}"
            )
        return Finding(
            self.name, subject, now, since, mean, self.threshold, message, uuid, index, None
        )
