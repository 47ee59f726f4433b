"""The policy engine: snapshots in, findings and decisions out (pure; no I/O, no wall clock).

Specification: docs/modules.md#gpuwatchdpolicyengine
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatchd.detectors import DETECTORS, Detector, EventFinding
from gpuwatchd.model import Decision, Finding, JobInfo, Knob, KnobValue, Snapshot
from gpuwatchd.policy.schema import Action, Policy, PolicySet
from gpuwatchd.windows import (
    DEFAULT_JOB_REPORT_STALE_S,
    DEFAULT_MAX_SAMPLES,
    MetricKey,
    Windows,
)

__all__ = [
    "LADDER_ACTIONS",
    "PolicyEngine",
    "StepResult",
    "compute_knob_value",
    "cooldown_targets",
]

DetectorKey = tuple[str, tuple[tuple[str, Any], ...]]
_PRUNE_EVERY_STEPS = 512
_ALWAYS_ON: tuple[tuple[str, Mapping[str, Any]], ...] = (("job_crashed", {"kind": ("any",)}),)
"""Detectors that run whatever the policies say: every worker death is a finding (and so
a journal event, ``gpuwatchctl events``), whether a policy acts on it or not."""
LADDER_ACTIONS = ("lower_parallelism", "raise_parallelism")
"""Actions that move a managed job's parallelism ladder."""
_EXEC_FIELDS = ("job", "gpu_index", "gpu_uuid", "policy", "subject")


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one :meth:`PolicyEngine.step` produced: every finding, and the decisions."""

    findings: tuple[Finding, ...]
    decisions: tuple[Decision, ...]


@dataclass(frozen=True, slots=True)
class _Compiled:
    policy: Policy
    keys: tuple[DetectorKey, ...]
    scopes: tuple[str, ...]
    narrated: bool
    """True when the policy has actions besides ``log`` (its logs narrate them)."""


@dataclass(slots=True)
class _Group:
    subject: str
    findings: list[Finding]
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    job: str | None = None


@dataclass(slots=True)
class _Firing:
    """One policy's decisions of one step, before they are accounted."""

    policy: Policy
    now: float
    mark: bool
    snapshot: Snapshot


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


def cooldown_targets(decision: Decision) -> tuple[str, ...]:
    """The targets whose cooldown ``decision`` starts (module doc, "Cooldown").

    ``log``: ``log:<subject>`` for each of ``params["subjects"]`` (the finding subjects
    when the params lack them); other actions: ``job:<job>``, ``gpu:<uuid>``,
    ``job:<job>@gpu:<uuid>`` or ``global`` from the decision's ``job``/``gpu_uuid``.
    Derived from the decision alone, so :meth:`PolicyEngine.restore` can use it.
    """
    if decision.action == "log":
        subjects = decision.params.get("subjects")
        if not isinstance(subjects, (list, tuple)):
            subjects = sorted({f.subject for f in decision.findings})
        return tuple("log:" + str(s) for s in subjects)
    return (_target(decision.job, decision.gpu_uuid),)


def _target(job: str | None, gpu: str | None) -> str:
    if job is not None and gpu is not None:
        return f"job:{job}@gpu:{gpu}"
    if job is not None:
        return "job:" + job
    if gpu is not None:
        return "gpu:" + gpu
    return "global"


def _uses_gpu(job: JobInfo, gpus: Sequence[tuple[str | None, int | None]]) -> bool:
    if not job.cuda_devices:
        return True  # no CUDA_VISIBLE_DEVICES: the job sees every GPU
    for uuid, index in gpus:
        for entry in job.cuda_devices:
            if index is not None and entry == str(index):
                return True
            if uuid is not None and (
                entry == uuid or (entry.startswith("GPU-") and uuid.startswith(entry))
            ):
                return True
    return False


def _reason(findings: Iterable[Finding]) -> str:
    return "; ".join(f.message for f in findings)


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


class PolicyEngine:
    """Turns snapshots into findings and decisions under a :class:`PolicySet`.

    ``dry_run`` marks every decision ``dry_run=True``; so does ``paused`` (settable).
    ``max_samples`` bounds each metric window; ``job_report_stale_s`` is how long an
    unchanged job report still counts; ``max_gap_s`` (None: off) breaks streaks after
    a longer pause between snapshots (e.g. 3 ticks). ``managed_jobs`` maps each managed
    job (config ``jobs:``) to ``(workers, min_workers)``: the top and the bottom of its
    parallelism ladder (ValueError if ``min_workers`` exceeds ``workers`` or is < 1).
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
        self._firings: dict[str, deque[float]] = {}
        self._ladder: dict[str, int] = {}
        self._managed: dict[str, tuple[int, int]] = {}
        self._last_t: float | None = None
        self._steps = 0
        self.set_managed_jobs(managed_jobs or {})
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

    @property
    def managed_jobs(self) -> Mapping[str, tuple[int, int]]:
        """Managed job name -> ``(workers, min_workers)``."""
        return dict(self._managed)

    def set_managed_jobs(self, managed_jobs: Mapping[str, tuple[int, int]]) -> None:
        """Replace the managed jobs (a config reload); ladder positions are kept.

        A kept position outside the job's new ``[min_workers, workers]`` is read clamped
        into it. Raises ValueError for ``min_workers < 1`` or ``min_workers > workers``.
        """
        managed: dict[str, tuple[int, int]] = {}
        for name, (workers, min_workers) in managed_jobs.items():
            if min_workers < 1 or min_workers > workers:
                raise ValueError(
                    f"managed job {name!r}: need 1 <= min_workers ({min_workers}) <= "
                    f"workers ({workers})"
                )
            managed[name] = (int(workers), int(min_workers))
        self._managed = managed

    def parallelism(self, job: str) -> int | None:
        """The ladder position (current worker count) of managed ``job``; None if unmanaged."""
        bounds = self._managed.get(job)
        if bounds is None:
            return None
        workers, min_workers = bounds
        return min(max(self._ladder.get(job, workers), min_workers), workers)

    def reload(self, policies: PolicySet) -> None:
        """Swap in ``policies`` atomically.

        Detectors whose name and params persist keep their state (no new warm-up);
        cooldowns and rate-limit history of policies whose name persists are kept;
        ladders are kept. Raises nothing for a validated :class:`PolicySet`; if building
        fails, the old state stays.
        """
        detectors: dict[DetectorKey, Detector] = {}
        compiled: list[_Compiled] = []
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
            narrated = any(a.action != "log" for a in policy.actions)
            compiled.append(_Compiled(policy, tuple(keys), tuple(scopes), narrated))
        for name, params in _ALWAYS_ON:
            key = _detector_key(name, params)
            if key not in detectors:
                detectors[key] = self._detectors.get(key) or DETECTORS[name](params)
        for detector in detectors.values():
            for metric_key, horizon_s in detector.needs().items():
                needs[metric_key] = max(horizon_s, needs.get(metric_key, 0.0))
        firings: dict[str, deque[float]] = {}
        for policy in policies.policies:
            if policy.limit is not None:
                firings[policy.name] = deque(
                    self._firings.get(policy.name, ()), maxlen=policy.limit.max
                )
        self._windows.configure(needs)
        self._detectors = detectors
        self._compiled = tuple(compiled)
        self._policies = policies
        self._firings = firings
        self._cooldown_s = {p.name: p.cooldown_s for p in policies.policies}
        self._last_action_s = {
            k: t for k, t in self._last_action_s.items() if k[0] in self._cooldown_s
        }

    def reset(self) -> None:
        """Forget every sample, streak, counter, cooldown, rate-limit history and ladder."""
        self._windows.clear()
        for detector in self._detectors.values():
            detector.reset()
        self._last_action_s.clear()
        for firings in self._firings.values():
            firings.clear()
        self._ladder.clear()
        self._last_t = None

    def record(self, decision: Decision) -> None:
        """Account one decision: start its cooldowns, count its firing, move its ladder.

        Applied by :meth:`step` to every decision it makes and by :meth:`restore`. A
        decision of a policy that is not loaded only moves its ladder.
        """
        name = decision.policy
        now = decision.timestamp_s
        cooldown_s = self._cooldown_s.get(name, 0.0)
        if cooldown_s > 0:
            last = self._last_action_s
            for target in cooldown_targets(decision):
                key = (name, target)
                previous = last.get(key)
                if previous is None or previous < now:
                    last[key] = now
        firings = self._firings.get(name)
        if firings is not None and (not firings or firings[-1] < now):
            firings.append(now)
        if decision.action in LADDER_ACTIONS and not decision.dry_run and decision.job:
            to = decision.params.get("to")
            if isinstance(to, int) and not isinstance(to, bool):
                self._ladder[decision.job] = to

    def restore(self, decisions: Iterable[Decision]) -> None:
        """Replay journaled ``decisions`` (oldest first) into cooldowns, limits and ladders.

        For a daemon restarted after a crash or ``SIGKILL``: it then neither repeats an
        action within its cooldown, nor exceeds a rate limit, nor forgets a ladder
        position. Call it after construction (or :meth:`reload`), before the first
        :meth:`step`. Detector streaks are not restored (module doc).
        """
        for decision in decisions:
            self.record(decision)

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

    def _limited(self, policy: Policy, now: float) -> bool:
        limit = policy.limit
        if limit is None:
            return False
        firings = self._firings.get(policy.name)
        return (
            firings is not None
            and len(firings) >= limit.max
            and now - firings[-limit.max] < limit.per_s
        )

    # -- groups -------------------------------------------------------------------------

    def _groups(
        self, compiled: _Compiled, by_key: Mapping[DetectorKey, list[Finding]], snap: Snapshot
    ) -> list[_Group]:
        per_condition = [by_key[k] for k in compiled.keys]
        scope = compiled.policy.scope
        if scope == "global":
            return [_Group("global", [f for fs in per_condition for f in fs])]
        jobs = snap.jobs
        groups: list[_Group] = []
        if scope == "gpu":
            candidates: dict[str, int | None] = {}
            if "gpu" in compiled.scopes:
                first = per_condition[compiled.scopes.index("gpu")]
                for f in first:
                    if f.gpu_uuid is not None:
                        candidates.setdefault(f.gpu_uuid, f.gpu_index)
            else:
                candidates = {g.uuid: g.index for g in snap.gpus}
            for uuid, index in candidates.items():
                matched = _match(per_condition, _concerns_gpu, uuid, index, jobs)
                if matched is not None:
                    groups.append(_Group("gpu:" + uuid, matched, uuid, index))
            return groups
        if "job" in compiled.scopes:
            first = per_condition[compiled.scopes.index("job")]
            names = _unique(f.job for f in first if f.job is not None)
        else:
            names = _unique(j.name for j in jobs)
        for name in names:
            matched = _match(per_condition, _concerns_job, name, None, jobs)
            if matched is not None:
                groups.append(_Group("job:" + name, matched, job=name))
        return groups

    # -- firing -------------------------------------------------------------------------

    def _fire(
        self,
        compiled: _Compiled,
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
        groups = self._groups(compiled, by_key, snapshot)
        if not groups:
            return
        firing = _Firing(policy, now, self.dry_run or self.paused or policy.dry_run, snapshot)
        acted = False
        per_action: list[list[Decision]] = []
        for action in policy.actions:
            made: list[Decision] = []
            name = action.action
            if name == "set_knob":
                self._set_knob(firing, action, groups, made)
            elif name in LADDER_ACTIONS:
                self._ladder_move(firing, action, groups, made)
            elif name == "place_on_idle_gpu":
                self._place(firing, action, groups, made)
            elif name in ("restart_worker", "restart_study"):
                self._restart(firing, action, groups, made)
            elif name == "exec":
                self._exec(firing, action, groups, made)
            acted = acted or bool(made)
            per_action.append(made)
        if compiled.narrated and not acted:
            return
        decided: list[Decision] = []
        for action, made in zip(policy.actions, per_action, strict=True):
            if action.action == "log":
                self._log(firing, action, groups, made)
            decided.extend(made)
        for decision in decided:
            self.record(decision)
        out.extend(decided)

    def _decision(
        self,
        firing: _Firing,
        action: str,
        params: dict[str, object],
        findings: Sequence[Finding],
        *,
        job: str | None = None,
        gpu_uuid: str | None = None,
    ) -> Decision:
        found = tuple(findings)
        return Decision(
            policy=firing.policy.name,
            action=action,
            params=params,
            timestamp_s=firing.now,
            findings=found,
            job=job,
            gpu_uuid=gpu_uuid,
            dry_run=firing.mark,
            reason=_reason(found),
        )

    def _log(
        self, firing: _Firing, action: Action, groups: list[_Group], made: list[Decision]
    ) -> None:
        policy, now = firing.policy, firing.now
        findings = _unique_findings(f for g in groups for f in g.findings)
        subjects = sorted({f.subject for f in findings})
        news = [s for s in subjects if not self._cooling(policy, "log:" + s, now)]
        if not news:
            return
        jobs = {f.job for f in findings if f.job is not None}
        gpus = {f.gpu_uuid for f in findings if f.gpu_uuid is not None}
        reason = _reason(findings)
        params: dict[str, object] = {
            "message": action.params.get("message") or reason,
            "level": action.params.get("level", "info"),
            "subjects": news,
        }
        made.append(
            self._decision(
                firing,
                "log",
                params,
                findings,
                job=next(iter(jobs)) if len(jobs) == 1 else None,
                gpu_uuid=next(iter(gpus)) if len(gpus) == 1 else None,
            )
        )

    def _knob_targets(
        self, params: Mapping[str, Any], findings: Sequence[Finding], snapshot: Snapshot
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
        self, firing: _Firing, action: Action, groups: list[_Group], made: list[Decision]
    ) -> None:
        params = action.params
        name = params["knob"]
        seen: set[str] = set()
        for group in groups:
            for job in self._knob_targets(params, group.findings, firing.snapshot):
                target = "job:" + job.name
                if target in seen or self._cooling(firing.policy, target, firing.now):
                    continue
                knob = job.knobs[name]
                new = compute_knob_value(knob, params)
                if new is None or new == knob.value:
                    continue
                seen.add(target)
                relevant = [f for f in group.findings if f.job is None or f.job == job.name]
                made.append(
                    self._decision(
                        firing,
                        "set_knob",
                        {"knob": name, "value": new, "previous": knob.value},
                        relevant,
                        job=job.name,
                    )
                )

    def _concerned_managed(self, group: _Group, snapshot: Snapshot) -> list[str]:
        """Managed jobs the group is about (module doc, ``lower_parallelism``)."""
        managed = self._managed
        if not managed:
            return []
        if group.job is not None:
            return [group.job] if group.job in managed else []
        named = _unique(f.job for f in group.findings if f.job is not None)
        if named:
            return [n for n in named if n in managed]
        gpus = [(f.gpu_uuid, f.gpu_index) for f in group.findings if f.gpu_uuid is not None]
        if group.gpu_uuid is not None:
            gpus.append((group.gpu_uuid, group.gpu_index))
        if gpus:
            return _unique(
                j.name for j in snapshot.jobs if j.name in managed and _uses_gpu(j, gpus)
            )
        return list(managed)

    def _ladder_move(
        self, firing: _Firing, action: Action, groups: list[_Group], made: list[Decision]
    ) -> None:
        params = action.params
        lower = action.action == "lower_parallelism"
        only = params.get("job")
        targets: dict[str, list[Finding]] = {}
        for group in groups:
            names = [only] if only is not None else self._concerned_managed(group, firing.snapshot)
            for name in names:
                if name in self._managed:
                    targets.setdefault(name, []).extend(group.findings)
        for name, findings in targets.items():
            if self._cooling(firing.policy, "job:" + name, firing.now):
                continue
            workers, min_workers = self._managed[name]
            floor = max(int(params.get("floor", min_workers)), min_workers)
            ceiling = min(int(params.get("ceiling", workers)), workers)
            current = self.parallelism(name)
            assert current is not None
            step = int(params.get("step", 1))
            if lower:
                to = max(current - step, floor)
                if to >= current:
                    continue
                mode = str(params.get("mode", "drain"))
            else:
                to = min(current + step, ceiling)
                if to <= current:
                    continue
                mode = "now"
            made.append(
                self._decision(
                    firing,
                    action.action,
                    {"job": name, "from": current, "to": to, "mode": mode},
                    _unique_findings(findings),
                    job=name,
                )
            )

    def _place(
        self, firing: _Firing, action: Action, groups: list[_Group], made: list[Decision]
    ) -> None:
        only = action.params.get("job")
        names = [only] if only is not None else list(self._managed)
        for group in groups:
            uuid = group.gpu_uuid
            if uuid is None:
                continue
            for name in names:
                if name not in self._managed:
                    continue
                if self._cooling(firing.policy, _target(name, uuid), firing.now):
                    continue
                made.append(
                    self._decision(
                        firing,
                        "place_on_idle_gpu",
                        {"job": name, "gpu_index": group.gpu_index, "gpu_uuid": uuid},
                        group.findings,
                        job=name,
                        gpu_uuid=uuid,
                    )
                )

    def _restart(
        self, firing: _Firing, action: Action, groups: list[_Group], made: list[Decision]
    ) -> None:
        seen: set[int] = set()
        for group in groups:
            for finding in group.findings:
                if not isinstance(finding, EventFinding) or finding.detector != "job_crashed":
                    continue
                event = finding.event
                if event is None or id(finding) in seen or event.job not in self._managed:
                    continue
                seen.add(id(finding))
                if self._cooling(firing.policy, "job:" + event.job, firing.now):
                    continue
                params: dict[str, object] = {
                    "job": event.job,
                    "pid": event.pid,
                    "crash_kind": event.crash_kind or "other",
                    "gpu_index": event.gpu_index,
                    "trial_number": event.trial_number,
                }
                if action.action == "restart_study":
                    params["max_retries"] = action.params.get("max_retries", 3)
                made.append(self._decision(firing, action.action, params, [finding], job=event.job))

    def _exec(
        self, firing: _Firing, action: Action, groups: list[_Group], made: list[Decision]
    ) -> None:
        argv: tuple[str, ...] = tuple(action.params["argv"])
        timeout_s = float(action.params.get("timeout", 30.0))
        for group in groups:
            job = group.job
            gpu = group.gpu_uuid
            if self._cooling(firing.policy, _target(job, gpu), firing.now):
                continue
            values = {
                "job": job or "",
                "gpu_index": "" if group.gpu_index is None else str(group.gpu_index),
                "gpu_uuid": gpu or "",
                "policy": firing.policy.name,
                "subject": group.subject,
            }
            made.append(
                self._decision(
                    firing,
                    "exec",
                    {"argv": [_substitute(a, values) for a in argv], "timeout_s": timeout_s},
                    group.findings,
                    job=job,
                    gpu_uuid=gpu,
                )
            )


def _match(
    per_condition: list[list[Finding]],
    concerns: Callable[[Finding, str, int | None, Sequence[JobInfo]], bool],
    subject: str,
    index: int | None,
    jobs: Sequence[JobInfo],
) -> list[Finding] | None:
    """The findings concerning ``subject``, or None if some condition has none."""
    matched: list[Finding] = []
    for findings in per_condition:
        chosen = [f for f in findings if concerns(f, subject, index, jobs)]
        if not chosen:
            return None
        matched.extend(chosen)
    return matched


def _substitute(arg: str, values: Mapping[str, str]) -> str:
    for name in _EXEC_FIELDS:
        token = "{" + name + "}"
        if token in arg:
            arg = arg.replace(token, values[name])
    return arg


def _unique_findings(findings: Iterable[Finding]) -> list[Finding]:
    seen: set[int] = set()
    out: list[Finding] = []
    for f in findings:
        if id(f) not in seen:
            seen.add(id(f))
            out.append(f)
    return out


def _job_uses(jobs: Sequence[JobInfo], name: str, uuid: str | None, index: int | None) -> bool:
    return any(j.name == name and _uses_gpu(j, ((uuid, index),)) for j in jobs)


def _concerns_gpu(f: Finding, uuid: str, index: int | None, jobs: Sequence[JobInfo]) -> bool:
    if f.gpu_uuid is not None:
        return f.gpu_uuid == uuid
    if f.job is not None:
        if f.gpu_index is not None:
            return f.gpu_index == index
        return _job_uses(jobs, f.job, uuid, index)
    return True  # host findings concern every GPU


def _concerns_job(f: Finding, name: str, _index: int | None, jobs: Sequence[JobInfo]) -> bool:
    if f.job is not None:
        return f.job == name
    if f.gpu_uuid is not None:
        return _job_uses(jobs, name, f.gpu_uuid, f.gpu_index)
    return True  # host findings concern every job
