"""Detectors: conditions over the metric windows that turn into Findings (pure).

A detector is configured by the ``when:`` part of a policy, e.g.
``low_utilization: {percent: 20, for: 5m}``. :data:`DETECTORS` maps each name to
its class; every class declares its parameters as :class:`ParamSpec` (name, unit
parser from :mod:`gpuwatchd.units`, required or default), the one source the
policy schema validates against and the docs are generated from.

Semantics, common to every detector here:

* A detector looks at one metric of every subject of its scope: ``gpu:<uuid>``
  (each GPU), ``host``, or ``job:<name>`` (each attached job). Its condition is a
  comparison of the newest sample with a threshold: *above* is strictly greater
  (``>``), *below* strictly less (``<``).
* The condition **holds for D** (``for: D``) at time ``now`` when every sample of
  that subject in ``[now - D, now]`` satisfies it *and* the samples cover at least
  ``D``: the unbroken streak of satisfying samples started at ``since_s <= now - D``.
  Before that there is no verdict (warm-up); ``for: 0`` holds on the first sample.
* A sample that is NA (unsupported, NVML error, GPU lost, a stale job report)
  breaks the streak, and so does a tick in which the subject is missing: a lost
  sample is not 0 %, and an unseen stretch is not evidence.
* While the condition keeps holding, the detector emits one
  :class:`~gpuwatchd.model.Finding` per subject on **every** evaluation, with
  ``value`` = mean of the samples in ``[now - D, now]``, ``threshold``,
  ``since_s`` = start of the streak and a message such as
  ``"GPU 3 utilization.gpu 0.0 % < 20 % for 5m00s"``. GPU findings carry
  ``gpu_uuid``/``gpu_index``; job findings carry ``job``.

Cost: a detector keeps only the streak start per subject and reads the newest
sample of each window, so one evaluation is O(subjects) and the mean is one
binary search (:meth:`gpuwatchd.windows.Window.mean_since`). The caller must
evaluate after every :meth:`gpuwatchd.windows.Windows.observe`, since a streak is
built from the newest samples one tick at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Final, NoReturn

from gpuwatchd.errors import UnitError
from gpuwatchd.model import Finding
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
    "DETECTORS",
    "DataStarved",
    "Detector",
    "ExclusiveGroup",
    "HostCpuAbove",
    "HostCpuBelow",
    "HostMemoryAbove",
    "LowUtilization",
    "ParamSpec",
    "VramAbove",
    "parse_params",
]

_EPS_S: Final = 1e-9
"""Slack for float timestamps (``0.1 * 3 != 0.3``) when comparing a streak with ``for:``."""

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


class Detector:
    """Base of all detectors: a threshold on one metric of each subject of one scope.

    Subclasses set the class attributes and :meth:`_finding`. ``params`` are the
    parsed params (see :meth:`parse_params`); the instance keeps the streak start per
    subject between evaluations, so one instance must see every tick.
    """

    name: ClassVar[str]
    scope: ClassVar[Scope]
    description: ClassVar[str]
    params: ClassVar[tuple[ParamSpec, ...]]
    groups: ClassVar[tuple[ExclusiveGroup, ...]] = ()
    above: ClassVar[bool] = True
    """True: the condition is ``value > threshold``; False: ``value < threshold``."""

    metric: str
    threshold: float

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.config: dict[str, Any] = dict(params)
        self.for_s: float = float(params["for"])
        self._for_text = f" for {format_duration(self.for_s)}" if self.for_s > 0 else ""
        self._start: dict[str, float] = {}

    @classmethod
    def parse_params(cls, raw: Mapping[str, object] | None, fail: Fail) -> dict[str, Any]:
        """Validate and parse this detector's YAML params; see :func:`parse_params`."""
        return parse_params(cls.params, cls.groups, raw, fail, what=f"detector {cls.name!r}")

    def needs(self) -> dict[MetricKey, float]:
        """The window this detector reads and its horizon: ``{(scope, metric): for_s}``."""
        return {(self.scope, self.metric): self.for_s}

    def reset(self) -> None:
        """Forget every streak (the clock jumped; the next verdict needs a new warm-up)."""
        self._start = {}

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
        """Update the streaks from the newest samples in ``windows``; return the findings.

        Time is ``windows.now`` (the snapshot's ``timestamp_s``). See the module doc
        for the semantics.
        """
        now = windows.now
        if now is None:
            return []
        old = self._start
        new: dict[str, float] = {}
        out: list[Finding] = []
        metric, threshold, above = self.metric, self.threshold, self.above
        for_s = self.for_s
        need_s = for_s - _EPS_S
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

    def _finding(self, entry: tuple[Any, ...], now: float, since: float, mean: float) -> Finding:
        raise NotImplementedError


class _GpuDetector(Detector):
    scope: ClassVar[Scope] = "gpu"
    label: ClassVar[str] = ""

    def _value_text(self, value: float) -> str:
        return f"{value:.1f} %"

    def _finding(self, entry: tuple[Any, ...], now: float, since: float, mean: float) -> Finding:
        subject, _, uuid, index = entry
        op = ">" if self.above else "<"
        message = (
            f"GPU {index} {self.label} {self._value_text(mean)} {op} "
            f"{self._threshold_text}{self._for_text}"
        )
        return Finding(
            self.name, subject, now, since, mean, self.threshold, message, uuid, index, None
        )

    @property
    def _threshold_text(self) -> str:
        return f"{self.threshold:g} %"


class VramAbove(_GpuDetector):
    """GPU memory (nvidia-smi ``memory.used``) above ``percent`` of ``memory.total`` or above
    ``bytes``, per GPU. With ``percent`` a GPU whose ``memory.total`` is unknown (a replayed
    trace without that column) never matches. Default: 90 % for 30 s.
    """

    name = "vram_above"
    label = "memory.used"
    description = "GPU memory used above a percentage of memory.total, or above a size"
    params = (
        _percent_param(90, "threshold as percent of memory.total (0..100)"),
        ParamSpec("bytes", parse_bytes, unit="bytes", help="threshold as a size (20GiB)"),
        _for_param("30s"),
    )
    groups = (ExclusiveGroup(("percent", "bytes")),)

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        if "bytes" in params:
            self.metric = "memory_used_bytes"
            self.threshold = float(params["bytes"])
        else:
            self.metric = "memory_used_pct"
            self.threshold = float(params["percent"])

    def _value_text(self, value: float) -> str:
        return format_bytes(value) if self.metric == "memory_used_bytes" else f"{value:.1f} %"

    @property
    def _threshold_text(self) -> str:
        if self.metric == "memory_used_bytes":
            return format_bytes(self.threshold)
        return f"{self.threshold:g} %"


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
        _for_param("5m"),
    )

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.threshold = float(params["percent"])


class _HostDetector(Detector):
    scope: ClassVar[Scope] = "host"
    label: ClassVar[str] = ""

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.threshold = float(params["percent"])

    def _finding(self, entry: tuple[Any, ...], now: float, since: float, mean: float) -> Finding:
        op = ">" if self.above else "<"
        message = f"host {self.label} {mean:.1f} % {op} {self.threshold:g} %{self._for_text}"
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
        _for_param("30s"),
    )


class DataStarved(Detector):
    """A job's data-loader wait fraction (the hook's ``data_wait_fraction``: time in the
    DataLoader's ``next()`` / step time) above ``fraction``, per attached job. A job that
    has not reported yet, or whose report went stale, does not match. Default: 0.5 for 1 min.
    """

    name = "data_starved"
    scope: ClassVar[Scope] = "job"
    description = "a job's DataLoader wait fraction (hook report) above a fraction"
    metric = "data_wait_fraction"
    params = (
        ParamSpec(
            "fraction",
            parse_fraction,
            default=0.5,
            unit="fraction",
            help="data-wait fraction threshold (0..1)",
        ),
        _for_param("1m"),
    )

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.threshold = float(params["fraction"])

    def _finding(self, entry: tuple[Any, ...], now: float, since: float, mean: float) -> Finding:
        subject, _, job = entry
        message = f"job {job} data-wait fraction {mean:.2f} > {self.threshold:g}{self._for_text}"
        return Finding(
            self.name, subject, now, since, mean, self.threshold, message, None, None, job
        )


DETECTORS: Final[Mapping[str, type[Detector]]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            VramAbove,
            LowUtilization,
            HostCpuAbove,
            HostCpuBelow,
            HostMemoryAbove,
            DataStarved,
        )
    }
)
"""Every detector a policy's ``when:`` may name, by name."""
