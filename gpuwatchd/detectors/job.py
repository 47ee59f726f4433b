"""Job detectors: ``data_starved`` (hook reports), ``job_crashed`` and
``trials_succeeded_in_row`` (job events) (pure).

Specification: docs/modules.md#gpuwatchddetectors
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

from gpuwatchd.crash import CRASH_KINDS
from gpuwatchd.detectors.base import EventDetector, ThresholdDetector
from gpuwatchd.detectors.params import ParamSpec, clear_param, for_param
from gpuwatchd.model import Finding, JobEvent
from gpuwatchd.units import (
    parse_fraction,
)
from gpuwatchd.windows import Scope, Windows

_SUCCESS_STATES: Final = frozenset({"COMPLETE", "PRUNED"})
"""Optuna ``TrialState`` names that count as a clean trial for ``trials_succeeded_in_row``."""
_MAX_TRIAL_COUNTERS: Final = 4096
"""Jobs whose clean-trial count is kept at most (bounds memory against endless job names)."""


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


class DataStarved(ThresholdDetector):
    """A job's data-loader wait fraction (the hook's ``data_wait_fraction``: time in the
    DataLoader's ``next()`` / step time) above ``fraction``, per attached job. A job that
    has not reported yet, or whose report went stale, does not match. Default: 0.5 for 1 min.
    """

    name = "data_starved"
    scope: ClassVar[Scope] = "job"
    description = "a job's DataLoader wait fraction (hook report) above a fraction"
    default_metric = "data_wait_fraction"
    threshold_param = "fraction"
    params = (
        ParamSpec(
            "fraction",
            parse_fraction,
            default=0.5,
            unit="fraction",
            help="data-wait fraction threshold (0..1)",
        ),
        clear_param(above=True, unit="fraction"),
        for_param("1m"),
    )

    def _level_text(self, level: float) -> str:
        return f"{level:g}"

    def finding(
        self, entry: tuple[Any, ...], now: float, since: float, mean: float, held: bool = False
    ) -> Finding:
        """:meth:`ThresholdDetector.finding` for job ``entry`` (``(subject, by_metric,
        name)``): its data-wait fraction (0..1) against the rule."""
        subject, _, job = entry
        message = f"job {job} data-wait fraction {mean:.2f} {self._rule_text(held)}"
        return Finding(
            self.name, subject, now, since, mean, self.threshold, message, None, None, job
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
    ``environment``: a read-only directory, a missing file or module; ``optuna_error``:
    Optuna's own error, e.g. ``Cannot tell a COMPLETE trial.`` or
    ``StorageInternalError``; ``other``; ``any``: all of them; a list matches any of its
    kinds; a missing or unknown crash kind counts as ``other``) gives one finding, once,
    on the tick the event arrives. Subject ``job:<name>``; ``gpu_index`` from the event; the message
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
                "crash kinds to match: cuda_assert, cuda_oom, host_oom, environment, "
                "optuna_error, other or any"
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
