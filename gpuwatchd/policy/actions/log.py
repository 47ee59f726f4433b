"""``log``: write a log event with the policy's findings.

Decision: one per firing, for the finding subjects not cooling down (target
``log:<subject>``); ``params = {"message", "level", "subjects"}`` (``message``: the
action's, else the findings' messages); ``job``/``gpu_uuid`` set when the findings name
exactly one. In a policy with other actions the log *narrates* them: it is decided only
when another action of the same firing decided. Carrying out: nothing to act on; the
actuator logs it at ``level`` (outcome ``logged``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.detectors import ParamSpec
from gpuwatchd.model import Decision, Finding
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.params import parse_level, parse_text
from gpuwatchd.policy.actions.spec import (
    ActionSpec,
    Firing,
    Group,
    Outcome,
    reason_of,
    unique_findings,
)

__all__ = ["SPEC", "decide", "new_subjects", "one_target", "plan"]


def one_target(findings: Sequence[Finding]) -> dict[str, str | None]:
    """``job``/``gpu_uuid`` of a decision about ``findings``: each set when they name
    exactly one."""
    jobs = {f.job for f in findings if f.job is not None}
    gpus = {f.gpu_uuid for f in findings if f.gpu_uuid is not None}
    return {
        "job": next(iter(jobs)) if len(jobs) == 1 else None,
        "gpu_uuid": next(iter(gpus)) if len(gpus) == 1 else None,
    }


def new_subjects(
    firing: Firing, name: str, groups: Sequence[Group]
) -> tuple[list[Finding], list[str]]:
    """The firing's findings (once each) and their subjects not cooling down under
    ``<name>:<subject>`` (``log``, ``notify``)."""
    findings = unique_findings(f for g in groups for f in g.findings)
    subjects = sorted({f.subject for f in findings})
    return findings, [s for s in subjects if not firing.cooling(f"{name}:{s}")]


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``log`` decision of one firing (module docstring); pure."""
    findings, news = new_subjects(firing, action_names.LOG, groups)
    if not news:
        return []
    made: dict[str, object] = {
        "message": params.get("message") or reason_of(findings),
        "level": params.get("level", "info"),
        "subjects": news,
    }
    target = one_target(findings)
    return [
        firing.decision(
            action_names.LOG, made, findings, job=target["job"], gpu_uuid=target["gpu_uuid"]
        )
    ]


def plan(decision: Decision, holds: object) -> Outcome:
    """Always ``logged``: a log decision is done once written."""
    return "logged", ""


SPEC = ActionSpec(
    action_names.LOG,
    "write a log event (journald) with the policy's findings",
    (
        ParamSpec(
            "message",
            parse_text,
            unit="text",
            help="text to log (default: the findings' messages)",
        ),
        ParamSpec(
            "level",
            parse_level,
            default="info",
            unit="info|warning|error",
            help="log level",
        ),
    ),
    decide,
    plan=plan,
    narrates=True,
    per_subject=True,
)
