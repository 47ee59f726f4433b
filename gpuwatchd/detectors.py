"""Detectors: conditions over the metric windows and job events that turn into Findings (pure).

Specification: docs/modules.md#gpuwatchddetectors
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Final, NoReturn

from gpuwatchd.errors import UnitError
from gpuwatchd.model import Finding, JobEvent
from gpuwatchd.units import (
    format_bytes,
    format_duration,
    parse_bytes,
    parse_duration,
    parse_fraction,
    parse_percent,
)
from gpuwatchd.windows import MetricKey, Scope, Windows

__all__ = [
    "CRASH_KINDS",
    "DETECTORS",
    "DataStarved",
    "Detector",
    "EventDetector",
    "EventFinding",
    "ExclusiveGroup",
    "HostCpuAbove",
    "HostCpuBelow",
    "HostMemoryAbove",
    "IdleGpu",
    "JobCrashed",
    "LowUtilization",
    "ParamSpec",
    "ThresholdDetector",
    "TrialsSucceededInRow",
    "VramAbove",
    "parse_params",
]

_EPS_S: Final = 1e-9
"""Slack for float timestamps (``0.1 * 3 != 0.3``) when comparing a streak with ``for:``."""

CRASH_KINDS: Final = ("cuda_assert", "cuda_oom", "host_oom", "environment", "other")
"""``JobEvent.crash_kind`` values (model.JobEvent); ``job_crashed`` also accepts ``any``."""

_SUCCESS_STATES: Final = frozenset({"COMPLETE", "PRUNED"})
"""Optuna ``TrialState`` names that count as a clean trial for ``trials_succeeded_in_row``."""
_MAX_TRIAL_COUNTERS: Final = 4096
"""Jobs whose clean-trial count is kept at most (bounds memory against endless job names)."""

Fail = Callable[[str | None, str], NoReturn]
"""``fail(key, message)``: raise a located error at param ``key`` (None: the whole mapping)."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a detector or action.

    ``parse`` turns the YAML value into the stored value (seconds, bytes, percent,
    fraction, ...) and raises ValueError (:class:`~gpuwatchd.errors.UnitError` is one)
    with a readable message. ``default`` is written as in YAML (``"5m"``) and parsed
    the same way; None means no default. ``unit`` and ``help`` feed the docs.
    """

    name: str
    parse: Callable[[object], Any]
    required: bool = False
    default: object = None
    unit: str = ""
    help: str = ""


@dataclass(frozen=True)
class ExclusiveGroup:
    """Parameters of which at most one may be given; exactly one when ``required``.

    If none is given and the group is optional, the first member with a default gets it.
    """

    names: tuple[str, ...]
    required: bool = False


def parse_params(
    specs: Sequence[ParamSpec],
    groups: Sequence[ExclusiveGroup],
    raw: Mapping[str, object] | None,
    fail: Fail,
    *,
    what: str,
) -> dict[str, Any]:
    """Validate ``raw`` (the YAML mapping of params, None = empty) against ``specs``.

    Returns the parsed params, defaults filled in. Calls ``fail(key, message)`` (which
    must raise) for an unknown key, a bad value, a missing required param, or a
    violated :class:`ExclusiveGroup`; ``key`` None points at the mapping itself.
    ``what`` names the owner in messages (``"detector 'vram_above'"``).
    """
    by_name = {s.name: s for s in specs}
    out: dict[str, Any] = {}
    for key, value in (raw or {}).items():
        spec = by_name.get(key)
        if spec is None:
            known = ", ".join(sorted(by_name)) or "none"
            fail(key, f"unknown parameter {key!r} for {what} (known: {known})")
        try:
            out[key] = spec.parse(value)
        except (UnitError, ValueError, TypeError) as exc:
            fail(key, f"{key}: {exc}")
    grouped: set[str] = set()
    for group in groups:
        grouped.update(group.names)
        given = [n for n in group.names if n in out]
        if len(given) > 1:
            fail(given[1], f"{what} takes only one of {', '.join(group.names)}")
        if not given:
            if group.required:
                fail(None, f"{what} needs one of {', '.join(group.names)}")
            for name in group.names:
                if by_name[name].default is not None:
                    out[name] = by_name[name].parse(by_name[name].default)
                    break
    for spec in specs:
        if spec.name in out or spec.name in grouped:
            continue
        if spec.required:
            fail(None, f"{what} needs parameter {spec.name!r}")
        if spec.default is not None:
            out[spec.name] = spec.parse(spec.default)
    return out


def _parse_bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _parse_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected an integer >= 1, got {value!r}")
    return value


def _parse_crash_kinds(value: object) -> tuple[str, ...]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError("expected a crash kind or a non-empty list of them")
    allowed = (*CRASH_KINDS, "any")
    for item in items:
        if item not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {item!r}")
    return tuple(sorted(set(items)))


def _parse_percent_or_size(value: object) -> float:
    # ``vram_above``'s ``clear`` is in the unit of its threshold; VramAbove.check re-parses.
    try:
        return parse_percent(value)
    except UnitError:
        return float(parse_bytes(value))


def _percent_param(default: float, help_text: str) -> ParamSpec:
    return ParamSpec("percent", parse_percent, default=default, unit="percent", help=help_text)


def _for_param(default: str) -> ParamSpec:
    return ParamSpec(
        "for",
        parse_duration,
        default=default,
        unit="duration",
        help="how long the condition must hold without a break (30s, 5m)",
    )


def _clear_param(above: bool, unit: str = "percent") -> ParamSpec:
    side = "at or below" if above else "at or above"
    return ParamSpec(
        "clear",
        parse_percent if unit == "percent" else parse_fraction,
        unit=unit,
        help=f"hysteresis: once firing, holds until the value is {side} this (default: the "
        "threshold, no hysteresis)",
    )


@dataclass(frozen=True, slots=True)
class EventFinding(Finding):
    """A :class:`~gpuwatchd.model.Finding` made from one job event; ``event`` is that event.

    Actions that need the event's details (``restart_worker``, ``restart_study``: the
    crashed pid, crash kind, GPU, trial number) read them from ``event``.
    """

    event: JobEvent | None = None


class Detector:
    """Base of all detectors: a condition over the windows (and events) of one scope.

    Subclasses set the class attributes and :meth:`evaluate`. ``params`` are the
    parsed params (see :meth:`parse_params`); an instance keeps its state (streaks,
    counters) between evaluations, so one instance must see every tick.
    """

    name: ClassVar[str]
    scope: ClassVar[Scope]
    description: ClassVar[str]
    params: ClassVar[tuple[ParamSpec, ...]]
    groups: ClassVar[tuple[ExclusiveGroup, ...]] = ()
    event: ClassVar[bool] = False
    """True for event detectors (no ``for:``, one finding per matching event)."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.config: dict[str, Any] = dict(params)
        self.for_s: float = float(params.get("for", 0.0))
        self._for_text = f" for {format_duration(self.for_s)}" if self.for_s > 0 else ""

    @classmethod
    def parse_params(cls, raw: Mapping[str, object] | None, fail: Fail) -> dict[str, Any]:
        """Validate and parse this detector's YAML params; see :func:`parse_params`.

        Calls ``fail(key, message)`` for any problem, including cross-checks of several
        params (:meth:`check`).
        """
        parsed = parse_params(cls.params, cls.groups, raw, fail, what=f"detector {cls.name!r}")
        cls.check(parsed, raw or {}, fail)
        return parsed

    @classmethod
    def check(cls, parsed: dict[str, Any], raw: Mapping[str, object], fail: Fail) -> None:
        """Cross-check (and possibly adjust) ``parsed``; ``raw`` is the YAML mapping."""

    def needs(self) -> dict[MetricKey, float]:
        """The windows this detector reads and their horizons: ``{(scope, metric): for_s}``."""
        return {}

    def reset(self) -> None:
        """Forget every streak and counter (a fresh start: the next verdict needs a warm-up)."""

    def on_gap(self) -> None:
        """The snapshots paused longer than ``max_gap_s`` or the clock stepped back.

        Window detectors forget their streaks (unseen time is not evidence); event
        detectors keep their counters (no event was lost).
        """
        self.reset()

    def streaks(self) -> dict[str, float]:
        """Subjects whose condition holds now (possibly still warming up) -> streak start."""
        return {}

    def evaluate(self, windows: Windows) -> list[Finding]:
        """Update the state from the newest samples in ``windows``; return the findings.

        Time is ``windows.now`` (the snapshot's ``timestamp_s``). See the module doc.
        """
        raise NotImplementedError


class ThresholdDetector(Detector):
    """A threshold on one metric of each subject of one scope, held for ``for:``.

    Subclasses set ``metric``, ``threshold``, ``above`` and :meth:`_finding`; the
    optional ``clear`` param adds hysteresis (module doc).
    """

    above: ClassVar[bool] = True
    """True: the condition is ``value > threshold``; False: ``value < threshold``."""

    metric: str
    threshold: float
    threshold_param: ClassVar[str] = "percent"

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self._start: dict[str, float] = {}
        self._firing: frozenset[str] | set[str] = frozenset()
        self.threshold = float(params[self._threshold_key(params)])
        clear = params.get("clear")
        self.clear: float = self.threshold if clear is None else float(clear)
        self._rules: dict[bool, str] = {}

    def _threshold_key(self, params: Mapping[str, Any]) -> str:
        return self.threshold_param

    @classmethod
    def check(cls, parsed: dict[str, Any], raw: Mapping[str, object], fail: Fail) -> None:
        """``clear`` must lie on the back side of the threshold (``<=`` above, ``>=`` below)."""
        clear = parsed.get("clear")
        if clear is None:
            return
        key = next(n for n in (cls.threshold_param, "percent", "bytes") if n in parsed)
        threshold = parsed[key]
        if cls.above and clear > threshold:
            fail("clear", f"clear ({clear:g}) must not be above {key} ({threshold:g})")
        if not cls.above and clear < threshold:
            fail("clear", f"clear ({clear:g}) must not be below {key} ({threshold:g})")

    def needs(self) -> dict[MetricKey, float]:
        """``{(scope, metric): for_s}``: the one window this detector reads."""
        return {(self.scope, self.metric): self.for_s}

    def reset(self) -> None:
        """Forget every streak and firing state."""
        self._start = {}
        self._firing = frozenset()

    def streaks(self) -> dict[str, float]:
        """Subjects whose condition holds now (possibly still warming up) -> streak start."""
        return dict(self._start)

    def _entries(self, windows: Windows) -> Sequence[tuple[Any, ...]]:
        if self.scope == "gpu":
            return windows.gpus
        if self.scope == "job":
            return windows.jobs
        return windows.hosts

    def evaluate(self, windows: Windows) -> list[Finding]:
        """Update the streaks from the newest samples in ``windows``; return the findings."""
        now = windows.now
        if now is None:
            return []
        old = self._start
        new: dict[str, float] = {}
        out: list[Finding] = []
        metric, threshold, above = self.metric, self.threshold, self.above
        for_s = self.for_s
        need_s = for_s - _EPS_S
        if self.clear == threshold:  # no hysteresis: the hot path
            for entry in self._entries(windows):
                window = entry[1].get(metric)
                if window is None or window.last_t != now:
                    continue
                value = window.last_value
                if value is None or (value <= threshold if above else value >= threshold):
                    continue
                subject = entry[0]
                start = old.get(subject, now)
                new[subject] = start
                if now - start >= need_s:
                    mean = window.mean_since(now - for_s)
                    out.append(self._finding(entry, now, start, value if mean is None else mean))
            self._start = new
            return out
        clear = self.clear
        firing = self._firing
        fired: set[str] = set()
        for entry in self._entries(windows):
            window = entry[1].get(metric)
            if window is None or window.last_t != now:
                continue
            value = window.last_value
            if value is None:
                continue
            subject = entry[0]
            level = clear if subject in firing else threshold
            if value <= level if above else value >= level:
                continue
            start = old.get(subject, now)
            new[subject] = start
            if now - start >= need_s:
                mean = window.mean_since(now - for_s)
                held = value <= threshold if above else value >= threshold
                out.append(self._finding(entry, now, start, value if mean is None else mean, held))
                fired.add(subject)
        self._start = new
        self._firing = fired
        return out

    def _op_text(self, held: bool) -> str:
        op = ">" if self.above else "<"
        if held:
            return f"{op} {self._level_text(self.clear)} (clear level; fired at {op} "
        return f"{op} "

    def _level_text(self, level: float) -> str:
        return f"{level:g} %"

    def _rule_text(self, held: bool) -> str:
        """``"> 95 % for 30s"``, or the hysteresis form when ``held`` (cached: per finding)."""
        cached = self._rules.get(held)
        if cached is None:
            head = self._op_text(held) + self._level_text(self.threshold) + self._for_text
            cached = self._rules[held] = head + ")" if held else head
        return cached

    def _finding(
        self, entry: tuple[Any, ...], now: float, since: float, mean: float, held: bool = False
    ) -> Finding:
        raise NotImplementedError


class _GpuDetector(ThresholdDetector):
    scope: ClassVar[Scope] = "gpu"
    label: ClassVar[str] = ""

    def _value_text(self, value: float) -> str:
        return f"{value:.1f} %"

    def _finding(
        self, entry: tuple[Any, ...], now: float, since: float, mean: float, held: bool = False
    ) -> Finding:
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
        _percent_param(90, "threshold as percent of memory.total (0..100)"),
        ParamSpec("bytes", parse_bytes, unit="bytes", help="threshold as a size (20GiB)"),
        ParamSpec(
            "clear",
            _parse_percent_or_size,
            unit="percent|bytes",
            help="hysteresis: once firing, holds until memory.used is at or below this, "
            "in the threshold's unit (default: the threshold, no hysteresis)",
        ),
        _for_param("30s"),
    )
    groups = (ExclusiveGroup(("percent", "bytes")),)

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.metric = "memory_used_bytes" if "bytes" in params else "memory_used_pct"
        super().__init__(params)

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
    """

    name = "low_utilization"
    label = "utilization.gpu"
    description = "GPU utilization.gpu strictly below a percentage"
    above = False
    metric = "utilization_gpu_pct"
    params = (
        _percent_param(20, "utilization.gpu threshold (0..100)"),
        _clear_param(above=False),
        _for_param("5m"),
    )


class _HostDetector(ThresholdDetector):
    scope: ClassVar[Scope] = "host"
    label: ClassVar[str] = ""

    def _finding(
        self, entry: tuple[Any, ...], now: float, since: float, mean: float, held: bool = False
    ) -> Finding:
        message = f"host {self.label} {mean:.1f} % {self._rule_text(held)}"
        return Finding(self.name, "host", now, since, mean, self.threshold, message)


class HostCpuAbove(_HostDetector):
    """Host CPU utilization (psutil ``cpu_percent()``: all logical CPUs, 0..100) above
    ``percent``. Default: 90 % for 30 s.
    """

    name = "host_cpu_above"
    label = "CPU"
    description = "host CPU utilization (all logical CPUs) above a percentage"
    metric = "cpu_pct"
    params = (
        _percent_param(90, "CPU threshold, percent of all logical CPUs"),
        _clear_param(above=True),
        _for_param("30s"),
    )


class HostCpuBelow(HostCpuAbove):
    """Host CPU utilization strictly below ``percent``: the host has cores to spare.

    Pairs with ``data_starved`` so that more DataLoader workers are asked for only
    when they can get a core (more workers on a saturated host starve the job more).
    Default: 80 % for 30 s.
    """

    name = "host_cpu_below"
    description = "host CPU utilization (all logical CPUs) strictly below a percentage"
    above = False
    params = (
        _percent_param(80, "CPU threshold, percent of all logical CPUs"),
        _clear_param(above=False),
        _for_param("30s"),
    )


class HostMemoryAbove(_HostDetector):
    """Host memory used (psutil ``virtual_memory()``: used / total) above ``percent``.
    Default: 90 % for 30 s.
    """

    name = "host_memory_above"
    label = "memory"
    description = "host memory used above a percentage of total"
    metric = "memory_used_pct"
    params = (
        _percent_param(90, "memory threshold, percent of total"),
        _clear_param(above=True),
        _for_param("30s"),
    )


class DataStarved(ThresholdDetector):
    """A job's data-loader wait fraction (the hook's ``data_wait_fraction``: time in the
    DataLoader's ``next()`` / step time) above ``fraction``, per attached job. A job that
    has not reported yet, or whose report went stale, does not match. Default: 0.5 for 1 min.
    """

    name = "data_starved"
    scope: ClassVar[Scope] = "job"
    description = "a job's DataLoader wait fraction (hook report) above a fraction"
    metric = "data_wait_fraction"
    threshold_param = "fraction"
    params = (
        ParamSpec(
            "fraction",
            parse_fraction,
            default=0.5,
            unit="fraction",
            help="data-wait fraction threshold (0..1)",
        ),
        _clear_param(above=True, unit="fraction"),
        _for_param("1m"),
    )

    def _level_text(self, level: float) -> str:
        return f"{level:g}"

    def _finding(
        self, entry: tuple[Any, ...], now: float, since: float, mean: float, held: bool = False
    ) -> Finding:
        subject, _, job = entry
        message = f"job {job} data-wait fraction {mean:.2f} {self._rule_text(held)}"
        return Finding(
            self.name, subject, now, since, mean, self.threshold, message, None, None, job
        )


class IdleGpu(Detector):
    """A GPU idle while another GPU of the host is busy, per GPU: the "one GPU of two idle
    because of a worker->GPU assignment bug" pattern.

    Utilization form (default): GPU *g* matches at a tick when its ``utilization.gpu`` is
    **at or below** ``percent`` and, at the same tick, some **other** GPU's
    ``utilization.gpu`` is **at or above** ``busy_percent``. Process form
    (``no_process: true``, without ``percent``/``busy_percent``): GPU *g* has no compute
    process (NVML ``nvmlDeviceGetComputeRunningProcesses`` is empty) while some other GPU
    has at least one; where NVML cannot list processes (containers without the host PID
    namespace, replayed traces) every list is empty and it never matches.

    Either form must hold for ``for:`` (window semantics of the module doc): an NA
    sample of *g*, or a tick where no other GPU is (known to be) busy, breaks the streak.
    A host with one GPU never matches. The finding's ``value`` is *g*'s mean over
    ``for:`` (utilization %, or processes); its message names the busy GPU.
    Default: at or below 10 % while another is at or above 50 %, for 2 min.
    """

    name = "idle_gpu"
    scope: ClassVar[Scope] = "gpu"
    description = "a GPU idle (or without a compute process) while another GPU is busy"
    params = (
        _percent_param(10, "idle: utilization.gpu at or below this (0..100)"),
        ParamSpec(
            "busy_percent",
            parse_percent,
            default=50,
            unit="percent",
            help="busy: another GPU's utilization.gpu at or above this (0..100)",
        ),
        ParamSpec(
            "no_process",
            _parse_bool,
            default=False,
            unit="bool",
            help="instead: no compute process on this GPU while another GPU has one "
            "(excludes percent and busy_percent)",
        ),
        _for_param("2m"),
    )

    @classmethod
    def check(cls, parsed: dict[str, Any], raw: Mapping[str, object], fail: Fail) -> None:
        """``no_process: true`` excludes ``percent``/``busy_percent``; busy must exceed idle."""
        if parsed["no_process"]:
            for key in ("percent", "busy_percent"):
                if key in raw:
                    fail(key, f"{key} does not apply with no_process: true")
                parsed.pop(key, None)
        elif parsed["busy_percent"] <= parsed["percent"]:
            fail(
                "busy_percent",
                f"busy_percent ({parsed['busy_percent']:g}) must be above percent "
                f"({parsed['percent']:g})",
            )

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.no_process: bool = bool(params.get("no_process", False))
        self.metric = "compute_processes" if self.no_process else "utilization_gpu_pct"
        self.threshold: float = 0.0 if self.no_process else float(params["percent"])
        self.busy: float = 1.0 if self.no_process else float(params["busy_percent"])
        self._start: dict[str, float] = {}

    def needs(self) -> dict[MetricKey, float]:
        """``{("gpu", utilization_gpu_pct or compute_processes): for_s}``."""
        return {("gpu", self.metric): self.for_s}

    def reset(self) -> None:
        """Forget every streak."""
        self._start = {}

    def streaks(self) -> dict[str, float]:
        """GPUs whose condition holds now (possibly still warming up) -> streak start."""
        return dict(self._start)

    def evaluate(self, windows: Windows) -> list[Finding]:
        """Update the per-GPU streaks; return a finding per GPU idle for ``for:``."""
        now = windows.now
        if now is None:
            return []
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
        need_s = for_s - _EPS_S
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
                busy_entry = windows.gpus[best_at if i != best_at else self._second_at(values, i)]
                out.append(
                    self._finding(entry, busy_entry, now, start, value if mean is None else mean)
                )
        self._start = new
        return out

    @staticmethod
    def _second_at(values: Sequence[float | None], skip: int) -> int:
        at, top = -1, -1.0
        for i, value in enumerate(values):
            if i != skip and value is not None and value > top:
                at, top = i, value
        return at

    def _finding(
        self,
        entry: tuple[Any, ...],
        busy_entry: tuple[Any, ...],
        now: float,
        since: float,
        mean: float,
    ) -> Finding:
        subject, _, uuid, index = entry
        busy_value = busy_entry[1][self.metric].last_value
        if self.no_process:
            message = (
                f"GPU {index} has no compute process while GPU {busy_entry[3]} has "
                f"{busy_value:.0f}{self._for_text}"
            )
        else:
            message = (
                f"GPU {index} utilization.gpu {mean:.1f} % <= {self.threshold:g} % while "
                f"GPU {busy_entry[3]} is at {busy_value:.1f} % >= {self.busy:g} %{self._for_text}"
            )
        return Finding(
            self.name, subject, now, since, mean, self.threshold, message, uuid, index, None
        )


class EventDetector(Detector):
    """Base of the event detectors: one finding per matching job event, no ``for:``."""

    scope: ClassVar[Scope] = "job"
    event: ClassVar[bool] = True

    def on_gap(self) -> None:
        """Keep the counters: a pause between snapshots loses no job event."""

    def _event_finding(
        self, event: JobEvent, now: float, value: float, threshold: float, message: str
    ) -> EventFinding:
        return EventFinding(
            detector=self.name,
            subject="job:" + event.job,
            timestamp_s=now,
            since_s=now,
            value=value,
            threshold=threshold,
            message=message,
            gpu_uuid=None,
            gpu_index=event.gpu_index,
            job=event.job,
            event=event,
        )


def _crash_kind(event: JobEvent) -> str:
    kind = event.crash_kind
    return kind if kind in CRASH_KINDS else "other"


CRASH_DEDUP_S: Final = 60.0
"""Window in which a second crash event of the same (job, pid) is the same death."""


class JobCrashed(EventDetector):
    """A worker of a job died: each ``JobEvent(kind="crash")`` whose ``crash_kind`` is
    one of ``kind`` (``cuda_assert``: CUDA device-side assert, ``cudaErrorAssert``;
    ``cuda_oom``: CUDA out of memory; ``host_oom``: killed by the kernel's OOM killer;
    ``other``; ``any``: all of them; a list matches any of its kinds; a missing or
    unknown crash kind counts as ``other``) gives one finding, once, on the tick the
    event arrives. Subject ``job:<name>``; ``gpu_index`` from the event; the message
    names the pid, GPU, crash kind and trial; the :class:`EventFinding` carries the
    event itself. Default: ``any``.

    One death, one finding: the hook (its exception) and the supervisor (the exit
    status) may both report the same worker's crash; a second crash event of the same
    ``(job, pid)`` within :data:`CRASH_DEDUP_S` seconds of event time is ignored.
    """

    name = "job_crashed"
    description = "a worker process of a job died (once per crash event)"
    params = (
        ParamSpec(
            "kind",
            _parse_crash_kinds,
            default="any",
            unit="kind|list",
            help=(
                "crash kinds to match: cuda_assert, cuda_oom, host_oom, environment, other "
                "or any"
            ),
        ),
    )

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        kinds = tuple(params.get("kind", ("any",)))
        self.kinds: frozenset[str] = frozenset(CRASH_KINDS if "any" in kinds else kinds)
        self._seen: dict[tuple[str, int], float] = {}
        """(job, pid) -> time of its last crash finding; pruned, so bounded."""

    def _duplicate(self, event: JobEvent) -> bool:
        if event.pid is None:
            return False
        horizon = event.timestamp_s - CRASH_DEDUP_S
        self._seen = {key: t for key, t in self._seen.items() if t >= horizon}
        key = (event.job, event.pid)
        if key in self._seen:
            return True
        self._seen[key] = event.timestamp_s
        return False

    def evaluate(self, windows: Windows) -> list[Finding]:
        """One finding per crash event of ``windows.events`` with a matching kind."""
        now, events = windows.now, windows.events
        if now is None or not events:
            return []
        out: list[Finding] = []
        for event in events:
            if event.kind != "crash":
                continue
            kind = _crash_kind(event)
            if kind not in self.kinds or self._duplicate(event):
                continue
            parts = [f"job {event.job} worker"]
            if event.pid is not None:
                parts.append(f"pid {event.pid}")
            parts.append(f"crashed: {event.crash_kind or 'other'}")
            if event.gpu_index is not None:
                parts.append(f"on GPU {event.gpu_index}")
            if event.trial_number is not None:
                parts.append(f"in trial {event.trial_number}")
            message = " ".join(parts) + (f" ({event.message})" if event.message else "")
            out.append(self._event_finding(event, now, 1.0, 1.0, message))
        return out


class TrialsSucceededInRow(EventDetector):
    """``count`` Optuna trials of one job in a row ended ``COMPLETE`` or ``PRUNED``
    (``JobEvent(kind="trial")``, Optuna ``TrialState`` names). A ``FAIL`` trial or a crash
    of that job resets its count to 0; when the count reaches ``count`` the detector fires
    once (subject ``job:<name>``, ``value`` = ``count``) and the count starts again from 0,
    so it fires again after another ``count`` clean trials. Other states and OOM events
    the job survived change nothing. Counts live in memory (a restarted daemon starts
    from 0, which can only delay a ``raise_parallelism``). Default: 50 trials.
    """

    name = "trials_succeeded_in_row"
    description = "a job's last N Optuna trials all ended COMPLETE or PRUNED"
    params = (
        ParamSpec(
            "count",
            _parse_count,
            default=50,
            unit="trials",
            help="clean trials in a row (COMPLETE or PRUNED; a FAIL or crash resets)",
        ),
    )

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.count: int = int(params.get("count", 50))
        self._counts: dict[str, int] = {}

    def reset(self) -> None:
        """Forget every job's count."""
        self._counts = {}

    def counts(self) -> dict[str, int]:
        """Clean trials in a row so far, per job (for status and tests)."""
        return dict(self._counts)

    def evaluate(self, windows: Windows) -> list[Finding]:
        """Count trial outcomes of ``windows.events``; a finding per job reaching ``count``."""
        now, events = windows.now, windows.events
        if now is None or not events:
            return []
        counts = self._counts
        out: list[Finding] = []
        for event in events:
            job = event.job
            if event.kind == "crash" or (event.kind == "trial" and event.trial_state == "FAIL"):
                counts.pop(job, None)  # absent counts as 0
                continue
            if event.kind != "trial" or event.trial_state not in _SUCCESS_STATES:
                continue
            if job not in counts and len(counts) >= _MAX_TRIAL_COUNTERS:
                del counts[next(iter(counts))]  # the longest-tracked job goes, not everyone
            n = counts.get(job, 0) + 1
            if n >= self.count:
                n = 0
                message = (
                    f"job {job}: {self.count} trials in a row COMPLETE or PRUNED "
                    f"(last: trial {event.trial_number} {event.trial_state})"
                )
                out.append(self._event_finding(event, now, self.count, self.count, message))
            counts[job] = n
        return out


DETECTORS: Final[Mapping[str, type[Detector]]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            VramAbove,
            LowUtilization,
            IdleGpu,
            HostCpuAbove,
            HostCpuBelow,
            HostMemoryAbove,
            DataStarved,
            JobCrashed,
            TrialsSucceededInRow,
        )
    }
)
"""Every detector a policy's ``when:`` may name, by name."""
