"""``restart_study``: fail the crashed worker's Optuna trial and re-enqueue its params.

Needs a ``job_crashed`` condition. Decision (pure): as ``restart_worker``, with
``max_retries`` in the params. Carrying out: the trial is failed and its params
re-enqueued at most ``max_retries`` times (capped by the job's ``optuna.max_retries``),
then as ``restart_worker`` (a worker not relaunched is named in the detail; the outcome
stays ``applied``). A killed daemon's unfinished one is finished at the next start
(:meth:`gpuwatchd.jobs.actions.SupervisorActions.resume_restart_study`). Needs managed
jobs (else ``failed``). docs/managed-jobs.md, "Retries".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.detectors import ParamSpec
from gpuwatchd.model import Decision
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.params import parse_count
from gpuwatchd.policy.actions.restart_worker import crash_decisions
from gpuwatchd.policy.actions.spec import ActionSpec, Effects, Firing, Group, Outcome

__all__ = ["SPEC", "carry_out", "decide"]


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``restart_study`` decisions of one firing (module docstring); pure."""
    extra = {"max_retries": params.get("max_retries", 3)}
    return crash_decisions(firing, action_names.RESTART_STUDY, groups, lambda _event: extra)


async def carry_out(decision: Decision, effects: Effects) -> Outcome:
    """Fail and re-enqueue the crashed worker's trial (module docstring); a Slurm array's
    task through ``effects.slurm`` (docs/slurm.md)."""
    job = str(decision.params.get("job") or decision.job or "")
    if effects.slurm is not None and effects.slurm.owns(job):
        return "applied", await effects.slurm.restart_study(decision)
    return "applied", await effects.require_managed().restart_study(decision)


SPEC = ActionSpec(
    action_names.RESTART_STUDY,
    "fail the crashed worker's Optuna trial and re-enqueue its params; the "
    "supervisor relaunches the worker with the job's restart: backoff and budget "
    "(needs a job_crashed condition)",
    (
        ParamSpec(
            "max_retries",
            parse_count,
            default=3,
            unit="count",
            help="re-enqueue a failed trial's params at most this often",
        ),
    ),
    decide,
    carry_out,
    needs=("managed",),
    needs_detector="job_crashed",
    because="it acts on the crashed worker",
)
