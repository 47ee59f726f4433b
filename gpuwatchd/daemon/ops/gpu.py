"""``gpu.cordon`` / ``gpu.uncordon``: an operator cordons a GPU or lifts its cordon (admin).

Request: ``{"op": "gpu.cordon", "params": {"gpu": N}}`` (same for ``gpu.uncordon``):
``gpu`` the NVML index (an integer 0..1023).

``gpu.cordon``: no managed worker is placed on GPU N from now on, across daemon restarts
(``<state_dir>/cordons.json``); the managed workers on it are stopped and started at
once on other GPUs, their trials failed and re-enqueued (up to each job's
``optuna.max_retries``). Idempotent. ``gpu.uncordon``: lifts the cordon, whoever set it
(an operator or a policy's ``cordon_gpu``); nothing moves back. Logged with the
caller's uid. Contract: :mod:`gpuwatchd.cordon`.

Reply: ``{"gpu": N, "cordoned": bool, "detail": TEXT}`` (the state after the request and
what was done).

Errors: ``bad_request`` for a bad ``gpu``; ``conflict`` for ``gpu.uncordon`` of a GPU that
is not cordoned.
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

NAMES: Final = (Op.GPU_CORDON, Op.GPU_UNCORDON)
_MAX_INDEX: Final = 1023


async def execute(
    target: ControlTarget, op: str, params: Mapping[str, Any], peer: PeerCredentials
) -> dict[str, Any]:
    """Answer ``gpu.cordon`` or ``gpu.uncordon`` (module docstring)."""
    gpu = params.get("gpu")
    if isinstance(gpu, bool) or not isinstance(gpu, int) or not 0 <= gpu <= _MAX_INDEX:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"'gpu' must be an NVML index 0..{_MAX_INDEX}, not {gpu!r}"
        )
    cordon = op == Op.GPU_CORDON
    try:
        detail = await target.set_cordon(gpu, cordon, by_uid=peer.uid)
    except ActionRefused as exc:
        raise ProtocolError(ErrorCode.CONFLICT, exc.message) from None
    return {"gpu": gpu, "cordoned": cordon, "detail": detail}
