"""``restart_worker``: relaunch the crashed worker of a managed job.

Needs a ``job_crashed`` condition. Decision (pure): one per ``job_crashed`` finding of a
managed job not cooling down (target ``job:<name>``): ``params = {"job", "pid",
"crash_kind", "gpu_index", "trial_number"}``. Carrying out: reports where the
supervisor's relaunch of that worker stands (it relaunches under the job's ``restart:``
backoff and budget); ``refused`` for a worker the supervisor will not relaunch or a
crash this daemon does not know. Needs managed jobs (else ``failed``).
docs/managed-jobs.md, "Retries".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuwatchd.detectors import EventFinding
from gpuwatchd.model import Decision, JobEvent
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.spec import ActionSpec, Effects, Firing, Group, Outcome

__all__ = ["SPEC", "carry_out", "crash_decisions", "decide"]


def crash_decisions(
    firing: Firing,
    name: str,
    groups: Sequence[Group],
    extra: Callable[[JobEvent], Mapping[str, object]],
) -> list[Decision]:
    """One ``name`` decision per ``job_crashed`` finding of a managed job (once each, not
    cooling down), ``params`` the crash's and ``extra(event)``: the action's own, given the
    crash event (``restart_worker``, ``restart_study``, ``requeue_task``)."""
    seen: set[int] = set()
    made: list[Decision] = []
    for group in groups:
        for finding in group.findings:
            if not isinstance(finding, EventFinding) or finding.detector != "job_crashed":
                continue
            event = finding.event
            if event is None or id(finding) in seen or event.job not in firing.managed:
                continue
            seen.add(id(finding))
            if firing.cooling("job:" + event.job):
                continue
            params: dict[str, object] = {
                "job": event.job,
                "pid": event.pid,
                "crash_kind": event.crash_kind or "other",
                "gpu_index": event.gpu_index,
                "trial_number": event.trial_number,
                **extra(event),
            }
            made.append(firing.decision(name, params, [finding], job=event.job))
    return made


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``restart_worker`` decisions of one firing (module docstring); pure."""
    return crash_decisions(firing, action_names.RESTART_WORKER, groups, lambda _event: {})


async def carry_out(decision: Decision, effects: Effects) -> Outcome:
    """Report the crashed worker's relaunch (module docstring); raises ActionRefused."""
    return "applied", await effects.require_managed().restart_worker(decision)


SPEC = ActionSpec(
    action_names.RESTART_WORKER,
    "relaunch the crashed worker of a managed job (needs a job_crashed condition)",
    (),
    decide,
    carry_out,
    needs=("managed",),
    needs_detector="job_crashed",
    because="it acts on the crashed worker",
)
