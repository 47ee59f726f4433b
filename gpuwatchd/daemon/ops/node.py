"""``node.resume``: an operator returns this node to service in Slurm (admin).

Request: ``{"op": "node.resume"}``. Runs ``scontrol update NodeName=<this node>
State=RESUME`` (the node named by the config's ``slurm.node``), undoing a ``drain_node``
(or any drain). Journaled as a decision of policy ``operator`` (action ``resume_node``,
params ``node``, ``by_uid``). Contract: docs/slurm.md.

Reply: ``{"node": NAME, "detail": TEXT}`` (``detail`` names the state Slurm reports after).

Errors: ``conflict`` without a ``slurm:`` section or when Slurm refuses (the text of
``scontrol``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import ErrorCode, Op
from gpuwatchd.errors import ActionRefused, ProtocolError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.daemon.ops import ControlTarget

__all__ = ["NAMES", "execute"]

NAMES: Final = (Op.NODE_RESUME,)


async def execute(
    target: ControlTarget, op: str, params: Mapping[str, Any], peer: PeerCredentials
) -> dict[str, Any]:
    """Answer ``node.resume`` (module docstring)."""
    try:
        node, detail = await target.resume_node(by_uid=peer.uid)
    except ActionRefused as exc:
        raise ProtocolError(ErrorCode.CONFLICT, exc.message) from None
    return {"node": node, "detail": detail}
