"""``knob``: set a knob of an attached job (the ``set_knob`` command to its hook).

Request: ``{"op": "knob", "params": {"job": J, "knob": K, "value": V, "wait_s": W,
"hold_s": H}}``: ``job`` and ``knob`` strings, ``value`` a number or a boolean,
``wait_s`` (optional, 0..600 s, default 2) how long to wait for the job to apply it
(e.g. at its next epoch); the command itself stays open up to 600 s. ``hold_s``
(optional, 0..86400 s, default 1800) how long the change holds against policies: from
the request on, a policy's ``set_knob`` or ``tune_loader`` move on that knob of that job
is refused, naming this request (:mod:`gpuwatchd.policy.holds`); ``0`` places no hold
and ends the one in force. A later request on the same knob replaces the hold; a
request the job refuses or that fails ends it.

Reply: ``{"job", "knob", "value", "state", "decision_id"}`` with ``state``
``"applied"`` (every process of the job applied it) or ``"pending"`` (not answered
within ``wait_s``); ``decision_id`` is the request's decision in the journal.

Each request is journaled as a decision of policy ``operator`` (action ``set_knob``,
params ``{knob, value, hold_s, by_uid}``, reason ``gpuwatchctl knob by uid N``; the
holds of applied requests are rebuilt from these at daemon start) and its outcome
(``applied`` with the command ids ``d-N`` sent to the job's processes, ``refused`` or
``failed`` with why) once known, so ``gpuwatchctl events`` shows it. The command to the
job carries ``source: "operator"``, so a request it supersedes is answered
``superseded by operator (K=V)``, and one a policy supersedes names the policy. An
applied value is remembered for the job's next ``hello``
(:mod:`gpuwatchd.control.knobmemory`, source ``operator``).

Errors: ``bad_request`` for bad params; the control server's code for a job that is not
attached (``not_found``); when a process refused it, the job's code (``bad_request``
for a value outside its bounds, ``conflict`` when superseded) with its reasons joined,
``conflict`` when the processes refused with different codes; ``internal`` when the
control server is not running. ``bad_request`` for a ``hold_s`` outside 0..86400.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.actuators import DecisionRecord
from gpuwatchd.control.knobmemory import OPERATOR
from gpuwatchd.control.peercred import PeerCredentials
from gpuwatchd.control.protocol import ErrorCode, Op, Reply
from gpuwatchd.errors import ControlError, ProtocolError
from gpuwatchd.model import Decision
from gpuwatchd.policy import action_names
from gpuwatchd.policy.holds import DEFAULT_HOLD_S, KnobHold, check_hold_s

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.daemon.ops import ControlTarget

__all__ = ["COMMAND_TIMEOUT_S", "NAMES", "execute"]

NAMES: Final = (Op.KNOB,)
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
    try:
        hold_s = check_hold_s(params.get("hold_s", DEFAULT_HOLD_S))
    except ValueError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
    commander = target.commander()
    if commander is None:
        raise ProtocolError(ErrorCode.INTERNAL, "no control server")
    # before the command goes out: a tick meanwhile must not supersede it
    now = target.knob_holds.now()  # the hold's start is the journaled request's time
    held = target.knob_holds.hold(job, knob, value, uid=peer.uid, hold_s=hold_s, since_s=now)
    record = target.record_decision(
        Decision(
            policy=OPERATOR,
            action=action_names.SET_KNOB,
            params={"knob": knob, "value": value, "hold_s": hold_s, "by_uid": peer.uid},
            timestamp_s=now,
            findings=(),
            job=job,
            reason=f"gpuwatchctl knob by uid {peer.uid}",
        )
    )
    send = asyncio.ensure_future(
        commander.send_command(
            job,
            Op.SET_KNOB,
            {"knob": knob, "value": value},
            timeout_s=COMMAND_TIMEOUT_S,
            source=OPERATOR,
        )
    )
    send.add_done_callback(lambda done: _finish(target, record, held, done))
    target.log.info(
        "knob requested",
        job=job,
        knob=knob,
        value=value,
        action=action_names.SET_KNOB,
        hold_until_s=None if held is None else held.until_s,
    )
    done, _ = await asyncio.wait({send}, timeout=float(wait_s))
    reply: dict[str, Any] = {"job": job, "knob": knob, "value": value}
    reply["decision_id"] = record.journal_id
    reply["hold_until_s"] = None if held is None else held.until_s
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
    target: ControlTarget,
    record: DecisionRecord,
    held: KnobHold | None,
    send: asyncio.Future[list[Reply]],
) -> None:
    """Journal what became of an operator's knob request once every process answered;
    a request not applied ends its hold (unless a later request replaced it)."""
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
    if held is not None and record.outcome != "applied":
        holds = target.knob_holds
        if holds.active(held.job, held.knob) is held:
            holds.clear(held.job, held.knob)
    target.decision_done(record)
