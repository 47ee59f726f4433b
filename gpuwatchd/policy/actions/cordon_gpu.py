"""``cordon_gpu``: no managed worker is placed on the GPU; those on it move.

Needs scope ``gpu``. Decision (pure): one per GPU of the firing not cooling down (target
``gpu:<uuid>``): ``params = {"gpu_index", "gpu_uuid", "relaunch"}``; the cordons know
whether it is cordoned already. Carrying out (:meth:`gpuwatchd.cordon.CordonActions.cordon`,
``by`` ``policy NAME``, the findings as the reason): the GPU is cordoned (idempotent,
kept across restarts); with ``relaunch`` every managed worker on it is relaunched on
another GPU and its trial retried. Resumed at the next start when a killed daemon left
it ``unknown``. Needs the cordons (else ``failed``). docs/managed-jobs.md, "Cordoned GPUs".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.detectors import ParamSpec
from gpuwatchd.model import Decision
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.params import parse_bool
from gpuwatchd.policy.actions.spec import (
    ActionSpec,
    Effects,
    Firing,
    Group,
    Outcome,
    cooldown_target,
    int_param,
)

__all__ = ["SPEC", "carry_out", "decide", "per_gpu"]


def per_gpu(
    firing: Firing, name: str, groups: Sequence[Group], extra: Mapping[str, object]
) -> list[Decision]:
    """One ``name`` decision per GPU group not cooling down (``gpu:<uuid>``), with
    ``params = {"gpu_index", "gpu_uuid", **extra}`` (``cordon_gpu``, ``uncordon_gpu``)."""
    made: list[Decision] = []
    for group in groups:
        uuid = group.gpu_uuid
        if uuid is None or group.gpu_index is None or firing.cooling(cooldown_target(None, uuid)):
            continue
        params: dict[str, object] = {"gpu_index": group.gpu_index, "gpu_uuid": uuid, **extra}
        made.append(firing.decision(name, params, group.findings, gpu_uuid=uuid))
    return made


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``cordon_gpu`` decisions of one firing (module docstring); pure."""
    return per_gpu(
        firing, action_names.CORDON_GPU, groups, {"relaunch": bool(params.get("relaunch", True))}
    )


async def carry_out(decision: Decision, effects: Effects) -> Outcome:
    """Cordon the decision's GPU (module docstring); raises ActionRefused."""
    index = int_param(decision, "gpu_index")
    relaunch = bool(decision.params.get("relaunch", True))
    detail = await effects.require_gpus().cordon(
        index, decision.gpu_uuid, f"policy {decision.policy}", decision.reason, relaunch=relaunch
    )
    return "applied", detail


SPEC = ActionSpec(
    action_names.CORDON_GPU,
    "cordon the GPU (scope gpu): no managed worker is placed on it; those on it are "
    "relaunched on other GPUs and their trials retried; kept across restarts",
    (
        ParamSpec(
            "relaunch",
            parse_bool,
            default=True,
            unit="bool",
            help="move the managed workers on the GPU now (false: only keep new ones off it)",
        ),
    ),
    decide,
    carry_out,
    needs=("gpus",),
    needs_scope="gpu",
    resumable=True,
)
