"""``knob``: set a knob of an attached job (the ``set_knob`` command to its hook).

Request: ``{"op": "knob", "params": {"job": J, "knob": K, "value": V, "wait_s": W}}``:
``job`` and ``knob`` strings, ``value`` a number or a boolean, ``wait_s`` (optional,
0..600 s, default 2) how long to wait for the job to apply it (e.g. at its next epoch);
the command itself stays open up to 600 s.

Reply: ``{"job", "knob", "value", "state"}`` with ``state`` ``"applied"`` (every
process of the job applied it) or ``"pending"`` (not answered within ``wait_s``).

Errors: ``bad_request`` for bad params; the control server's code for a job that is not
attached (``not_found``); ``conflict`` when a process refused it
(its errors joined); ``internal`` when the control server is not running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import ErrorCode
from gpuwatchd.errors import ControlError, ProtocolError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.daemon.ops import ControlTarget

__all__ = ["COMMAND_TIMEOUT_S", "NAMES", "execute"]

NAMES: Final = ("knob",)
COMMAND_TIMEOUT_S: Final = 600.0
"""How long the ``set_knob`` command waits for the job, whatever ``wait_s`` is."""


async def execute(
    target: ControlTarget, op: str, params: Mapping[str, Any], peer: PeerCredentials
) -> dict[str, Any]:
    """Answer ``knob`` (module docstring)."""
    job, knob, value = params.get("job"), params.get("knob"), params.get("value")
    if not isinstance(job, str) or not isinstance(knob, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'job' and 'knob' must be strings")
    if isinstance(value, (dict, list)) or value is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'value' must be a number or a boolean")
    wait_s = params.get("wait_s", 2.0)
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= 600:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'wait_s' must be a number of seconds, 0-600")
    commander = target.commander()
    if commander is None:
        raise ProtocolError(ErrorCode.INTERNAL, "no control server")
    send = asyncio.ensure_future(
        commander.send_command(
            job, "set_knob", {"knob": knob, "value": value}, timeout_s=COMMAND_TIMEOUT_S
        )
    )
    target.log.info("knob requested", job=job, knob=knob, value=value, action="set_knob")
    done, _ = await asyncio.wait({send}, timeout=float(wait_s))
    if not done:
        return {"job": job, "knob": knob, "value": value, "state": "pending"}
    try:
        replies = send.result()
    except ControlError as exc:
        raise ProtocolError(
            exc.code if exc.code in ErrorCode.ALL else ErrorCode.INTERNAL, exc.message
        ) from None
    refused = [r for r in replies if not r.ok]
    if refused:
        raise ProtocolError(
            ErrorCode.CONFLICT, "; ".join(f"{r.error_code}: {r.error_message}" for r in refused)
        )
    return {"job": job, "knob": knob, "value": value, "state": "applied"}
