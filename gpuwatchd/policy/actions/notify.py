"""``notify``: send a notification through apprise (Slack, PagerDuty, e-mail, webhooks).

Decision (pure): one per firing for the finding subjects not cooling down (target
``notify:<subject>``, as ``log``): ``params = {"urls", "title", "message", "timeout_s",
"subjects"}`` (title default ``gpuwatchd: POLICY``, message default the findings').
Carrying out: :func:`gpuwatchd.notify.send_notification` off the tick, given up after
``timeout_s`` (outcome ``failed`` with apprise's reason). The URLs hold tokens: logs,
the journal and ``status`` show them as ``scheme://…`` (:func:`public`).
docs/policies.md#notify.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.detectors import ParamSpec
from gpuwatchd.model import Decision
from gpuwatchd.policy import action_names
from gpuwatchd.policy.actions.log import new_subjects, one_target
from gpuwatchd.policy.actions.params import parse_positive_duration, parse_text, parse_urls
from gpuwatchd.policy.actions.spec import (
    ActionSpec,
    Effects,
    Firing,
    Group,
    Outcome,
    float_param,
    reason_of,
    strings_param,
)

__all__ = ["SPEC", "carry_out", "decide", "public"]


def decide(firing: Firing, params: Mapping[str, Any], groups: Sequence[Group]) -> list[Decision]:
    """The ``notify`` decision of one firing (module docstring); pure."""
    findings, news = new_subjects(firing, action_names.NOTIFY, groups)
    if not news:
        return []
    made: dict[str, object] = {
        "urls": list(params["urls"]),
        "title": params.get("title") or f"gpuwatchd: {firing.policy}",
        "message": params.get("message") or reason_of(findings),
        "timeout_s": float(params.get("timeout", 10.0)),
        "subjects": news,
    }
    target = one_target(findings)
    return [
        firing.decision(
            action_names.NOTIFY, made, findings, job=target["job"], gpu_uuid=target["gpu_uuid"]
        )
    ]


async def carry_out(decision: Decision, effects: Effects) -> Outcome:
    """Send the notification (module docstring): ``applied`` when apprise sent it."""
    send = effects.send_notification
    if send is None:
        return "failed", "notifications cannot be sent here"
    params = decision.params
    sent, detail = await send(
        strings_param(decision, "urls"),
        str(params.get("title") or decision.policy),
        str(params.get("message") or decision.reason),
        float_param(decision, "timeout_s", 10.0),
    )
    return ("applied" if sent else "failed"), detail


def public(params: Mapping[str, object]) -> dict[str, object]:
    """``params`` with the URLs (which hold webhook tokens and passwords) cut to their
    scheme (``slack://…``), as logs, the journal and ``status`` show them."""
    shown = dict(params)
    urls = shown.get("urls")
    if isinstance(urls, (list, tuple)):
        shown["urls"] = [str(u).split("://", 1)[0] + "://…" for u in urls]
    return shown


SPEC = ActionSpec(
    action_names.NOTIFY,
    "send a notification through apprise (Slack, PagerDuty, e-mail, JSON webhook "
    "URLs), off the tick, under the policy's cooldown and limits",
    (
        ParamSpec(
            "urls",
            parse_urls,
            required=True,
            unit="list",
            help="apprise URLs, e.g. json://host:port/path, slack://T/B/C, "
            "pagerduty://KEY@RKEY, mailtos://user:pw@host (at most 16; shown as "
            "scheme://… in logs, journal and status)",
        ),
        ParamSpec(
            "title",
            parse_text,
            unit="text",
            help="title (default: gpuwatchd POLICY on HOSTNAME)",
        ),
        ParamSpec(
            "message",
            parse_text,
            unit="text",
            help="body (default: the findings' messages)",
        ),
        ParamSpec(
            "timeout",
            parse_positive_duration,
            default="10s",
            unit="duration",
            help="give up on the sending after this long (outcome failed)",
        ),
    ),
    decide,
    carry_out,
    per_subject=True,
    public=public,
)
