"""``set_knob``: change a knob of attached jobs (e.g. the DataLoader's ``num_workers``).

Decision: for each group, the attached jobs with the knob that it concerns (the action's
``job``; else the jobs its findings name; else the jobs on its findings' GPUs; else every
attached job with the knob), each once per firing and not cooling down (target
``job:<name>``), whose value :func:`compute_knob_value` changes; ``params = {"knob",
"value", "previous"}``. Plan: ``refused`` when an operator holds the knob
(:mod:`gpuwatchd.policy.holds`; the detail names the operator's change). Carrying out:
the ``set_knob`` command to the job over the control socket, acknowledged at its next
epoch (up to ``Effects.ack_timeout_s``): ``applied``, ``refused`` (the job said no) or
``failed`` (no such job, disconnected, timeout).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from gpuwatchd.control.knobmemory import policy_source
from gpuwatchd.control.protocol import Op
from gpuwatchd.detectors import ExclusiveGroup, Fail, ParamSpec
from gpuwatchd.errors import ControlError
from gpuwatchd.model import Decision, Knob, KnobValue
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.params import (
    parse_factor,
    parse_knob_value,
    parse_number,
    parse_step,
    parse_text,
)
from gpuwatchd.policy.actions.spec import ActionSpec, Effects, Firing, Group, Outcome
from gpuwatchd.policy.holds import KnobHolds

__all__ = ["JOB_PARAM", "SPEC", "carry_out", "check_bounds", "compute_knob_value", "decide", "plan"]

NO_ANSWER: Final = frozenset({"disconnected", "timeout"})
"""``error_message`` of the replies the control server makes up for lost jobs."""


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


def _within(value: KnobValue, knob: Knob) -> bool:
    """Whether ``value`` lies within the knob's own ``min``/``max`` (None: unbounded)."""
    low, high = knob.min, knob.max
    return (low is None or isinstance(low, bool) or value >= low) and (
        high is None or isinstance(high, bool) or value <= high
    )


def compute_knob_value(knob: Knob, params: Mapping[str, Any]) -> KnobValue | None:
    """The value ``set_knob`` with ``params`` gives ``knob``, or None when not applicable.

    ``params`` has one of ``value``/``factor``/``step`` and optional ``min``/``max``
    (see docs/modules.md for rounding and clamping). A cut (``factor`` < 1, ``step`` < 0)
    never raises the value and a raise never lowers it: where a bound lies beyond the
    current value in the other direction, the value stays (no decision), unless the value
    lies outside the knob's own bounds. None for a bool knob with ``factor``/``step``, or a
    bool ``value`` for a numeric knob and vice versa.
    """
    current = knob.value
    direction = 0  # -1: a cut (factor < 1, step < 0), +1: a raise, 0: an absolute value
    if "value" in params:
        new: Any = params["value"]
        if isinstance(current, bool) or isinstance(new, bool):
            return new if isinstance(current, bool) and isinstance(new, bool) else None
    elif isinstance(current, bool):
        return None
    elif "factor" in params:
        factor = float(params["factor"])
        direction = (factor > 1.0) - (factor < 1.0)
        new = current * factor
        if isinstance(current, int):
            new = _round_half_up(new)
            if new == current and factor != 1.0:
                new = current + (1 if factor > 1.0 else -1)
    else:
        new = current + params["step"]
        direction = 1 if params["step"] > 0 else -1
    is_int = isinstance(current, int)
    for low in (params.get("min"), knob.min):
        if low is not None and not isinstance(low, bool):
            low = math.ceil(low) if is_int else low
            new = max(new, low)
    for high in (params.get("max"), knob.max):
        if high is not None and not isinstance(high, bool):
            high = math.floor(high) if is_int else high
            new = min(new, high)
    if ((direction < 0 and new > current) or (direction > 0 and new < current)) and _within(
        current, knob
    ):
        new = current  # a bound beyond the value: a cut never raises, a raise never cuts
    if is_int:
        return _round_half_up(new)
    return float(new)


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``set_knob`` decisions of one firing (module docstring); pure."""
    name = params["knob"]
    seen: set[str] = set()
    made: list[Decision] = []
    for group in groups:
        for job in firing.knob_targets(params, group.findings):
            target = "job:" + job.name
            if target in seen or firing.cooling(target):
                continue
            knob = job.knobs[name]
            new = compute_knob_value(knob, params)
            if new is None or new == knob.value:
                continue
            seen.add(target)
            relevant = [f for f in group.findings if f.job is None or f.job == job.name]
            made.append(
                firing.decision(
                    action_names.SET_KNOB,
                    {"knob": name, "value": new, "previous": knob.value},
                    relevant,
                    job=job.name,
                )
            )
    return made


def plan(decision: Decision, holds: KnobHolds | None) -> Outcome | None:
    """``refused`` (the hold's description) when an operator holds the decision's knob."""
    if holds is None:
        return None
    held = holds.active(decision.job, str(decision.params.get("knob")))
    return None if held is None else ("refused", held.describe())


async def carry_out(decision: Decision, effects: Effects) -> Outcome:
    """Send the decision's ``knob``/``value`` to its job and wait for the acknowledgement
    (module docstring). Never raises for a lost job or a refusal (they are outcomes)."""
    commander = effects.commander
    if commander is None:
        return "failed", "no control server"
    params = {"knob": decision.params["knob"], "value": decision.params["value"]}
    try:
        replies = await commander.send_command(
            decision.job or "",
            Op.SET_KNOB,
            params,
            timeout_s=effects.ack_timeout_s,
            source=policy_source(decision.policy),
        )
    except ControlError as exc:
        return "failed", exc.message
    except Exception as exc:
        return "failed", f"{type(exc).__name__}: {exc}"
    failed = [r for r in replies if not r.ok]
    if not failed:
        return "applied", "request " + ", ".join(str(r.id) for r in replies)
    # The server reports a job that went away or never answered with these messages;
    # anything else is the job's own refusal, with its reason.
    lost = all(r.error_message in NO_ANSWER for r in failed)
    detail = "; ".join(f"request {r.id}: {r.error_code}: {r.error_message}" for r in failed)
    return ("failed" if lost else "refused"), detail


JOB_PARAM = ParamSpec(
    "job",
    parse_text,
    unit="name",
    help="only this job (default: the jobs the findings name, else the jobs on the "
    "findings' GPUs, else every attached job with the knob)",
)
"""The ``job`` param of the knob actions (``set_knob``, ``tune_loader``)."""


def check_bounds(params: Mapping[str, Any], fail: Fail) -> None:
    """Reject ``min`` above ``max`` (both given)."""
    low, high = params.get("min"), params.get("max")
    if low is not None and high is not None and low > high:
        fail("max", f"max ({high}) is below min ({low})")


SPEC = ActionSpec(
    action_names.SET_KNOB,
    "change a knob of attached jobs (e.g. the DataLoader's num_workers)",
    (
        ParamSpec(
            "knob",
            parse_text,
            required=True,
            unit="name",
            help="knob as the job declared it (num_workers, prefetch_factor)",
        ),
        ParamSpec("value", parse_knob_value, unit="number|bool", help="new value"),
        ParamSpec(
            "factor",
            parse_factor,
            unit="number > 0",
            help="multiply the current value (ints round half up, move >= 1)",
        ),
        ParamSpec(
            "step",
            parse_step,
            unit="integer",
            help="add to the current value (may be negative)",
        ),
        ParamSpec("min", parse_number, unit="number", help="lower bound of the result"),
        ParamSpec("max", parse_number, unit="number", help="upper bound of the result"),
        JOB_PARAM,
    ),
    decide,
    carry_out,
    groups=(ExclusiveGroup(("value", "factor", "step"), required=True),),
    check=check_bounds,
    plan=plan,
    job_command=True,
)
