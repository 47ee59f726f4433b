"""The policy engine: snapshots in, findings and decisions out (pure; no I/O, no wall clock).

Specification: docs/modules.md#gpuwatchdpolicyengine
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatchd.detectors import DETECTORS, Detector
from gpuwatchd.model import Decision, Finding, Snapshot
from gpuwatchd.policy.accounting import Accounting, cooldown_targets
from gpuwatchd.policy.actions import ACTIONS, LADDER_ACTIONS, tune_loader
from gpuwatchd.policy.actions.set_knob import compute_knob_value
from gpuwatchd.policy.decisions import PolicyFiring
from gpuwatchd.policy.grouping import group_findings
from gpuwatchd.policy.holds import KnobHolds
from gpuwatchd.policy.schema import Policy, PolicySet
from gpuwatchd.policy.tuner import LoaderTuner
from gpuwatchd.windows import (
    DEFAULT_JOB_REPORT_STALE_S,
    DEFAULT_MAX_SAMPLES,
    MetricKey,
    Windows,
)

__all__ = [
    "LADDER_ACTIONS",
    "CompiledPolicy",
    "DetectorKey",
    "PolicyEngine",
    "StepResult",
    "compute_knob_value",
    "cooldown_targets",
]

DetectorKey = tuple[str, tuple[tuple[str, Any], ...]]
"""A detector instance's identity: ``(name, sorted (param, value) pairs)``."""
_PRUNE_EVERY_STEPS = 512
_ALWAYS_ON: tuple[tuple[str, Mapping[str, Any]], ...] = (("job_crashed", {"kind": ("any",)}),)
"""Detectors that run whatever the policies say: every worker death is a finding (and so
a journal event, ``gpuwatchctl events``), whether a policy acts on it or not."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one :meth:`PolicyEngine.step` produced: every finding, and the decisions."""

    findings: tuple[Finding, ...]
    decisions: tuple[Decision, ...]


@dataclass(frozen=True, slots=True)
class CompiledPolicy:
    """A loaded policy with the keys of its conditions' detectors (in ``when:`` order).

    ``keys[i]`` is the :data:`DetectorKey` of condition ``i``, ``scopes[i]`` its scope;
    what :meth:`PolicyEngine.fire` takes (the array backtest, gpuwatchd/backtest_arrays.py,
    runs it at the frames where the policy can decide).
    """

    policy: Policy
    keys: tuple[DetectorKey, ...]
    scopes: tuple[str, ...]
    narrated: bool
    """True when the policy has actions besides narrating ones (``log``: it narrates them)."""


def _detector_key(detector: str, params: Mapping[str, Any]) -> DetectorKey:
    return detector, tuple(sorted(params.items()))


class PolicyEngine(Accounting):
    """Turns snapshots into findings and decisions under a :class:`PolicySet`.

    ``dry_run`` marks every decision ``dry_run=True``; so does ``paused`` (settable).
    ``max_samples`` bounds each metric window; ``job_report_stale_s`` is how long an
    unchanged job report still counts; ``max_gap_s`` (None: off) breaks streaks after
    a longer pause between snapshots (e.g. 3 ticks). ``managed_jobs`` maps each managed
    job (config ``jobs:``) to ``(workers, min_workers)``: the top and the bottom of its
    parallelism ladder (ValueError if ``min_workers`` exceeds ``workers`` or is < 1).
    ``knob_holds`` (the daemon's operator overrides) keep ``tune_loader`` off held knobs.
    """

    def __init__(
        self,
        policies: PolicySet,
        *,
        dry_run: bool = False,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        job_report_stale_s: float = DEFAULT_JOB_REPORT_STALE_S,
        max_gap_s: float | None = None,
        managed_jobs: Mapping[str, tuple[int, int]] | None = None,
        knob_holds: KnobHolds | None = None,
    ) -> None:
        super().__init__(managed_jobs)
        self.dry_run = dry_run
        self.paused = False
        self.max_gap_s = max_gap_s
        self._windows = Windows(max_samples=max_samples, job_report_stale_s=job_report_stale_s)
        self._detectors: dict[DetectorKey, Detector] = {}
        self._compiled: tuple[CompiledPolicy, ...] = ()
        self._policies = PolicySet()
        self._last_t: float | None = None
        self._steps = 0
        self._tuner = LoaderTuner(knob_holds)
        self.reload(policies)

    @property
    def tuner(self) -> LoaderTuner:
        """The host's one :class:`~gpuwatchd.policy.tuner.LoaderTuner` (``tune_loader``)."""
        return self._tuner

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

    @property
    def compiled(self) -> tuple[CompiledPolicy, ...]:
        """The loaded policies, in file order, with their detectors' keys."""
        return self._compiled

    def fire(
        self,
        compiled: CompiledPolicy,
        by_key: Mapping[DetectorKey, list[Finding]],
        snapshot: Snapshot,
        now: float,
    ) -> list[Decision]:
        """The decisions :meth:`step` makes for one policy at ``now``, given each of its
        conditions' findings (``by_key``: every key of ``compiled.keys``), accounted as
        :meth:`step` accounts them (cooldowns, rate limit). For callers that know which
        frames can decide (the array backtest); raises KeyError for a missing key."""
        out: list[Decision] = []
        self._fire(compiled, by_key, snapshot, now, out)
        return out

    def reload(self, policies: PolicySet) -> None:
        """Swap in ``policies`` atomically.

        Detectors whose name and params persist keep their state (no new warm-up);
        cooldowns and rate-limit history of policies whose name persists are kept;
        ladders are kept. Raises nothing for a validated :class:`PolicySet`; if building
        fails, the old state stays.
        """
        detectors: dict[DetectorKey, Detector] = {}
        compiled: list[CompiledPolicy] = []
        needs: dict[MetricKey, float] = {}
        for policy in policies.policies:
            keys = []
            scopes = []
            for condition in policy.conditions:
                key = _detector_key(condition.detector, condition.params)
                if key not in detectors:
                    old = self._detectors.get(key)
                    detectors[key] = old or DETECTORS[condition.detector](condition.params)
                keys.append(key)
                scopes.append(DETECTORS[condition.detector].scope)
            narrated = any(not ACTIONS[a.action].narrates for a in policy.actions)
            compiled.append(CompiledPolicy(policy, tuple(keys), tuple(scopes), narrated))
        for name, params in _ALWAYS_ON:
            key = _detector_key(name, params)
            if key not in detectors:
                detectors[key] = self._detectors.get(key) or DETECTORS[name](params)
        for detector in detectors.values():
            for metric_key, horizon_s in detector.needs().items():
                needs[metric_key] = max(horizon_s, needs.get(metric_key, 0.0))
        self._windows.configure(needs)
        self._detectors = detectors
        self._compiled = tuple(compiled)
        self._policies = policies
        self._account_policies(policies)

    def reset(self) -> None:
        """Forget every sample, streak, counter, cooldown, rate-limit history and ladder."""
        self._windows.clear()
        for detector in self._detectors.values():
            detector.reset()
        self._forget_accounting()
        self._tuner.reset()
        self._last_t = None

    def step(self, snapshot: Snapshot) -> StepResult:
        """Process one tick's ``snapshot``; return its findings and decisions."""
        now = snapshot.timestamp_s
        last = self._last_t
        if last is not None and (
            now < last or (self.max_gap_s is not None and now - last > self.max_gap_s)
        ):
            for detector in self._detectors.values():
                detector.on_gap()
        self._last_t = now
        windows = self._windows
        windows.observe(snapshot)
        findings: list[Finding] = []
        by_key: dict[DetectorKey, list[Finding]] = {}
        seen: set[tuple[str, str, str]] = set()
        for key, detector in self._detectors.items():
            found = detector.evaluate(windows)
            if found:
                by_key[key] = found
                for finding in found:  # one crash, one finding (however many detectors)
                    ident = (finding.detector, finding.subject, finding.message)
                    if ident not in seen:
                        seen.add(ident)
                        findings.append(finding)
        decisions: list[Decision] = []
        if by_key:
            for compiled in self._compiled:
                keys = compiled.keys
                if keys[0] in by_key and (len(keys) == 1 or all(k in by_key for k in keys)):
                    self._fire(compiled, by_key, snapshot, now, decisions)
        paused = self.dry_run or self.paused
        for step in self._tuner.step(snapshot):  # not accounted: the tuner paces itself
            decisions.append(tune_loader.decision_of(step, now, paused))
        self._steps += 1
        if self._steps % _PRUNE_EVERY_STEPS == 0:
            self._prune_cooldowns(now)
        return StepResult(tuple(findings), tuple(decisions))

    def _fire(
        self,
        compiled: CompiledPolicy,
        by_key: Mapping[DetectorKey, list[Finding]],
        snapshot: Snapshot,
        now: float,
        out: list[Decision],
    ) -> None:
        policy = compiled.policy
        if self._limited(policy, now):
            return
        if not compiled.narrated and policy.cooldown_s > 0:
            # a log-only policy whose every subject is cooling down: skip forming groups
            last, cooldown_s = self._last_action_s, policy.cooldown_s
            name = policy.name
            if all(
                now - last.get((name, "log:" + f.subject), -math.inf) < cooldown_s
                for k in compiled.keys
                for f in by_key[k]
            ):
                return
        groups = group_findings(
            policy.scope, [by_key[k] for k in compiled.keys], compiled.scopes, snapshot
        )
        if not groups:
            return
        mark = self.dry_run or self.paused or policy.dry_run
        firing = PolicyFiring(self, policy, now, mark, snapshot, self._tuner)
        acted = False
        per_action: list[list[Decision]] = []
        for action in policy.actions:
            spec = ACTIONS[action.action]
            made = [] if spec.narrates else spec.decide(firing, action.params, groups)
            acted = acted or bool(made)
            per_action.append(made)
        if compiled.narrated and not acted:
            return
        decided: list[Decision] = []
        for action, made in zip(policy.actions, per_action, strict=True):
            spec = ACTIONS[action.action]
            if spec.narrates:  # decided last: it narrates what the others decided
                made = spec.decide(firing, action.params, groups)
            decided.extend(made)
        for decision in decided:
            self.record(decision)
        out.extend(decided)
