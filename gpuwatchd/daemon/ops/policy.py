"""``policy.show`` / ``policy.reload``: the running policies, and swapping in new ones.

Request: ``{"op": "policy.show"}``; ``{"op": "policy.reload", "params": {"path": P}}``
with ``path`` optional (a file or directory; without it the configured sources are read
again, as SIGHUP does). Only root may name a ``path``: the daemon runs as root, and
loading a file a caller names would read any file for them (errors quote its lines) and
run its ``exec`` actions as root.

Reply (both): the policy set (``policies``, ``sources``, ...) plus ``loaded_at_s``,
``paused`` and ``dry_run``. A reload is all or nothing.

Errors: ``bad_request`` for a ``path`` that is not a string or a broken policy file
(message with file and line; the running policies stay); ``forbidden`` for a ``path``
from a caller other than root.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import ErrorCode, Op
from gpuwatchd.errors import PolicyError, ProtocolError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.daemon.ops import ControlTarget

__all__ = ["NAMES", "execute"]

NAMES: Final = (Op.POLICY_SHOW, Op.POLICY_RELOAD)


async def execute(
    target: ControlTarget, op: str, params: Mapping[str, Any], peer: PeerCredentials
) -> dict[str, Any]:
    """Answer ``policy.show`` or ``policy.reload`` (module docstring)."""
    if op == Op.POLICY_RELOAD:
        path = params.get("path")
        if path is not None and not isinstance(path, str):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'path' must be a string")
        if path is not None and peer.uid != 0:
            raise ProtocolError(
                ErrorCode.FORBIDDEN,
                "only root may reload policies from a path; admins reload the configured "
                "policy files (gpuwatchctl policy reload without PATH)",
            )
        try:
            await target.reload_policies(path)
        except PolicyError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
    return target.policies_report()
