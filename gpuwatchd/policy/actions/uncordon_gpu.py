"""``uncordon_gpu``: lift the GPU's cordon if a policy set it.

Needs scope ``gpu``. Decision (pure): as ``cordon_gpu``, ``params = {"gpu_index",
"gpu_uuid"}``. Carrying out (:meth:`gpuwatchd.cordon.CordonActions.uncordon`, not as an
operator): a cordon a policy set is lifted; a GPU not cordoned is no error (nothing to
lift); an operator's cordon is ``refused`` (it stays until ``gpuwatchctl gpu uncordon``).
Resumed at the next start when a killed daemon left it ``unknown``. Needs the cordons
(else ``failed``). docs/managed-jobs.md, "Cordoned GPUs".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.model import Decision
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.cordon_gpu import per_gpu
from gpuwatchd.policy.actions.spec import (
    ActionSpec,
    Effects,
    Firing,
    Group,
    Outcome,
    int_param,
)

__all__ = ["SPEC", "carry_out", "decide"]


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``uncordon_gpu`` decisions of one firing (module docstring); pure."""
    return per_gpu(firing, action_names.UNCORDON_GPU, groups, {})


async def carry_out(decision: Decision, effects: Effects) -> Outcome:
    """Lift the decision's GPU's cordon if a policy set it (module docstring); raises
    ActionRefused for an operator's cordon."""
    index = int_param(decision, "gpu_index")
    by = f"policy {decision.policy}"
    return "applied", effects.require_gpus().uncordon(
        index, decision.gpu_uuid, by=by, operator=False
    )


SPEC = ActionSpec(
    action_names.UNCORDON_GPU,
    "lift the GPU's cordon if a policy set it (scope gpu; an operator's cordon "
    "stays until gpuwatchctl gpu uncordon)",
    (),
    decide,
    carry_out,
    needs=("gpus",),
    needs_scope="gpu",
    resumable=True,
)
