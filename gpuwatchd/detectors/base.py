"""Detector base classes: ``Detector``, ``ThresholdDetector``, ``EventDetector`` (pure).

Window and event semantics: docs/modules.md#gpuwatchddetectors
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from gpuwatchd.detectors.params import ExclusiveGroup, Fail, ParamSpec, parse_params
from gpuwatchd.model import Finding, JobEvent
from gpuwatchd.units import (
    format_duration,
)
from gpuwatchd.windows import MetricKey, Scope, Windows

EPS_S: Final = 1e-9
"""Slack for float timestamps (``0.1 * 3 != 0.3``) when comparing a streak with ``for:``."""


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

        Time is ``windows.now`` (the snapshot's ``timestamp_s``). See docs/modules.md.
        """
        raise NotImplementedError


class ThresholdDetector(Detector):
    """A threshold on one metric of each subject of one scope, held for ``for:``.

    Subclasses set ``default_metric`` (or :meth:`metric_of`), ``above`` and
    :meth:`finding`; the optional ``clear`` param adds hysteresis (docs/modules.md).
    """

    above: ClassVar[bool] = True
    """True: the condition is ``value > threshold``; False: ``value < threshold``."""

    default_metric: ClassVar[str] = ""
    """The metric read (a window of :class:`~gpuwatchd.windows.Windows`) unless
    :meth:`metric_of` chooses another by a param."""
    threshold_param: ClassVar[str] = "percent"

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.metric: str = self.metric_of(params)
        """The metric this detector reads, e.g. ``utilization_gpu_pct``."""
        super().__init__(params)
        self._start: dict[str, float] = {}
        self._firing: frozenset[str] | set[str] = frozenset()
        self.threshold: float = float(params[self._threshold_key(params)])
        clear = params.get("clear")
        self.clear: float = self.threshold if clear is None else float(clear)
        self._rules: dict[bool, str] = {}

    def metric_of(self, params: Mapping[str, Any]) -> str:
        """The metric read with these (parsed) params: :attr:`default_metric` here."""
        return self.default_metric

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
        need_s = for_s - EPS_S
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
                    out.append(self.finding(entry, now, start, value if mean is None else mean))
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
                out.append(self.finding(entry, now, start, value if mean is None else mean, held))
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

    def finding(
        self, entry: tuple[Any, ...], now: float, since: float, mean: float, held: bool = False
    ) -> Finding:
        """The finding about subject ``entry`` at ``now`` (seconds, the snapshot's
        ``timestamp_s``) whose streak began at ``since`` (seconds); ``mean`` is the judged
        value (the window mean over ``for:``, in the metric's unit) and ``held`` says the
        subject fires only by hysteresis (past ``clear`` but not the threshold), which the
        message shows. ``entry`` is one of :class:`~gpuwatchd.windows.Windows`' entries of
        this detector's scope: ``(subject, by_metric, uuid, index)`` per GPU,
        ``(subject, by_metric, name)`` per job, ``(subject, by_metric)`` for the host.
        :meth:`evaluate` builds its findings here, and so does the columnar replay
        (gpuwatchd/detectors/arrays.py), so both give the same finding. Each subclass
        writes its own; this one raises NotImplementedError."""
        raise NotImplementedError


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
