"""``lower_parallelism``: move a managed job one step down its parallelism ladder.

Decision (pure): one per managed job the firing concerns (the action's ``job``; else the
jobs of the group; the managed jobs its findings name or that use its GPUs; every
managed job for host findings), not cooling down (``job:<name>``), above its floor:
``params = {"job", "from", "to", "mode"}`` with ``to = max(from - step, floor)``.
Carrying out: the supervisor stops one worker (``drain``: once its trial finished; ``now``:
at once, its trial failed and re-enqueued). Needs managed jobs (else ``failed``).
docs/managed-jobs.md. For a Slurm array (``slurm.arrays``): its ``ArrayTaskThrottle``,
never raised; each lower (a move, or found done) starts its ``raise_hold``. docs/slurm.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.detectors import ParamSpec
from gpuwatchd.model import Decision
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions import ladder
from gpuwatchd.policy.actions.params import parse_mode, parse_positive_int, parse_text
from gpuwatchd.policy.actions.spec import ActionSpec, Firing, Group

__all__ = ["SPEC", "decide"]


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``lower_parallelism`` decisions of one firing (module docstring); pure."""
    return ladder.decide_move(firing, action_names.LOWER_PARALLELISM, params, groups)


SPEC = ActionSpec(
    action_names.LOWER_PARALLELISM,
    "move a managed job one step down its parallelism ladder (fewer worker processes)",
    (
        ParamSpec(
            "job",
            parse_text,
            unit="name",
            help="managed job (default: the managed jobs the findings concern; every "
            "managed job for host findings); not checked against the config",
        ),
        ladder.STEP,
        ParamSpec(
            "floor",
            parse_positive_int,
            unit="workers",
            help="never below this (default and lowest: the job's min_workers)",
        ),
        ParamSpec(
            "mode",
            parse_mode,
            default="drain",
            unit="drain|now",
            help="drain: the worker finishes its trial first; now: stop it at once",
        ),
    ),
    decide,
    ladder.carry_out,
    needs=("managed",),
    moves_ladder=True,
)
