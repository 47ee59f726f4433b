"""``exec``: run a command (an argv list, never a shell) with the firing's fields.

Decision (pure): one per group not cooling down (target from its job and GPU):
``params = {"argv", "timeout_s"}`` with ``{job}``, ``{gpu_index}``, ``{gpu_uuid}``,
``{policy}``, ``{subject}`` replaced in each argument (nothing else is special).
Carrying out: :func:`gpuwatchd.actuators.run_exec` (own session, stdin /dev/null, the
process group killed after ``timeout_s``): ``applied`` on exit status 0, else ``failed``
with the status and the tails of its output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from gpuwatchd.detectors import ParamSpec
from gpuwatchd.model import Decision
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.params import parse_argv, parse_positive_duration
from gpuwatchd.policy.actions.spec import (
    ActionSpec,
    Effects,
    Firing,
    Group,
    Outcome,
    cooldown_target,
    float_param,
    strings_param,
)

__all__ = ["FIELDS", "SPEC", "carry_out", "decide"]

FIELDS: Final = ("job", "gpu_index", "gpu_uuid", "policy", "subject")
"""The ``{name}`` fields replaced in an ``exec`` argument."""


def _substitute(arg: str, values: Mapping[str, str]) -> str:
    for name in FIELDS:
        token = "{" + name + "}"
        if token in arg:
            arg = arg.replace(token, values[name])
    return arg


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``exec`` decisions of one firing (module docstring); pure."""
    argv: tuple[str, ...] = tuple(params["argv"])
    timeout_s = float(params.get("timeout", 30.0))
    made: list[Decision] = []
    for group in groups:
        job, gpu = group.job, group.gpu_uuid
        if firing.cooling(cooldown_target(job, gpu)):
            continue
        values = {
            "job": job or "",
            "gpu_index": "" if group.gpu_index is None else str(group.gpu_index),
            "gpu_uuid": gpu or "",
            "policy": firing.policy,
            "subject": group.subject,
        }
        made.append(
            firing.decision(
                action_names.EXEC,
                {"argv": [_substitute(a, values) for a in argv], "timeout_s": timeout_s},
                group.findings,
                job=job,
                gpu_uuid=gpu,
            )
        )
    return made


async def carry_out(decision: Decision, effects: Effects) -> Outcome:
    """Run the decision's argv (module docstring)."""
    run = effects.run_exec
    if run is None:
        return "failed", "commands cannot be run here"
    argv = strings_param(decision, "argv")
    result = await run(argv, float_param(decision, "timeout_s", 30.0))
    return ("applied" if result.ok else "failed"), result.describe()


SPEC = ActionSpec(
    action_names.EXEC,
    "run a command (argv list, no shell) with {job}, {gpu_index}, {gpu_uuid}, "
    "{policy}, {subject} replaced in its arguments",
    (
        ParamSpec(
            "argv",
            parse_argv,
            required=True,
            unit="list",
            help="program and arguments; a string is an error (never a shell string)",
        ),
        ParamSpec(
            "timeout",
            parse_positive_duration,
            default="30s",
            unit="duration",
            help="kill the command after this long",
        ),
    ),
    decide,
    carry_out,
)
