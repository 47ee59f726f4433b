"""Control protocol v1: newline-delimited JSON over a Unix stream socket (pure, no I/O).

Framing, the operations and who may call them: docs/protocol.md; the server's checks:
docs/protocol-internals.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from gpuwatchd.errors import ProtocolError

if TYPE_CHECKING:
    from gpuwatchd.control.peercred import PeerCredentials

__all__ = [
    "ADMIN_OPS",
    "CLIENT_OPS",
    "DEFAULT_SOCKET_PATH",
    "EVENT_MESSAGE_MAX_CHARS",
    "HOOK_CRASH_KINDS",
    "JOB_COMMAND_OPS",
    "JOB_ENV",
    "JOB_EVENT_KINDS",
    "JOB_OPS",
    "MAX_LINE_BYTES",
    "MAX_SOURCE_CHARS",
    "PROTOCOL_VERSION",
    "REPLY_BUDGET_BYTES",
    "SOCKET_ENV",
    "TRIAL_ATTR_WORKER_ID",
    "TRIAL_STATES",
    "WORKER_EXIT_LINE_PREFIX",
    "WORKER_ID_ENV",
    "EncodedResult",
    "EncodedText",
    "ErrorCode",
    "Op",
    "Reply",
    "Request",
    "RequestHandler",
    "command_source",
    "decode_line",
    "encode",
    "encode_result",
    "error_reply",
    "exit_line_of",
    "json_text",
    "ok_reply",
    "parse_reply",
    "request",
    "worker_exit_line",
]

PROTOCOL_VERSION: Final = 1
MAX_LINE_BYTES: Final = 64 * 1024
"""Largest line, newline included (docs/design.md, "Control protocol")."""
REPLY_BUDGET_BYTES: Final = 56 * 1024
"""What an op's reply may hold (``status``, ``events``): under :data:`MAX_LINE_BYTES`
with room for the reply's envelope."""
DEFAULT_SOCKET_PATH: Final = "/run/gpuwatchd/control.sock"
"""The control socket: systemd ``RuntimeDirectory=gpuwatchd`` + ``control.sock``
(docs/protocol.md); the daemon's ``socket:`` default, the clients' and the hook's."""
JOB_ENV: Final = "GPUWATCHD_JOB"
"""Environment variable naming the job for the hook (set by the supervisor for the
workers it launches: the configured job's name)."""
SOCKET_ENV: Final = "GPUWATCHD_SOCKET"
"""Environment variable naming the control socket for the clients and the hook (set by
the supervisor for the workers it launches); empty or unset means
:data:`DEFAULT_SOCKET_PATH`."""
EVENT_MESSAGE_MAX_CHARS: Final = 1000
"""Longest ``message`` of a job ``event``: the daemon refuses longer ones, the hook cuts
its messages to this length (docs/protocol.md)."""
JOB_EVENT_KINDS: Final = frozenset({"oom", "trial", "crash", "detach"})
"""``event.kind`` values a job sends (:class:`~gpuwatchd.model.JobEvent`)."""
TRIAL_STATES: Final = frozenset({"COMPLETE", "PRUNED", "FAIL"})
"""Final Optuna ``TrialState`` names a ``trial`` event may carry."""
HOOK_CRASH_KINDS: Final = frozenset(
    {"cuda_assert", "cuda_oom", "host_oom", "optuna_error", "other"}
)
"""``crash_kind`` values of a job's ``crash`` event (the hook's classes; the supervisor's
classifier has more: :data:`gpuwatchd.crash.CRASH_KINDS`)."""

WORKER_ID_ENV: Final = "GPUWATCHD_WORKER_ID"
"""Environment variable the supervisor sets for each worker launch: an id unique to that
process start (``<job>.<slot>.<32 hex digits>``), kept in the job's ``workers.json``."""
TRIAL_ATTR_WORKER_ID: Final = "gpuwatchd:worker_id"
"""Optuna trial user attr the hook writes when a trial starts in a managed worker: the
worker's :data:`WORKER_ID_ENV`. It names, in the storage itself, which worker launch ran
the trial, so a daemon that was down when the worker died still finds its trials."""

WORKER_EXIT_LINE_PREFIX: Final = "gpuwatchd-hook: worker exit "
"""Start of the line the hook writes to a managed worker's stderr from the process's exit
path (``atexit``) when no exception went uncaught: ``<prefix><worker id> pid <pid>
clean``, the pid of the launch's own process (a child that inherited the id and attached
writes its own pid, which does not count). The
supervisor takes it, from that launch's stderr, as positive evidence of a clean end
where it cannot read the exit status (docs/managed-jobs.md, "How a worker's end is
known"). ``os._exit``, ``abort()`` and any signal end the process without it."""


def worker_exit_line(worker_id: str, pid: int) -> str:
    """The exit line (newline included) of process ``pid`` of launch ``worker_id``
    (:data:`WORKER_ID_ENV`)."""
    return f"{WORKER_EXIT_LINE_PREFIX}{worker_id} pid {pid} clean\n"


def exit_line_of(stderr_text: str, worker_id: str | None, pid: int | None) -> bool:
    """Whether ``stderr_text`` (one launch's stderr, oldest first) holds the exit line of
    launch ``worker_id``'s process ``pid`` with no traceback or fatal error after it (an interpreter
    shutting down may still print, e.g. ``Exception ignored in``; a ``Traceback`` or
    ``Fatal Python error`` after the line means the exit was not clean). False for ``None``.
    """
    if not worker_id or pid is None:
        return False
    wanted = worker_exit_line(worker_id, pid).strip()
    lines = stderr_text.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].strip() == wanted:
            after = lines[index + 1 :]
            return not any(
                line.startswith(("Traceback (most recent call last)", "Fatal Python error"))
                for line in after
            )
    return False
    for line in reversed(stderr_text.splitlines()):
        if line.strip():
            return line.strip() == worker_exit_line(worker_id).strip()
    return False


class ErrorCode:
    """The stable error codes of protocol v1 (docs/protocol.md, "Framing")."""

    BAD_REQUEST: Final = "bad_request"
    UNKNOWN_OP: Final = "unknown_op"
    FORBIDDEN: Final = "forbidden"
    NOT_FOUND: Final = "not_found"
    CONFLICT: Final = "conflict"
    TOO_LARGE: Final = "too_large"
    INTERNAL: Final = "internal"

    ALL: Final = frozenset(
        {BAD_REQUEST, UNKNOWN_OP, FORBIDDEN, NOT_FOUND, CONFLICT, TOO_LARGE, INTERNAL}
    )


class Op:
    """The op names of protocol v1 (docs/protocol.md), defined here only: the hook,
    ``gpuwatchctl`` (gpuwatchd/cli/commands/), the server and the daemon's op modules
    (gpuwatchd/daemon/ops/, whose ``NAMES`` list these) all use them."""

    HELLO: Final = "hello"
    REPORT: Final = "report"
    EVENT: Final = "event"
    SET_KNOB: Final = "set_knob"
    DRAIN: Final = "drain"
    STOP: Final = "stop"
    STATUS: Final = "status"
    JOBS: Final = "jobs"
    POLICY_SHOW: Final = "policy.show"
    EVENTS: Final = "events"
    POLICY_RELOAD: Final = "policy.reload"
    KNOB: Final = "knob"
    PAUSE: Final = "pause"
    RESUME: Final = "resume"
    JOB_START: Final = "job.start"
    JOB_STOP: Final = "job.stop"
    JOB_RESTART: Final = "job.restart"
    GPU_CORDON: Final = "gpu.cordon"
    GPU_UNCORDON: Final = "gpu.uncordon"
    NODE_RESUME: Final = "node.resume"


JOB_OPS: Final = frozenset({Op.HELLO, Op.REPORT, Op.EVENT})
"""Ops a job connection sends to the daemon."""
CLIENT_OPS: Final = frozenset({Op.STATUS, Op.JOBS, Op.POLICY_SHOW, Op.EVENTS})
"""Read-only ops anyone who can open the socket may send."""
ADMIN_OPS: Final = frozenset(
    {
        Op.POLICY_RELOAD,
        Op.KNOB,
        Op.PAUSE,
        Op.RESUME,
        Op.JOB_START,
        Op.JOB_STOP,
        Op.JOB_RESTART,
        Op.GPU_CORDON,
        Op.GPU_UNCORDON,
        Op.NODE_RESUME,
    }
)
"""Ops that need root, the daemon's own user or the daemon's group."""
JOB_COMMAND_OPS: Final = frozenset({Op.SET_KNOB, Op.DRAIN, Op.STOP})
"""Ops the daemon sends to a job connection (the hook answers them)."""
MAX_SOURCE_CHARS: Final = 200
"""Longest ``source`` param of a ``set_knob`` command (who asked: ``policy <name>``,
``operator``); the daemon cuts a longer one, the hook ignores one that is longer."""


def command_source(params: Mapping[str, Any]) -> str | None:
    """The ``source`` of a daemon->job command's ``params``: a non-empty string of at most
    :data:`MAX_SOURCE_CHARS` characters without control characters, else None (a daemon
    that sends none, or a malformed one: the hook then names the request id)."""
    source = params.get("source")
    if not isinstance(source, str) or not source or len(source) > MAX_SOURCE_CHARS:
        return None
    if any(ord(c) < 32 or ord(c) == 127 for c in source):
        return None
    return source


"""Ops the daemon sends to a job connection."""

RequestId = str | int


class Request(NamedTuple):
    """A decoded request: its ``id``, ``op`` and the remaining fields as ``params``.

    (A named tuple, not a dataclass: importing :mod:`dataclasses` pulls in :mod:`inspect`
    and :mod:`ast`, a third of what ``gpuwatchctl status --json`` and the hook import.)"""

    id: RequestId
    op: str
    params: Mapping[str, Any]


class Reply(NamedTuple):
    """A decoded reply: ``result`` when ``ok``, else ``error_code`` and ``error_message``
    (a named tuple, as :class:`Request`)."""

    id: RequestId | None
    ok: bool
    result: Any = None
    error_code: str | None = None
    error_message: str | None = None


class EncodedResult(dict[str, Any]):
    """A result ``dict`` that carries its compact JSON text in ``json_text``, so that a
    big reply (``status``: 50 KiB with 64 jobs) is encoded once, not again by
    :func:`encode`. Do not change the dict after making it."""

    json_text: str = ""


class EncodedText:
    """A result held only as its compact JSON text (an object, ``{...}``): :func:`encode`
    splices ``json_text`` into the reply line as it is. ``status`` answers with one,
    assembled from parts encoded when they changed (:mod:`gpuwatchd.daemon.statusview`)."""

    __slots__ = ("json_text",)

    def __init__(self, json_text: str) -> None:
        self.json_text = json_text


def json_text(value: Any) -> str:
    """``value`` as compact JSON text, as :func:`encode` writes it (NA as null; ASCII
    only, so its length is its size in bytes).

    Raises :class:`ProtocolError` (``internal``) for values JSON cannot carry."""
    try:
        return _ENCODER.encode(value)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(ErrorCode.INTERNAL, f"cannot encode message: {exc}") from exc


def encode_result(result: dict[str, Any]) -> EncodedResult:
    """``result`` as an :class:`EncodedResult` (its JSON text as :func:`encode` writes it).

    Raises :class:`ProtocolError` (``internal``) for values JSON cannot carry."""
    out = EncodedResult(result)
    out.json_text = json_text(result)
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def encode(message: Mapping[str, Any]) -> bytes:
    """Serialise ``message`` as one protocol line (compact JSON + ``\\n``).

    Raises :class:`ProtocolError` (``too_large``) if the line would exceed
    :data:`MAX_LINE_BYTES`, and (``internal``) for values JSON cannot carry.
    """
    result = message.get("result")
    try:
        if (
            isinstance(result, (EncodedResult, EncodedText))
            and len(message) == 3
            and message.get("ok") is True
        ):
            request_id = json.dumps(message.get("id"))
            text = f'{{"id":{request_id},"ok":true,"result":{result.json_text}}}\n'
        else:
            text = _ENCODER.encode(message) + "\n"
    except (TypeError, ValueError) as exc:
        raise ProtocolError(ErrorCode.INTERNAL, f"cannot encode message: {exc}") from exc
    data = text.encode("utf-8")  # the newline in the text: one copy less of a big reply
    if len(data) > MAX_LINE_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"message of {len(data)} bytes exceeds {MAX_LINE_BYTES}"
        )
    return data


def _json_default(value: object) -> Any:
    # NA travels as null (nvidia-smi's [N/A]); tuples become lists in json itself.
    from gpuwatchd.model import NaType

    if isinstance(value, NaType):
        return None
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


_ENCODER: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=_json_default)
"""The one encoder of :func:`encode` and :func:`json_text` (``json.dumps`` with options
builds one per call: 5.3 against 2.6 us for a ``report``'s reply)."""

INT_MIN: Final = -(2**63)
INT_MAX: Final = 2**63 - 1
"""Integers a message may carry: SQLite's INTEGER (a signed 64-bit), where ids, cursors
and counts end up; anything beyond is refused as ``bad_request`` when the line is read."""


class _OutOfRange(ValueError):
    pass


def _short(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} characters)"


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 overflows to inf: not a number JSON can carry
        raise _OutOfRange(f"number {_short(text)} is out of range (finite floats only)")
    return value


def _parse_int(text: str) -> int:
    # 20 characters hold every 64-bit integer with its sign: longer ones are refused
    # before int() spends time on them (json's own limit is 4,300 digits).
    value = int(text) if len(text) <= 20 else INT_MAX + 1
    if not INT_MIN <= value <= INT_MAX:
        raise _OutOfRange(f"integer {_short(text)} is out of range (64-bit signed integers only)")
    return value


_DECODER: Final = json.JSONDecoder(
    parse_constant=_reject_constant, parse_float=_parse_float, parse_int=_parse_int
)
"""The one decoder of every line read (``json.loads`` with options builds one per call:
3 us of every ``report``)."""


def _loads(line: bytes) -> Any:
    # The limit counts the newline, so a stripped line may hold MAX_LINE_BYTES - 1 bytes.
    if len(line) >= MAX_LINE_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE, f"line of {len(line) + 1} bytes exceeds {MAX_LINE_BYTES}"
        )
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"line is not UTF-8: {exc.reason}") from exc
    try:
        if text.startswith("\ufeff"):  # as json.loads refuses it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        return _DECODER.decode(text)
    except _OutOfRange as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"line is not JSON: {exc}") from exc


def _check_id(value: object) -> RequestId:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'id' must be a string or an integer")
    if isinstance(value, str) and len(value) > 128:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'id' is longer than 128 characters")
    return value


def decode_line(line: bytes) -> Request | Reply:
    """Decode one line (with or without its trailing newline) into a Request or a Reply.

    A message with ``op`` is a :class:`Request`; one with ``ok`` is a :class:`Reply`.
    Raises :class:`ProtocolError` with code ``too_large`` (over :data:`MAX_LINE_BYTES`
    with the newline)
    or ``bad_request`` (not UTF-8, not JSON, not an object, bad ``id``/``op``).
    Whether the op exists and its params are valid is checked by the receiver.
    """
    message = _loads(line.rstrip(b"\r\n"))
    if not isinstance(message, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a message must be a JSON object")
    if "op" in message:
        op = message["op"]
        if not isinstance(op, str) or not op or len(op) > 64:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'op' must be a non-empty string")
        if "id" not in message:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a request needs an 'id'")
        request_id = _check_id(message["id"])
        params = {k: v for k, v in message.items() if k not in ("id", "op")}
        return Request(id=request_id, op=op, params=params)
    if "ok" in message:
        return parse_reply(message)
    raise ProtocolError(ErrorCode.BAD_REQUEST, "a message needs 'op' (request) or 'ok' (reply)")


def parse_reply(message: Mapping[str, Any]) -> Reply:
    """Turn a decoded reply object into a :class:`Reply`; raises ProtocolError if malformed."""
    ok = message.get("ok")
    if not isinstance(ok, bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'ok' must be a boolean")
    raw_id = message.get("id")
    reply_id = None if raw_id is None else _check_id(raw_id)
    if ok:
        return Reply(id=reply_id, ok=True, result=message.get("result"))
    error = message.get("error")
    if not isinstance(error, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a failed reply needs an 'error' object")
    return Reply(
        id=reply_id,
        ok=False,
        error_code=str(error.get("code", ErrorCode.INTERNAL)),
        error_message=str(error.get("message", "")),
    )


def request(request_id: RequestId, op: str, **params: Any) -> dict[str, Any]:
    """Build a request object ``{"id", "op", **params}``."""
    return {"id": request_id, "op": op, **params}


def ok_reply(request_id: RequestId | None, result: Any = None) -> dict[str, Any]:
    """Build a success reply ``{"id", "ok": true, "result"}``."""
    return {"id": request_id, "ok": True, "result": {} if result is None else result}


def error_reply(request_id: RequestId | None, code: str, message: str) -> dict[str, Any]:
    """Build a failure reply ``{"id", "ok": false, "error": {code, message}}``.

    ``code`` must be one of :class:`ErrorCode`; the message is cut to 1000 characters.
    """
    if code not in ErrorCode.ALL:
        code = ErrorCode.INTERNAL
    return {"id": request_id, "ok": False, "error": {"code": code, "message": message[:1000]}}


class RequestHandler(Protocol):
    """The daemon's handler for every request the server does not handle itself.

    Called with the decoded :class:`~gpuwatchd.control.protocol.Request` and the peer's
    credentials; returns the reply's ``result`` (any JSON-encodable value). Raises
    :class:`~gpuwatchd.errors.ProtocolError` (or :class:`~gpuwatchd.errors.ControlError`)
    with a protocol error code to send an error reply, e.g. ``unknown_op`` for an op it
    does not know. Any other exception becomes an ``internal`` reply and is logged.
    """

    async def __call__(self, request: Request, peer: PeerCredentials, /) -> Any:
        """Handle one request; see the class docstring."""
