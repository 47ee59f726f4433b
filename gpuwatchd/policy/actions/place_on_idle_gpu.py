"""``place_on_idle_gpu``: start the next worker of a managed job on the idle GPU.

Needs scope ``gpu``. Decision (pure): for each GPU group, each managed job (the action's
``job``, else every managed job) not cooling down for that GPU (target
``job:<name>@gpu:<uuid>``): ``params = {"job", "gpu_index", "gpu_uuid"}``. Carrying
out: the supervisor's next start of the job goes to that GPU; ``refused`` when the GPU is
cordoned. Needs managed jobs (else ``failed``). docs/managed-jobs.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.detectors import ParamSpec
from gpuwatchd.errors import ActionRefused
from gpuwatchd.model import Decision
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.params import parse_text
from gpuwatchd.policy.actions.spec import (
    ActionSpec,
    Effects,
    Firing,
    Group,
    Outcome,
    cooldown_target,
    int_param,
)

__all__ = ["SPEC", "carry_out", "decide"]


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``place_on_idle_gpu`` decisions of one firing (module docstring); pure."""
    only = params.get("job")
    names = [only] if only is not None else list(firing.managed)
    made: list[Decision] = []
    for group in groups:
        uuid = group.gpu_uuid
        if uuid is None:
            continue
        for name in names:
            if name not in firing.managed or firing.cooling(cooldown_target(name, uuid)):
                continue
            made.append(
                firing.decision(
                    action_names.PLACE_ON_IDLE_GPU,
                    {"job": name, "gpu_index": group.gpu_index, "gpu_uuid": uuid},
                    group.findings,
                    job=name,
                    gpu_uuid=uuid,
                )
            )
    return made


async def carry_out(decision: Decision, effects: Effects) -> Outcome:
    """Have the job's next worker start on the decision's GPU; raises ActionRefused on a
    cordoned GPU."""
    managed = effects.require_managed()
    gpu = int_param(decision, "gpu_index")
    if effects.gpus is not None and effects.gpus.is_cordoned(gpu):
        raise ActionRefused(f"GPU {gpu} is cordoned; no worker is placed on it")
    job = str(decision.params.get("job") or decision.job or "")
    return "applied", await managed.place_next(job, gpu)


SPEC = ActionSpec(
    action_names.PLACE_ON_IDLE_GPU,
    "start the next worker of a managed job on the idle GPU (scope gpu)",
    (
        ParamSpec(
            "job",
            parse_text,
            unit="name",
            help="managed job (default: every managed job); not checked against the config",
        ),
    ),
    decide,
    carry_out,
    needs=("managed",),
    needs_scope="gpu",
)
