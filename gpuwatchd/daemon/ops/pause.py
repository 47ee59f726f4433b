"""``pause`` / ``resume``: stop or restart carrying out decisions (detection goes on).

Request: ``{"op": "pause"}`` or ``{"op": "resume"}``, no params. While paused every
decision is journaled and logged as a dry run. Idempotent; logged with the caller's uid.

Reply: ``{"paused": bool}``, the state after the request.

Errors: none of its own (the server answers ``forbidden`` to a non-admin).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import Op

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.daemon.ops import ControlTarget

__all__ = ["NAMES", "execute"]

NAMES: Final = (Op.PAUSE, Op.RESUME)


async def execute(
    target: ControlTarget, op: str, params: Mapping[str, Any], peer: PeerCredentials
) -> dict[str, Any]:
    """Answer ``pause`` or ``resume`` (module docstring)."""
    target.set_paused(op == Op.PAUSE, by_uid=peer.uid)
    return {"paused": target.paused}
