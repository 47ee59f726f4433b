"""The policy engine: snapshots in, findings and decisions out (pure; no I/O, no wall clock).

:meth:`PolicyEngine.step` takes one :class:`~gpuwatchd.model.Snapshot` and

1. feeds the windows the loaded detectors read (:mod:`gpuwatchd.windows`);
2. evaluates every detector once (identical conditions of several policies share
   one detector) and collects its :class:`~gpuwatchd.model.Finding` objects;
3. for each policy whose conditions *all* have findings, turns its ``do:`` list into
   :class:`~gpuwatchd.model.Decision` objects.

Time is ``snapshot.timestamp_s``. Actions:

* ``log`` -> one decision per firing, ``params = {"message", "level"}``; the
  message defaults to the findings' messages joined with ``"; "``.
* ``set_knob`` -> one decision per target job with ``params = {"knob", "value",
  "previous"}``. Targets, among the snapshot's jobs that declare the knob: the
  action's ``job`` if given; else the jobs named by the findings (``data_starved``);
  else, for GPU findings, the jobs whose ``cuda_devices`` (``CUDA_VISIBLE_DEVICES``
  entries: NVML index or ``GPU-<uuid>`` prefix; empty = every GPU) include a GPU of
  the findings; else (host findings) every such job. The new value is ``value``,
  ``current * factor`` or ``current + step``; for an int knob it is rounded half up,
  and a ``factor`` other than 1 moves it by at least 1 (so ``0 * 2`` becomes 1 and
  the knob does not stick at 0). It is clamped to the action's ``min``/``max`` and
  then to the knob's own bounds (the job's word wins). No decision when the new
  value equals the current one, or when a bool knob meets ``factor``/``step``.

Cooldown: after a decision, the same policy does not act on the same target again
for ``cooldown_s`` seconds. Targets: ``job:<name>`` for ``set_knob``; for ``log``
each finding subject (``gpu:<uuid>``, ``host``, ``job:<name>``): a log is written
when at least one of its subjects is not cooling down, so a GPU that joins an
ongoing finding is logged at once, and one that leaves does not repeat the log.

Decisions are still produced, marked ``dry_run=True``, when the engine is in
dry-run mode, is ``paused`` (``gpuwatchctl pause``: detection goes on, remediation
stops), or the policy says ``dry_run``; the actuator then only logs them. They
start the cooldown too.

A snapshot older than the previous one (clock stepped back) or, with
``max_gap_s``, more than ``max_gap_s`` after it (the daemon was stopped or the
host suspended) resets every streak: unseen time is not evidence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatchd.detectors import DETECTORS, Detector
from gpuwatchd.model import Decision, Finding, JobInfo, Knob, KnobValue, Snapshot
from gpuwatchd.policy.schema import Action, Policy, PolicySet
from gpuwatchd.windows import (
    DEFAULT_JOB_REPORT_STALE_S,
    DEFAULT_MAX_SAMPLES,
    MetricKey,
    Windows,
)

__all__ = ["PolicyEngine", "StepResult", "compute_knob_value"]

DetectorKey = tuple[str, tuple[tuple[str, Any], ...]]
_PRUNE_EVERY_STEPS = 512


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one :meth:`PolicyEngine.step` produced: every finding, and the decisions."""

    findings: tuple[Finding, ...]
    decisions: tuple[Decision, ...]


@dataclass(frozen=True, slots=True)
class _Compiled:
    policy: Policy
    keys: tuple[DetectorKey, ...]


def _detector_key(detector: str, params: Mapping[str, Any]) -> DetectorKey:
    return detector, tuple(sorted(params.items()))


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


def compute_knob_value(knob: Knob, params: Mapping[str, Any]) -> KnobValue | None:
    """The value ``set_knob`` with ``params`` gives ``knob``, or None when not applicable.

    ``params`` has one of ``value``/``factor``/``step`` and optional ``min``/``max``
    (see the module doc for rounding and clamping). None for a bool knob with
    ``factor``/``step``, or a bool ``value`` for a numeric knob and vice versa.
    """
    current = knob.value
    if "value" in params:
        new: Any = params["value"]
        if isinstance(current, bool) or isinstance(new, bool):
            return new if isinstance(current, bool) and isinstance(new, bool) else None
    elif isinstance(current, bool):
        return None
    elif "factor" in params:
        factor = float(params["factor"])
        new = current * factor
        if isinstance(current, int):
            new = _round_half_up(new)
            if new == current and factor != 1.0:
                new = current + (1 if factor > 1.0 else -1)
    else:
        new = current + params["step"]
    is_int = isinstance(current, int)
    for low in (params.get("min"), knob.min):
        if low is not None and not isinstance(low, bool):
            low = math.ceil(low) if is_int else low
            new = max(new, low)
    for high in (params.get("max"), knob.max):
        if high is not None and not isinstance(high, bool):
            high = math.floor(high) if is_int else high
            new = min(new, high)
    if is_int:
        return _round_half_up(new)
    return float(new)


def _uses_gpu(job: JobInfo, gpus: Sequence[tuple[str, int | None]]) -> bool:
    if not job.cuda_devices:
        return True  # no CUDA_VISIBLE_DEVICES: the job sees every GPU
    for uuid, index in gpus:
        for entry in job.cuda_devices:
            if entry == uuid or (index is not None and entry == str(index)):
                return True
            if entry.startswith("GPU-") and uuid.startswith(entry):
                return True
    return False


class PolicyEngine:
    """Turns snapshots into findings and decisions under a :class:`PolicySet`.

    ``dry_run`` marks every decision ``dry_run=True``; so does ``paused`` (settable).
    ``max_samples`` bounds each metric window; ``job_report_stale_s`` is how long an
    unchanged job report still counts; ``max_gap_s`` (None: off) resets streaks after
    a longer pause between snapshots (e.g. 3 ticks).
    """

    def __init__(
        self,
        policies: PolicySet,
        *,
        dry_run: bool = False,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        job_report_stale_s: float = DEFAULT_JOB_REPORT_STALE_S,
        max_gap_s: float | None = None,
    ) -> None:
        self.dry_run = dry_run
        self.paused = False
        self.max_gap_s = max_gap_s
        self._windows = Windows(max_samples=max_samples, job_report_stale_s=job_report_stale_s)
        self._detectors: dict[DetectorKey, Detector] = {}
        self._compiled: tuple[_Compiled, ...] = ()
        self._policies = PolicySet()
        self._cooldown_s: dict[str, float] = {}
        self._last_action_s: dict[tuple[str, str], float] = {}
        self._last_t: float | None = None
        self._steps = 0
        self.reload(policies)

    @property
    def policies(self) -> PolicySet:
        """The policies in force."""
        return self._policies

    @property
    def windows(self) -> Windows:
        """The metric windows (read-only use: status, debugging)."""
        return self._windows

    @property
    def detectors(self) -> Mapping[DetectorKey, Detector]:
        """The detector instances, keyed by ``(name, sorted params)``."""
        return dict(self._detectors)

    def reload(self, policies: PolicySet) -> None:
        """Swap in ``policies`` atomically.

        Detectors whose name and params persist keep their streaks (no new warm-up);
        cooldowns of policies whose name persists are kept. Raises nothing for a
        validated :class:`PolicySet`; if building fails, the old state stays.
        """
        detectors: dict[DetectorKey, Detector] = {}
        compiled: list[_Compiled] = []
        needs: dict[MetricKey, float] = {}
        for policy in policies.policies:
            keys = []
            for condition in policy.conditions:
                key = _detector_key(condition.detector, condition.params)
                if key not in detectors:
                    old = self._detectors.get(key)
                    detectors[key] = old or DETECTORS[condition.detector](condition.params)
                keys.append(key)
            compiled.append(_Compiled(policy, tuple(keys)))
        for detector in detectors.values():
            for metric_key, horizon_s in detector.needs().items():
                needs[metric_key] = max(horizon_s, needs.get(metric_key, 0.0))
        self._windows.configure(needs)
        self._detectors = detectors
        self._compiled = tuple(compiled)
        self._policies = policies
        self._cooldown_s = {p.name: p.cooldown_s for p in policies.policies}
        self._last_action_s = {
            k: t for k, t in self._last_action_s.items() if k[0] in self._cooldown_s
        }

    def reset(self) -> None:
        """Forget every sample, streak and cooldown (a fresh start with the same policies)."""
        self._windows.clear()
        for detector in self._detectors.values():
            detector.reset()
        self._last_action_s.clear()
        self._last_t = None

    def step(self, snapshot: Snapshot) -> StepResult:
        """Process one tick's ``snapshot``; return its findings and decisions."""
        now = snapshot.timestamp_s
        last = self._last_t
        if last is not None and (
            now < last or (self.max_gap_s is not None and now - last > self.max_gap_s)
        ):
            for detector in self._detectors.values():
                detector.reset()
        self._last_t = now
        windows = self._windows
        windows.observe(snapshot)
        findings: list[Finding] = []
        by_key: dict[DetectorKey, list[Finding]] = {}
        for key, detector in self._detectors.items():
            found = detector.evaluate(windows)
            if found:
                by_key[key] = found
                findings.extend(found)
        decisions: list[Decision] = []
        if by_key:
            for compiled in self._compiled:
                keys = compiled.keys
                if all(k in by_key for k in keys):
                    matched = tuple(f for k in keys for f in by_key[k])
                    self._decide(compiled.policy, matched, snapshot, now, decisions)
        self._steps += 1
        if self._steps % _PRUNE_EVERY_STEPS == 0:
            self._prune_cooldowns(now)
        return StepResult(tuple(findings), tuple(decisions))

    def _prune_cooldowns(self, now: float) -> None:
        cooldown = self._cooldown_s
        self._last_action_s = {
            k: t for k, t in self._last_action_s.items() if now - t < cooldown.get(k[0], 0.0)
        }

    def _cooling(self, policy: Policy, target: str, now: float) -> bool:
        if policy.cooldown_s <= 0:
            return False
        last = self._last_action_s.get((policy.name, target))
        return last is not None and now - last < policy.cooldown_s

    def _started(self, policy: Policy, target: str, now: float) -> None:
        if policy.cooldown_s > 0:
            self._last_action_s[policy.name, target] = now

    def _decide(
        self,
        policy: Policy,
        findings: tuple[Finding, ...],
        snapshot: Snapshot,
        now: float,
        out: list[Decision],
    ) -> None:
        mark = self.dry_run or self.paused or policy.dry_run
        reason = "; ".join(f.message for f in findings)
        for action in policy.actions:
            if action.action == "log":
                self._log(policy, action, findings, now, mark, reason, out)
            elif action.action == "set_knob":
                self._set_knob(policy, action, findings, snapshot, now, mark, out)

    def _log(
        self,
        policy: Policy,
        action: Action,
        findings: tuple[Finding, ...],
        now: float,
        mark: bool,
        reason: str,
        out: list[Decision],
    ) -> None:
        targets = ["log:" + s for s in sorted({f.subject for f in findings})]
        if all(self._cooling(policy, target, now) for target in targets):
            return
        jobs = {f.job for f in findings if f.job is not None}
        gpus = {f.gpu_uuid for f in findings if f.gpu_uuid is not None}
        params = {
            "message": action.params.get("message") or reason,
            "level": action.params.get("level", "info"),
        }
        out.append(
            Decision(
                policy=policy.name,
                action="log",
                params=params,
                timestamp_s=now,
                findings=findings,
                job=next(iter(jobs)) if len(jobs) == 1 else None,
                gpu_uuid=next(iter(gpus)) if len(gpus) == 1 else None,
                dry_run=mark,
                reason=reason,
            )
        )
        for target in targets:
            self._started(policy, target, now)

    def _targets(
        self, params: Mapping[str, Any], findings: tuple[Finding, ...], snapshot: Snapshot
    ) -> list[JobInfo]:
        knob = params["knob"]
        jobs = [j for j in snapshot.jobs if knob in j.knobs]
        only = params.get("job")
        if only is not None:
            return [j for j in jobs if j.name == only]
        named = {f.job for f in findings if f.job is not None}
        if named:
            return [j for j in jobs if j.name in named]
        gpus = [(f.gpu_uuid, f.gpu_index) for f in findings if f.gpu_uuid is not None]
        if gpus:
            return [j for j in jobs if _uses_gpu(j, gpus)]
        return jobs

    def _set_knob(
        self,
        policy: Policy,
        action: Action,
        findings: tuple[Finding, ...],
        snapshot: Snapshot,
        now: float,
        mark: bool,
        out: list[Decision],
    ) -> None:
        params = action.params
        name = params["knob"]
        for job in self._targets(params, findings, snapshot):
            target = "job:" + job.name
            if self._cooling(policy, target, now):
                continue
            knob = job.knobs[name]
            new = compute_knob_value(knob, params)
            if new is None or new == knob.value:
                continue
            relevant = tuple(f for f in findings if f.job is None or f.job == job.name)
            out.append(
                Decision(
                    policy=policy.name,
                    action="set_knob",
                    params={"knob": name, "value": new, "previous": knob.value},
                    timestamp_s=now,
                    findings=relevant,
                    job=job.name,
                    dry_run=mark,
                    reason="; ".join(f.message for f in relevant),
                )
            )
            self._started(policy, target, now)
