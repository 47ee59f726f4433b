"""Policy actions: turning one firing policy's groups into decisions, per action (pure).

Specification: docs/modules.md#gpuwatchdpolicyengine ("Actions").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatchd.detectors import EventFinding
from gpuwatchd.model import Decision, Finding, JobInfo, Knob, KnobValue, Snapshot
from gpuwatchd.policy.accounting import Accounting, target_key
from gpuwatchd.policy.grouping import FindingGroup, unique_in_order, uses_gpu
from gpuwatchd.policy.schema import Action, Policy

_EXEC_FIELDS = ("job", "gpu_index", "gpu_uuid", "policy", "subject")


@dataclass(slots=True)
class Firing:
    """One policy's decisions of one step, before they are accounted."""

    policy: Policy
    now: float
    mark: bool
    snapshot: Snapshot


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


def compute_knob_value(knob: Knob, params: Mapping[str, Any]) -> KnobValue | None:
    """The value ``set_knob`` with ``params`` gives ``knob``, or None when not applicable.

    ``params`` has one of ``value``/``factor``/``step`` and optional ``min``/``max``
    (see docs/modules.md for rounding and clamping). A cut (``factor`` < 1, ``step`` < 0)
    never raises the value and a raise never lowers it: where a bound lies beyond the
    current value in the other direction, the value stays (no decision), unless the value
    lies outside the knob's own bounds. None for a bool knob with ``factor``/``step``, or a
    bool ``value`` for a numeric knob and vice versa.
    """
    current = knob.value
    direction = 0  # -1: a cut (factor < 1, step < 0), +1: a raise, 0: an absolute value
    if "value" in params:
        new: Any = params["value"]
        if isinstance(current, bool) or isinstance(new, bool):
            return new if isinstance(current, bool) and isinstance(new, bool) else None
    elif isinstance(current, bool):
        return None
    elif "factor" in params:
        factor = float(params["factor"])
        direction = (factor > 1.0) - (factor < 1.0)
        new = current * factor
        if isinstance(current, int):
            new = _round_half_up(new)
            if new == current and factor != 1.0:
                new = current + (1 if factor > 1.0 else -1)
    else:
        new = current + params["step"]
        direction = 1 if params["step"] > 0 else -1
    is_int = isinstance(current, int)
    for low in (params.get("min"), knob.min):
        if low is not None and not isinstance(low, bool):
            low = math.ceil(low) if is_int else low
            new = max(new, low)
    for high in (params.get("max"), knob.max):
        if high is not None and not isinstance(high, bool):
            high = math.floor(high) if is_int else high
            new = min(new, high)
    if ((direction < 0 and new > current) or (direction > 0 and new < current)) and _within(
        current, knob
    ):
        new = current  # a bound beyond the value: a cut never raises, a raise never cuts
    if is_int:
        return _round_half_up(new)
    return float(new)


def _within(value: KnobValue, knob: Knob) -> bool:
    """Whether ``value`` lies within the knob's own ``min``/``max`` (None: unbounded)."""
    low, high = knob.min, knob.max
    return (low is None or isinstance(low, bool) or value >= low) and (
        high is None or isinstance(high, bool) or value <= high
    )


def _reason(findings: Iterable[Finding]) -> str:
    return "; ".join(f.message for f in findings)


class DecisionMaker(Accounting):
    """The per-action decision makers of :class:`~gpuwatchd.policy.engine.PolicyEngine`.

    Each ``_<action>(firing, action, groups, made)`` appends its decisions to ``made``,
    skipping targets still cooling down (:class:`Accounting`).
    """

    def _decision(
        self,
        firing: Firing,
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
        self, firing: Firing, action: Action, groups: list[FindingGroup], made: list[Decision]
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

    def _notify(
        self, firing: Firing, action: Action, groups: list[FindingGroup], made: list[Decision]
    ) -> None:
        """One notification per firing for the subjects not cooling down (as ``log``)."""
        policy, now = firing.policy, firing.now
        findings = _unique_findings(f for g in groups for f in g.findings)
        news = [
            s
            for s in sorted({f.subject for f in findings})
            if not self._cooling(policy, "notify:" + s, now)
        ]
        if not news:
            return
        jobs = {f.job for f in findings if f.job is not None}
        gpus = {f.gpu_uuid for f in findings if f.gpu_uuid is not None}
        params: dict[str, object] = {
            "urls": list(action.params["urls"]),
            "title": action.params.get("title") or f"gpuwatchd: {policy.name}",
            "message": action.params.get("message") or _reason(findings),
            "timeout_s": float(action.params.get("timeout", 10.0)),
            "subjects": news,
        }
        made.append(
            self._decision(
                firing,
                "notify",
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
            return [j for j in jobs if uses_gpu(j, gpus)]
        return jobs

    def _set_knob(
        self, firing: Firing, action: Action, groups: list[FindingGroup], made: list[Decision]
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

    def _concerned_managed(self, group: FindingGroup, snapshot: Snapshot) -> list[str]:
        """Managed jobs the group is about (docs/modules.md, ``lower_parallelism``)."""
        managed = self._managed
        if not managed:
            return []
        if group.job is not None:
            return [group.job] if group.job in managed else []
        named = unique_in_order(f.job for f in group.findings if f.job is not None)
        if named:
            return [n for n in named if n in managed]
        gpus = [(f.gpu_uuid, f.gpu_index) for f in group.findings if f.gpu_uuid is not None]
        if group.gpu_uuid is not None:
            gpus.append((group.gpu_uuid, group.gpu_index))
        if gpus:
            return unique_in_order(
                j.name for j in snapshot.jobs if j.name in managed and uses_gpu(j, gpus)
            )
        return list(managed)

    def _ladder_move(
        self, firing: Firing, action: Action, groups: list[FindingGroup], made: list[Decision]
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
        self, firing: Firing, action: Action, groups: list[FindingGroup], made: list[Decision]
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
                if self._cooling(firing.policy, target_key(name, uuid), firing.now):
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

    def _cordon(
        self, firing: Firing, action: Action, groups: list[FindingGroup], made: list[Decision]
    ) -> None:
        """``cordon_gpu`` / ``uncordon_gpu``: one decision per GPU of the firing not cooling
        down (target ``gpu:<uuid>``); the actuator knows whether it is cordoned already."""
        for group in groups:
            uuid = group.gpu_uuid
            if uuid is None or group.gpu_index is None:
                continue
            if self._cooling(firing.policy, target_key(None, uuid), firing.now):
                continue
            params: dict[str, object] = {"gpu_index": group.gpu_index, "gpu_uuid": uuid}
            if action.action == "cordon_gpu":
                params["relaunch"] = bool(action.params.get("relaunch", True))
            made.append(
                self._decision(firing, action.action, params, group.findings, gpu_uuid=uuid)
            )

    def _restart(
        self, firing: Firing, action: Action, groups: list[FindingGroup], made: list[Decision]
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
        self, firing: Firing, action: Action, groups: list[FindingGroup], made: list[Decision]
    ) -> None:
        argv: tuple[str, ...] = tuple(action.params["argv"])
        timeout_s = float(action.params.get("timeout", 30.0))
        for group in groups:
            job = group.job
            gpu = group.gpu_uuid
            if self._cooling(firing.policy, target_key(job, gpu), firing.now):
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
