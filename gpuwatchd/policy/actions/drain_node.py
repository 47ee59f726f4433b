"""``drain_node``: drain this node in Slurm, so that it starts no new job.

Decision (pure): one per firing not cooling down (target ``global``: there is one node),
``params = {"finding"}``, the findings' messages joined with ``"; "``. Carrying out
(:meth:`gpuwatchd.slurm_actions.SlurmActions.drain`): ``scontrol update NodeName=<node>
State=DRAIN Reason="gpuwatchd: <finding>"``; refused when ``slurm.max_drained_nodes``
nodes are drained with gpuwatchd's reason already (read back from ``sinfo``) or this node
is. Undone by ``gpuwatchctl node resume``. Needs ``slurm:`` (else ``failed``).
docs/slurm.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.model import Decision
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.spec import (
    ActionSpec,
    Effects,
    Firing,
    Group,
    Outcome,
    unique_findings,
)

__all__ = ["SPEC", "carry_out", "decide"]


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``drain_node`` decision of one firing (module docstring); pure."""
    if firing.cooling("global"):
        return []
    findings = unique_findings(f for g in groups for f in g.findings)
    if not findings:
        return []
    finding = "; ".join(f.message for f in findings)
    return [firing.decision(action_names.DRAIN_NODE, {"finding": finding}, findings)]


async def carry_out(decision: Decision, effects: Effects) -> Outcome:
    """Drain this node (module docstring); raises ActionRefused at the cap."""
    finding = str(decision.params.get("finding") or decision.reason)
    return "applied", await effects.require_slurm().drain(finding)


SPEC = ActionSpec(
    action_names.DRAIN_NODE,
    "drain this node in Slurm (scontrol update State=DRAIN Reason=\"gpuwatchd: "
    "<finding>\"): Slurm starts no new job on it, running ones go on; refused when "
    "slurm.max_drained_nodes nodes are drained by gpuwatchd already; undone by "
    "gpuwatchctl node resume (needs slurm: in the config)",
    (),
    decide,
    carry_out,
    needs=("slurm",),
)
