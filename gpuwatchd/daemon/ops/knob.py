"""``knob``: set a knob of an attached job (the ``set_knob`` command to its hook).

Request: ``{"op": "knob", "params": {"job": J, "knob": K, "value": V, "wait_s": W}}``:
``job`` and ``knob`` strings, ``value`` a number or a boolean, ``wait_s`` (optional,
0..600 s, default 2) how long to wait for the job to apply it (e.g. at its next epoch);
the command itself stays open up to 600 s.

Reply: ``{"job", "knob", "value", "state", "decision_id"}`` with ``state``
``"applied"`` (every process of the job applied it) or ``"pending"`` (not answered
within ``wait_s``); ``decision_id`` is the request's decision in the journal.

Each request is journaled as a decision of policy ``operator`` (action ``set_knob``,
reason ``gpuwatchctl knob by uid N``) and its outcome (``applied`` with the command ids
``d-N`` sent to the job's processes, ``refused`` or ``failed`` with why) once known, so
``gpuwatchctl events`` shows it and a later ``superseded by request 'd-N'`` has a
trace. An applied value is remembered for the job's next ``hello``
(:mod:`gpuwatchd.control.knobmemory`, source ``operator``).

Errors: ``bad_request`` for bad params; the control server's code for a job that is not
attached (``not_found``); when a process refused it, the job's code (``bad_request``
for a value outside its bounds, ``conflict`` when superseded) with its reasons joined,
``conflict`` when the processes refused with different codes; ``internal`` when the
control server is not running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.actuators import DecisionRecord
from gpuwatchd.control.knobmemory import OPERATOR
from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import ErrorCode, Reply
from gpuwatchd.errors import ControlError, ProtocolError
from gpuwatchd.model import Decision

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
    record = target.record_decision(
        Decision(
            policy=OPERATOR,
            action="set_knob",
            params={"knob": knob, "value": value},
            timestamp_s=time.time(),
            findings=(),
            job=job,
            reason=f"gpuwatchctl knob by uid {peer.uid}",
        )
    )
    send = asyncio.ensure_future(
        commander.send_command(
            job,
            "set_knob",
            {"knob": knob, "value": value},
            timeout_s=COMMAND_TIMEOUT_S,
            source=OPERATOR,
        )
    )
    send.add_done_callback(lambda done: _finish(target, record, done))
    target.log.info("knob requested", job=job, knob=knob, value=value, action="set_knob")
    done, _ = await asyncio.wait({send}, timeout=float(wait_s))
    reply: dict[str, Any] = {"job": job, "knob": knob, "value": value}
    reply["decision_id"] = record.journal_id
    if not done:
        return reply | {"state": "pending"}
    try:
        replies = send.result()
    except ControlError as exc:
        raise ProtocolError(
            exc.code if exc.code in ErrorCode.ALL else ErrorCode.INTERNAL, exc.message
        ) from None
    refused = [r for r in replies if not r.ok]
    if refused:
        codes = {r.error_code for r in refused}
        code = codes.pop() if len(codes) == 1 else ErrorCode.CONFLICT
        if code not in ErrorCode.ALL:
            code = ErrorCode.CONFLICT
        raise ProtocolError(code, "; ".join(str(r.error_message) for r in refused))
    return reply | {"state": "applied"}


def _finish(
    target: ControlTarget, record: DecisionRecord, send: asyncio.Future[list[Reply]]
) -> None:
    """Journal what became of an operator's knob request once every process answered."""
    if send.cancelled():
        record.outcome, record.detail = "failed", "cancelled: the daemon stopped"
    elif send.exception() is not None:
        exc = send.exception()
        record.outcome = "failed"
        record.detail = exc.message if isinstance(exc, ControlError) else repr(exc)
    else:
        replies = send.result()
        refused = [r for r in replies if not r.ok]
        if refused:
            record.outcome = "refused"
            record.detail = "; ".join(
                f"request {r.id}: {r.error_code}: {r.error_message}" for r in refused
            )
        else:
            record.outcome = "applied"
            record.detail = "request " + ", ".join(str(r.id) for r in replies)
    record.finished_at_s = time.time()
    target.decision_done(record)
