"""``jobs``: the jobs attached over the control socket and the managed jobs.

Request: ``{"op": "jobs"}``, no params.

Reply: ``{"jobs": [...], "managed": [...]}``: each attached job as in ``status``
(its hook's last report plus ``process``, the host's view of its pid, or null); each
managed job as the supervisor sees it plus ``ladder``, ``on_daemon_stop`` and ``study``.
``managed`` is ``[]`` without ``jobs:`` in the config.

Errors: none of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import Op

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.daemon.ops import ControlTarget

__all__ = ["NAMES", "execute"]

NAMES: Final = (Op.JOBS,)


async def execute(
    target: ControlTarget, op: str, params: Mapping[str, Any], peer: PeerCredentials
) -> dict[str, Any]:
    """Answer ``jobs`` (module docstring)."""
    return target.jobs_report()
