"""``status``: the daemon's state in one stable JSON object.

Request: ``{"op": "status"}``, optional ``full`` (bool, default false: each policy of
``policies.policies[]`` as ``{"name"}`` alone; true: its whole definition). Other params
are ignored.

Reply: the object ``gpuwatchctl status --json`` prints (docs/cli.md, "gpuwatchctl status
--json"): ``version``, ``pid``, ``uptime_s``, ``ticks``, ``gpus``, ``host``, ``jobs``,
``managed``, ``policies``, ``paused``, ``findings``, ``decisions``, ``xid_events``,
``journal``, ... and ``truncated``: ``{"decisions": N, "findings": M, "jobs": J}``, how
many of the oldest decisions and findings, then of the last attached jobs, were left out
to keep the reply under :data:`~gpuwatchd.control.protocol.REPLY_BUDGET_BYTES` (one
protocol line). The daemon answers from :class:`gpuwatchd.daemon.statusview.StatusView`;
:func:`fit` fits the object built whole (``Daemon.status()``, the tests' fake daemon).

Errors: ``bad_request`` for a ``full`` that is not a boolean.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import REPLY_BUDGET_BYTES, ErrorCode, Op, encode_result
from gpuwatchd.errors import ProtocolError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.daemon.ops import ControlTarget

__all__ = ["NAMES", "execute", "fit"]

NAMES: Final = (Op.STATUS,)


def _json_size(value: Any) -> int:
    """Bytes of ``value`` as a protocol line would carry it (NA and the like as null)."""
    return len(json.dumps(value, separators=(",", ":"), default=lambda _: None).encode())


def fit(status: dict[str, Any], budget_bytes: int = REPLY_BUDGET_BYTES) -> dict[str, Any]:
    """Drop the oldest ``decisions``, then ``findings``, until ``status`` fits the budget.

    Adds ``truncated`` (counts left out); changes and returns ``status`` (when it fits
    at once, the usual case, as an :class:`~gpuwatchd.control.protocol.EncodedResult`,
    so the reply is encoded only once).
    """
    truncated = {"decisions": 0, "findings": 0}
    status["truncated"] = truncated
    try:
        encoded = encode_result(status)
    except ProtocolError:
        encoded = None  # the server's encode() reports it
    if encoded is not None and len(encoded.json_text.encode()) <= budget_bytes:
        return encoded
    for key in ("decisions", "findings"):
        while status[key] and _json_size(status) > budget_bytes:
            status[key].pop(0)
            truncated[key] += 1
    return status


async def execute(
    target: ControlTarget, op: str, params: Mapping[str, Any], peer: PeerCredentials
) -> Any:
    """Answer ``status`` (module docstring)."""
    full = params.get("full", False)
    if not isinstance(full, bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'full' must be true or false")
    return target.status_reply(full=full)
