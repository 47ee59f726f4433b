"""``job.start`` / ``job.stop`` / ``job.restart``: an operator starts or stops a managed job.

Request: ``{"op": "job.start", "params": {"job": J}}`` (same for ``job.stop`` and
``job.restart``): ``job`` a managed job's name (a string of at most 200 characters).

``job.stop``: every worker of the job gets SIGTERM (SIGKILL after its
``restart.stop_timeout``); the trials they ran are failed and re-enqueued as for any stop
by gpuwatchd, before the reply; the slots stay stopped, across daemon restarts too, until
``job.start``.
``job.start``: the job's slots that run nothing (finished, stopped by an operator, failed
in a crash loop, out of restart budget) start again, up to its parallelism, with their
crash-loop counts reset. ``job.restart``: ``job.stop`` then ``job.start``. Logged with the
caller's uid.

Reply: ``{"job": J, "stopped": N, "started": M}`` (workers stopped / started by the op).

Errors: ``bad_request`` for bad params; ``not_found`` for a job that is not managed
(or no ``jobs:`` in the config); ``conflict`` from the supervisor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import ErrorCode, Op
from gpuwatchd.errors import ProtocolError, SupervisorError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.daemon.ops import ControlTarget

__all__ = ["NAMES", "execute"]

NAMES: Final = (Op.JOB_START, Op.JOB_STOP, Op.JOB_RESTART)
_NAME_MAX: Final = 200


async def execute(
    target: ControlTarget, op: str, params: Mapping[str, Any], peer: PeerCredentials
) -> dict[str, Any]:
    """Answer ``job.start``, ``job.stop`` or ``job.restart`` (module docstring)."""
    job = params.get("job")
    if not isinstance(job, str) or not job or len(job) > _NAME_MAX:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'job' must be a managed job's name")
    action = op.split(".", 1)[1]
    try:
        stopped, started = await target.control_job(job, action, by_uid=peer.uid)
    except SupervisorError as exc:
        code = exc.code if exc.code in ErrorCode.ALL else ErrorCode.INTERNAL
        raise ProtocolError(code, exc.message) from None
    return {"job": job, "stopped": stopped, "started": started}
