"""``requeue_task``: requeue the crashed task of a Slurm array (``scontrol requeue``).

Needs a ``job_crashed`` condition. Decision (pure): as ``restart_worker``, for a job of
``slurm.arrays``, with ``max_requeues`` and the crash's task (``slurm_job``: read from
Slurm, or named by the crashed hook's hello) in the params. Carrying out
(:meth:`gpuwatchd.slurm_actions.SlurmActions.requeue_task`): ``scontrol requeue
<array>_<task>`` once the task left ``RUNNING``; refused for a task requeued
``max_requeues`` times already (Slurm's ``Restarts``), one whose array is not this
node's, a crash that names no task, or a job that is not a Slurm array. Needs
``slurm:`` (else ``failed``). docs/slurm.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.detectors import ParamSpec
from gpuwatchd.errors import ActionRefused
from gpuwatchd.model import Decision, JobEvent
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.params import parse_count
from gpuwatchd.policy.actions.restart_worker import crash_decisions
from gpuwatchd.policy.actions.spec import ActionSpec, Effects, Firing, Group, Outcome

__all__ = ["SPEC", "carry_out", "decide"]


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``requeue_task`` decisions of one firing (module docstring); pure."""
    limit = params.get("max_requeues", 1)

    def extra(event: JobEvent) -> dict[str, object]:
        return {"max_requeues": limit, "slurm_job": event.slurm_job}

    return crash_decisions(firing, action_names.REQUEUE_TASK, groups, extra)


async def carry_out(decision: Decision, effects: Effects) -> Outcome:
    """Requeue the crashed task (module docstring); raises ActionRefused, also for a job
    that is not a Slurm array of ``slurm.arrays`` (a managed job)."""
    slurm = effects.require_slurm()
    job = str(decision.params.get("job") or decision.job or "")
    if not slurm.owns(job):
        raise ActionRefused(f"job {job!r} is not a Slurm array (slurm.arrays)")
    return "applied", await slurm.requeue_task(decision)


SPEC = ActionSpec(
    action_names.REQUEUE_TASK,
    "requeue the crashed task of a Slurm array (scontrol requeue <array>_<task>), at most "
    "max_requeues times per task (its Restarts); pair it with restart_study so that the "
    "requeued task runs the failed trial again (needs a job_crashed condition and slurm:)",
    (
        ParamSpec(
            "max_requeues",
            parse_count,
            default=1,
            unit="count",
            help="requeue one task at most this often (Slurm's Restarts of the task)",
        ),
    ),
    decide,
    carry_out,
    needs=("slurm",),
    needs_detector="job_crashed",
    because="it acts on the crashed task",
)
