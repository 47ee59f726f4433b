"""``status``: the daemon's state in one stable JSON object.

Request: ``{"op": "status"}``, optional ``full`` (bool, default false: each policy of
``policies.policies[]`` as ``{"name"}`` alone; true: its whole definition). Other params
are ignored.

Reply: the object ``gpuwatchctl status --json`` prints (docs/cli.md, "gpuwatchctl status
--json"): ``version``, ``pid``, ``uptime_s``, ``ticks``, ``gpus``, ``host``, ``jobs``,
``managed``, ``policies``, ``paused``, ``findings``, ``decisions``, ``xid_events``,
``journal``, ... and ``truncated``: how many entries of each of :data:`TRUNCATED_PARTS`
were left out to keep the reply under
:data:`~gpuwatchd.control.protocol.REPLY_BUDGET_BYTES` (one protocol line). The trimming
is :func:`fit_members`'s alone: the daemon's
:class:`gpuwatchd.daemon.statusview.StatusView` calls it with its kept texts, :func:`fit`
with an object built whole (``Daemon.status()``, the tests' fake daemon).

Errors: ``bad_request`` for a ``full`` that is not a boolean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import (
    REPLY_BUDGET_BYTES,
    EncodedResult,
    ErrorCode,
    Op,
    json_text,
)
from gpuwatchd.errors import ProtocolError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.daemon.ops import ControlTarget

__all__ = ["NAMES", "TRUNCATED_PARTS", "execute", "fit", "fit_members"]

NAMES: Final = (Op.STATUS,)

TRUNCATED_PARTS: Final = (
    "decisions",
    "findings",
    "jobs",
    "policies",
    "holds",
    "cordons",
    "managed",
)
"""The ``truncated`` counts of a ``status`` reply, in the order its parts are cut
(``policies``: definitions left out of a ``full`` reply, the names kept)."""

_OLDEST_FIRST: Final = frozenset({"decisions", "findings"})
"""Parts cut from their start (history: the newest stay); the others from their end."""

Member = tuple[str | None, str | list[str]]
"""One piece of the reply object: ``(key, JSON text of its value)``, ``(key, [JSON text of
each item])`` for a list part of :data:`TRUNCATED_PARTS`, or ``(None, text)`` for
members already joined (``"a":1,"b":2``, no braces)."""


def fit_members(
    members: Sequence[Member],
    budget_bytes: int = REPLY_BUDGET_BYTES,
    *,
    policy_names: tuple[str, int] | None = None,
) -> tuple[str, dict[str, int]]:
    """The ``status`` object's JSON text from ``members`` (:data:`Member`, in order), with
    ``"truncated"`` last, cut to at most ``budget_bytes`` characters (ASCII: bytes).

    Cuts the oldest decisions, then the oldest findings, then the last attached jobs,
    then the policies' definitions (``policy_names``: the ``policies`` member's text with
    names only, and how many definitions that leaves out), then the last knob holds, GPU
    cordons and managed jobs, until the text fits or nothing of them is left. The item
    lists of ``members`` lose the entries cut (the caller's lists: pass copies).
    Returns ``(text, truncated)``: ``truncated`` counts each of :data:`TRUNCATED_PARTS`.
    """
    values: dict[str | None, str | list[str]] = {}
    order: list[str | None] = []
    fragments: list[str] = []
    for key, value in members:
        if key is None:
            fragments.append(value if isinstance(value, str) else ",".join(value))
            order.append(None)
        else:
            values[key] = value
            order.append(key)
    truncated = dict.fromkeys(TRUNCATED_PARTS, 0)
    keys: dict[str, str] = {}

    def text() -> str:
        out = []
        raw = iter(fragments)
        for key in order:
            if key is None:
                out.append(next(raw))
                continue
            value = values[key]
            head = keys.get(key) or keys.setdefault(key, json_text(key) + ":")
            out.append(head + (value if isinstance(value, str) else f"[{','.join(value)}]"))
        out.append('"truncated":' + json_text(truncated))
        return "{" + ",".join(out) + "}"

    out = text()
    for name in TRUNCATED_PARTS:
        if len(out) <= budget_bytes:
            break
        if name == "policies":
            if policy_names is not None and "policies" in values:
                values["policies"], truncated["policies"] = policy_names
                out = text()
            continue
        items = values.get(name)
        if not isinstance(items, list):
            continue
        at = 0 if name in _OLDEST_FIRST else -1
        excess = len(out) - budget_bytes
        while excess > 0 and items:  # by sizes first: one text per part, not per entry
            excess -= len(items.pop(at)) + 1
            truncated[name] += 1
        out = text()  # the counts' digits may have grown it: check again
        while len(out) > budget_bytes and items:
            items.pop(at)
            truncated[name] += 1
            out = text()
    return out, truncated


def fit(status: dict[str, Any], budget_bytes: int = REPLY_BUDGET_BYTES) -> dict[str, Any]:
    """``status`` (the object built whole) fitted to ``budget_bytes`` by :func:`fit_members`.

    Adds ``truncated`` and removes the entries cut from ``status``'s lists (the
    ``policies`` definitions become ``{"name"}`` when cut); changes ``status`` and returns
    it as an :class:`~gpuwatchd.control.protocol.EncodedResult` carrying its text, so the
    reply is encoded only once. A value JSON cannot carry leaves ``status`` whole (the
    server's encode reports it).
    """
    lists = {
        key: value
        for key, value in status.items()
        if key in TRUNCATED_PARTS and key != "policies" and isinstance(value, list)
    }
    policies = status.get("policies")
    short: dict[str, Any] | None = None
    if isinstance(policies, Mapping) and isinstance(policies.get("policies"), list):
        names = [{"name": p.get("name")} for p in policies["policies"] if isinstance(p, Mapping)]
        if names != policies["policies"]:
            short = {**policies, "policies": names}
    try:
        members: list[Member] = [
            (key, [json_text(item) for item in lists[key]] if key in lists else json_text(value))
            for key, value in status.items()
            if key != "truncated"
        ]
        policy_names = None if short is None else (json_text(short), len(short["policies"]))
    except ProtocolError:
        status["truncated"] = dict.fromkeys(TRUNCATED_PARTS, 0)
        return status
    text, truncated = fit_members(members, budget_bytes, policy_names=policy_names)
    for key, items in lists.items():
        cut = truncated[key]
        if cut and key in _OLDEST_FIRST:
            del items[:cut]
        elif cut:
            del items[len(items) - cut :]
    if truncated["policies"] and short is not None:
        status["policies"] = short
    status.pop("truncated", None)
    status["truncated"] = truncated
    out = EncodedResult(status)
    out.json_text = text
    return out


async def execute(
    target: ControlTarget, op: str, params: Mapping[str, Any], peer: PeerCredentials
) -> Any:
    """Answer ``status`` (module docstring)."""
    full = params.get("full", False)
    if not isinstance(full, bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'full' must be true or false")
    return target.status_reply(full=full)
