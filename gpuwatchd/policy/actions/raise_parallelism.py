"""``raise_parallelism``: move a managed job one step up its parallelism ladder.

Decision (pure): as ``lower_parallelism``, upwards: ``to = min(from + step, ceiling)``,
``mode`` ``now``; none for a job at its ceiling. Carrying out: the supervisor starts the
worker at once. Needs managed jobs (else ``failed``). docs/managed-jobs.md. For a Slurm
array (``slurm.arrays``): its ``ArrayTaskThrottle``, refused (held) within the array's
``raise_hold`` of a lower; a refused raise leaves the ladder where it was. docs/slurm.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.detectors import ParamSpec
from gpuwatchd.model import Decision
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions import ladder
from gpuwatchd.policy.actions.params import parse_positive_int, parse_text
from gpuwatchd.policy.actions.spec import ActionSpec, Firing, Group

__all__ = ["SPEC", "decide"]


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``raise_parallelism`` decisions of one firing (module docstring); pure."""
    return ladder.decide_move(firing, action_names.RAISE_PARALLELISM, params, groups)


SPEC = ActionSpec(
    action_names.RAISE_PARALLELISM,
    "move a managed job one step up its parallelism ladder (more worker processes)",
    (
        ParamSpec(
            "job",
            parse_text,
            unit="name",
            help="managed job (default: the managed jobs the findings concern); not "
            "checked against the config",
        ),
        ladder.STEP,
        ParamSpec(
            "ceiling",
            parse_positive_int,
            unit="workers",
            help="never above this (default and highest: the job's workers)",
        ),
    ),
    decide,
    ladder.carry_out,
    needs=("managed",),
    moves_ladder=True,
)
