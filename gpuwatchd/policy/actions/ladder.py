"""The parallelism ladder both ``lower_parallelism`` and ``raise_parallelism`` move (pure).

A managed job's ladder runs from its ``min_workers`` to its ``workers``; the engine keeps
each job's position (:meth:`gpuwatchd.policy.accounting.Accounting.parallelism`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.detectors import ParamSpec
from gpuwatchd.model import Decision, Finding
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.params import parse_positive_int
from gpuwatchd.policy.actions.spec import (
    Effects,
    Firing,
    Group,
    Outcome,
    int_param,
    unique_findings,
)

__all__ = ["STEP", "carry_out", "decide_move"]

STEP = ParamSpec(
    "step", parse_positive_int, default=1, unit="workers", help="workers per move (>= 1)"
)
"""The ``step`` param of both ladder actions."""


def decide_move(
    firing: Firing, name: str, params: Mapping[str, Any], groups: Sequence[Group]
) -> list[Decision]:
    """One ``name`` decision per managed job the firing concerns, not cooling down
    (target ``job:<name>``), that can move: ``lower_parallelism`` by ``step`` down to
    ``floor`` (never below ``min_workers``), ``raise_parallelism`` by ``step`` up to
    ``ceiling`` (never above ``workers``); ``params = {"job", "from", "to", "mode"}``
    (``mode``: the action's for a lowering, ``now`` for a raise)."""
    lower = name == action_names.LOWER_PARALLELISM
    only = params.get("job")
    targets: dict[str, list[Finding]] = {}
    for group in groups:
        names = [only] if only is not None else firing.concerned_managed(group)
        for job in names:
            if job in firing.managed:
                targets.setdefault(job, []).extend(group.findings)
    made: list[Decision] = []
    for job, findings in targets.items():
        if firing.cooling("job:" + job):
            continue
        workers, min_workers = firing.managed[job]
        floor = max(int(params.get("floor", min_workers)), min_workers)
        ceiling = min(int(params.get("ceiling", workers)), workers)
        current = firing.parallelism(job)
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
            firing.decision(
                name,
                {"job": job, "from": current, "to": to, "mode": mode},
                unique_findings(findings),
                job=job,
            )
        )
    return made


async def carry_out(decision: Decision, effects: Effects) -> Outcome:
    """Set the job's parallelism to the decision's ``to`` in its ``mode`` through the
    managed-job backend (with ``drain`` it returns once the drained worker finished); for a
    Slurm array that ``effects.slurm`` owns, its ``ArrayTaskThrottle`` (docs/slurm.md)."""
    params = decision.params
    job = str(params.get("job") or decision.job or "")
    to, mode = int_param(decision, "to"), str(params["mode"])
    if effects.slurm is not None and effects.slurm.owns(job):
        lowering = decision.action == action_names.LOWER_PARALLELISM
        return "applied", await effects.slurm.set_parallelism(job, to, lowering)
    return "applied", await effects.require_managed().set_parallelism(job, to, mode)
