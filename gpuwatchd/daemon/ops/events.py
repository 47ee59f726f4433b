"""``events``: the journal's event stream (findings, decisions, outcomes), with a cursor.

Request: ``{"op": "events", "params": {...}}``, all optional: ``since_s`` (Unix time,
a number), ``after_id`` (a non-negative integer: events after that id), ``limit``
(1..:data:`MAX_LIMIT`, default :data:`DEFAULT_LIMIT`). Without ``since_s`` and
``after_id`` the reply holds the latest ``limit`` events.

Reply: ``{"events": [...], "last_id": N, "more": bool}``. ``last_id`` is the cursor to
pass as ``after_id`` next (the request's ``after_id`` when nothing is new, the newest id
for an empty tail); ``more`` says events after it were left out (``limit``, or the
reply's :data:`REPLY_BUDGET_BYTES`).

Errors: ``bad_request`` for a bad param; ``internal`` when the journal is not open or
cannot be read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import REPLY_BUDGET_BYTES, ErrorCode, Op
from gpuwatchd.errors import JournalError, ProtocolError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.daemon.ops import ControlTarget

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "NAMES", "execute"]

NAMES: Final = (Op.EVENTS,)
DEFAULT_LIMIT: Final = 100
"""Events per reply when the request names no ``limit``."""
MAX_LIMIT: Final = 1000
"""The largest ``limit`` accepted."""


def _int_param(params: Mapping[str, Any], name: str) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name!r} must be a non-negative integer")
    return value


async def execute(
    target: ControlTarget, op: str, params: Mapping[str, Any], peer: PeerCredentials
) -> dict[str, Any]:
    """Answer ``events`` (module docstring)."""
    return events(target, params)


def events(target: ControlTarget, params: Mapping[str, Any]) -> dict[str, Any]:
    """The ``events`` reply for ``params`` (module docstring); raises ProtocolError."""
    since = params.get("since_s")
    if since is not None and (isinstance(since, bool) or not isinstance(since, (int, float))):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'since_s' must be a number")
    after_id = _int_param(params, "after_id")
    limit = _int_param(params, "limit")
    limit = DEFAULT_LIMIT if limit is None else limit
    if not 1 <= limit <= MAX_LIMIT:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"'limit' must be between 1 and {MAX_LIMIT}")
    source = target.event_source()
    if source is None:
        raise ProtocolError(ErrorCode.INTERNAL, "the journal is not open")
    tail = since is None and after_id is None
    try:
        found = source.events(
            since_s=None if since is None else float(since),
            after_id=after_id,
            limit=limit if tail else limit + 1,
        )
        newest = source.last_event_id()
    except JournalError as exc:
        raise ProtocolError(ErrorCode.INTERNAL, str(exc)) from None
    more = len(found) > limit
    out: list[dict[str, Any]] = []
    size = 0
    for event in found[:limit]:
        size += len(json.dumps(event, separators=(",", ":"), default=str)) + 1
        if out and size > REPLY_BUDGET_BYTES:
            more = True
            break
        out.append(event)
    if out:
        last_id = int(out[-1]["id"])
    elif after_id is not None:
        last_id = after_id
    else:
        last_id = newest
    return {"events": out, "last_id": last_id, "more": more}
