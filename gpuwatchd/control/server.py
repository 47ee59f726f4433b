"""The daemon's side of the control socket: an asyncio Unix stream server for protocol v1.

The server owns the socket file and every connection. It handles the *job* half of the
protocol itself (``hello``, ``report``, ``event``, and the jobs' replies to daemon
commands), keeps
one :class:`~gpuwatchd.model.JobInfo` per attached job connection, and passes every
other request to a :class:`RequestHandler` supplied by the daemon (``status``, ``jobs``,
``policy.*``, ``knob``, ``pause``, ``resume``, and ops it does not know).

Rights come from ``SO_PEERCRED`` (see :mod:`gpuwatchd.control.peercred`): a job may only
speak for its own pid (root excepted); :data:`~gpuwatchd.control.protocol.ADMIN_OPS`
need root, the daemon's own user, or the admin group (design.md, "Control protocol").

Robustness: every connection is served by its own task, so a slow or broken client
never delays another. A malformed line gets a ``bad_request`` reply and the connection
stays open; a line over :data:`~gpuwatchd.control.protocol.MAX_LINE_BYTES` gets
``too_large`` and that connection is closed; a client that lets more than
:data:`MAX_WRITE_BUFFER_BYTES` of replies pile up is disconnected; a handler exception
becomes an ``internal`` reply and is logged.

This module must not import the daemon, sampling or policy modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import socket
import stat
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, TypeGuard

from gpuwatchd import __version__
from gpuwatchd.control.peercred import PeerCredentials, peer_credentials
from gpuwatchd.control.protocol import (
    ADMIN_OPS,
    JOB_COMMAND_OPS,
    MAX_LINE_BYTES,
    PROTOCOL_VERSION,
    ErrorCode,
    Reply,
    Request,
    decode_line,
    encode,
    error_reply,
    ok_reply,
    request,
)
from gpuwatchd.errors import ControlError, GpuwatchError, ProtocolError
from gpuwatchd.model import CudaMemory, JobEvent, JobInfo, JobReport, Knob, KnobValue

__all__ = [
    "CRASH_KINDS",
    "EVENT_KINDS",
    "EVENT_MESSAGE_MAX_CHARS",
    "JOB_NAME_MAX_CHARS",
    "MAX_CUDA_DEVICES_PER_REPORT",
    "MAX_INFLIGHT_PER_CONNECTION",
    "MAX_WRITE_BUFFER_BYTES",
    "SOCKET_MODE",
    "TRIAL_STATES",
    "ControlServer",
    "PeerCredentials",
    "RequestHandler",
]

SOCKET_MODE: Final = 0o660
"""Mode of the socket file: owner and group may connect (connect(2) needs write permission)."""
MAX_WRITE_BUFFER_BYTES: Final = 1024 * 1024
"""Replies queued for one client beyond this many bytes disconnect it (it does not read)."""
MAX_INFLIGHT_PER_CONNECTION: Final = 32
"""Handler requests one connection may have running at once; beyond it, reading pauses."""
JOB_NAME_MAX_CHARS: Final = 128
JOB_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A job name: letters, digits, ``.``, ``_``, ``-``; no leading ``-`` (it may reach an argv)."""
MAX_PENDING_COMMANDS: Final = 256
"""Daemon->job commands kept per connection awaiting a (possibly late) reply."""
MAX_CUDA_DEVICES: Final = 64
MAX_KNOBS: Final = 64
EVENTS_PER_S: Final = 10.0
"""Job ``event`` messages one connection may send per second (burst of the same size);
beyond that they are refused, so one job cannot flood the tick's queue or the log."""
_KNOB_NAME_MAX_CHARS: Final = 64
_STALE_PROBE_TIMEOUT_S: Final = 1.0
_CLOSE_TIMEOUT_S: Final = 5.0
_MAX_PENDING_EVENTS: Final = 10_000
"""Job events kept for the next tick at most (a tick drains them every second)."""
MAX_CUDA_DEVICES_PER_REPORT: Final = 64
"""Entries a report's ``cuda_memory`` list may hold (more than any node has GPUs)."""
EVENT_MESSAGE_MAX_CHARS: Final = 1000
"""Longest ``message`` of a job ``event``; the hook cuts its messages to this length."""
EVENT_KINDS: Final = frozenset({"oom", "trial", "crash", "detach"})
"""``event.kind`` values (:class:`~gpuwatchd.model.JobEvent`)."""
TRIAL_STATES: Final = frozenset({"COMPLETE", "PRUNED", "FAIL"})
"""Final Optuna ``TrialState`` names a ``trial`` event may carry."""
CRASH_KINDS: Final = frozenset({"cuda_assert", "cuda_oom", "host_oom", "other"})
"""``crash_kind`` values of a ``crash`` event."""
_TIMEOUT_MESSAGE: Final = "timeout"
_DISCONNECTED_MESSAGE: Final = "disconnected"


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


@dataclass
class _JobSession:
    session: int
    name: str
    pid: int
    connected_at_s: float
    cuda_devices: tuple[str, ...]
    knobs: dict[str, Knob]
    study: str | None
    trial_number: int | None
    last_report: JobReport | None = None

    def info(self) -> JobInfo:
        return JobInfo(
            name=self.name,
            pid=self.pid,
            connected_at_s=self.connected_at_s,
            cuda_devices=self.cuda_devices,
            knobs=dict(self.knobs),
            study=self.study,
            trial_number=self.trial_number,
            last_report=self.last_report,
        )


@dataclass
class _Connection:
    number: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    peer: PeerCredentials
    session: _JobSession | None = None
    closed: bool = False
    pending: dict[str, tuple[str, asyncio.Future[Reply]]] = field(default_factory=dict)
    """Daemon->job commands awaiting the job's reply: command id -> (op, future)."""
    inflight: set[asyncio.Task[None]] = field(default_factory=set)
    event_tokens: float = EVENTS_PER_S
    event_tokens_at: float = field(default_factory=time.monotonic)


class ControlServer:
    """Serve protocol v1 on a Unix stream socket at ``path``.

    ``handler`` answers the non-job ops (see :class:`RequestHandler`). ``admin_gid`` is
    the group whose members may use :data:`~gpuwatchd.control.protocol.ADMIN_OPS`.
    ``socket_gid`` is the group the socket file is given to (who may connect at all:
    jobs, ``gpuwatchctl status``); None keeps the process's group (systemd ``Group=``).
    The two differ on purpose: users whose jobs attach are not thereby admins.
    ``clock`` (seconds, default ``time.time``) stamps connections, reports and applied
    knobs. ``logger`` is a structlog-style logger (``logger.info("event", key=value)``);
    the default is ``structlog.get_logger("gpuwatchd.control")``. At most
    ``max_connections`` clients are served at once; further ones are closed on accept.

    Not thread-safe: call every method from the event loop that runs :meth:`start`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        handler: RequestHandler,
        *,
        admin_gid: int | None = None,
        socket_gid: int | None = None,
        clock: Callable[[], float] = time.time,
        logger: Any = None,
        max_connections: int = 256,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._path = Path(path)
        self._handler = handler
        self._admin_gid = admin_gid
        self._socket_gid = socket_gid
        self._clock = clock
        if logger is None:
            import structlog

            logger = structlog.get_logger("gpuwatchd.control")
        self._log: Any = logger
        self._max_connections = max_connections
        self._server: asyncio.AbstractServer | None = None
        self._socket_id: tuple[int, int] | None = None
        self._connections: dict[int, _Connection] = {}
        self._connection_tasks: set[asyncio.Task[Any]] = set()
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._next_connection = 0
        self._next_session = 0
        self._next_command = 0
        self._events: deque[JobEvent] = deque(maxlen=_MAX_PENDING_EVENTS)
        self._closing = False

    @property
    def path(self) -> Path:
        """The socket file's path."""
        return self._path

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Create the socket file and start accepting connections.

        Creates the parent directory (mode 0o755) if missing; removes a stale socket
        file (a socket nothing answers on); binds, sets mode 0o660 and, when
        ``socket_gid`` is given and the process may, the group, all *before* listening,
        so nobody connects through looser permissions.

        Raises :class:`~gpuwatchd.errors.GpuwatchError` if another process listens on
        the path ("another gpuwatchd is listening on ..."), if the path exists and is
        not a socket, or if the socket cannot be created (path too long, no permission).
        """
        if self._server is not None or self._closing:
            raise GpuwatchError(f"control server on {self._path} was already started")
        path = self._path
        try:
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise GpuwatchError(f"cannot create {path.parent}: {exc.strerror or exc}") from exc
        await self._remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound = False
        try:
            sock.bind(os.fspath(path))
            bound = True
            os.chmod(path, SOCKET_MODE)
            if self._socket_gid is not None:
                try:
                    os.chown(path, -1, self._socket_gid)
                except PermissionError as exc:
                    self._log.warning(
                        "control.chown_failed",
                        path=str(path),
                        gid=self._socket_gid,
                        error=exc.strerror or str(exc),
                    )
            info = os.stat(path)
            self._socket_id = (info.st_dev, info.st_ino)
            sock.setblocking(False)
            # The reader raises once a line's content exceeds `limit` bytes, so
            # MAX_LINE_BYTES - 1 keeps whole lines (newline included) within MAX_LINE_BYTES.
            self._server = await asyncio.start_unix_server(
                self._on_connect, sock=sock, limit=MAX_LINE_BYTES - 1
            )
        except OSError as exc:
            sock.close()
            if bound:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise GpuwatchError(f"cannot listen on {path}: {exc.strerror or exc}") from exc
        self._log.info(
            "control.listening", path=str(path), mode=oct(SOCKET_MODE), admin_gid=self._admin_gid
        )

    async def _remove_stale_socket(self, path: Path) -> None:
        try:
            info = path.lstat()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise GpuwatchError(f"cannot inspect {path}: {exc.strerror or exc}") from exc
        if not stat.S_ISSOCK(info.st_mode):
            raise GpuwatchError(f"{path} exists and is not a socket; refusing to replace it")
        try:
            _reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(os.fspath(path)), _STALE_PROBE_TIMEOUT_S
            )
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens: a leftover of a daemon that died
        except asyncio.TimeoutError as exc:
            raise GpuwatchError(f"another gpuwatchd is listening on {path} (busy)") from exc
        except OSError as exc:
            raise GpuwatchError(f"cannot probe {path}: {exc.strerror or exc}") from exc
        else:
            writer.close()
            raise GpuwatchError(f"another gpuwatchd is listening on {path}")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._log.info("control.stale_socket_removed", path=str(path))

    async def close(self) -> None:
        """Stop listening, close every connection and remove the socket file.

        Pending :meth:`send_command` calls resolve with ``disconnected`` replies. The
        socket file is removed only if it is still the one this server created.
        Idempotent; safe to call before :meth:`start`.
        """
        if self._closing:
            return
        self._closing = True
        server = self._server
        if server is not None:
            server.close()
        for conn in list(self._connections.values()):
            self._drop(conn, abort=True)
        tasks = list(self._handler_tasks | self._connection_tasks)
        current = asyncio.current_task()
        tasks = [task for task in tasks if task is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_TIMEOUT_S)
        if server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), _CLOSE_TIMEOUT_S)
            self._unlink_own_socket()
            self._log.info("control.closed", path=str(self._path))

    def _unlink_own_socket(self) -> None:
        try:
            info = self._path.lstat()
        except OSError:
            return
        if (info.st_dev, info.st_ino) == self._socket_id:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()

    # ------------------------------------------------------------------ queries

    @property
    def connection_count(self) -> int:
        """Open client connections (jobs, ``gpuwatchctl`` and others)."""
        return len(self._connections)

    def jobs(self) -> tuple[JobInfo, ...]:
        """The attached jobs, one :class:`~gpuwatchd.model.JobInfo` per job connection.

        Ordered by attach order; a job disappears when its connection closes.
        """
        sessions = [c.session for c in self._connections.values() if c.session and not c.closed]
        return tuple(s.info() for s in sorted(sessions, key=lambda s: s.session))

    def post_event(self, event: JobEvent) -> None:
        """Queue a job event (crash, OOM, trial outcome) for the next tick.

        Bounded: past :data:`_MAX_PENDING_EVENTS` unconsumed events the oldest go.
        """
        self._events.append(event)

    def drain_events(self) -> tuple[JobEvent, ...]:
        """Return and forget the job events queued since the previous call (the tick's)."""
        events = tuple(self._events)
        self._events.clear()
        return events

    def is_admin(self, peer: PeerCredentials) -> bool:
        """True if ``peer`` may use admin ops: uid 0, the daemon's own effective uid, or a
        member (primary or supplementary) of ``admin_gid``."""
        if peer.uid == 0 or peer.uid == os.geteuid():
            return True
        gid = self._admin_gid
        return gid is not None and (peer.gid == gid or gid in peer.groups)

    # ------------------------------------------------------------------ daemon -> job

    async def send_command(
        self,
        job: str,
        op: str,
        params: Mapping[str, Any],
        *,
        pid: int | None = None,
        timeout_s: float = 60.0,
    ) -> list[Reply]:
        """Send a daemon->job command to every connection of ``job`` (and ``pid``, if given).

        ``op`` is one of :data:`~gpuwatchd.control.protocol.JOB_COMMAND_OPS`
        (``set_knob`` with ``knob``/``value``, ``drain``, ``stop`` with ``reason``);
        each request gets an id ``"d-<n>"``. Returns one :class:`Reply` per connection,
        in attach order, once each job has answered; a job answers when it has *applied*
        the command (for a DataLoader knob: at the next epoch). A connection that does
        not answer within ``timeout_s`` seconds yields ``Reply(ok=False,
        error_code="internal", error_message="timeout")``; one that closes first yields
        ``error_code="conflict", error_message="disconnected"``. A ``set_knob`` reply that
        arrives after the timeout still updates the knob.

        Raises :class:`~gpuwatchd.errors.ControlError` ``not_found`` if no such job is
        attached, and ``bad_request``/``too_large``/``internal`` if ``op`` is not a job
        command or the message cannot be encoded.
        """
        if op not in JOB_COMMAND_OPS:
            raise ControlError(ErrorCode.BAD_REQUEST, f"{op!r} is not a job command")
        if "id" in params or "op" in params:
            raise ControlError(ErrorCode.BAD_REQUEST, "command params may not contain 'id' or 'op'")
        targets = [
            c
            for c in self._connections.values()
            if c.session is not None
            and not c.closed
            and c.session.name == job
            and (pid is None or c.session.pid == pid)
        ]
        if not targets:
            which = f"job {job!r}" if pid is None else f"job {job!r} with pid {pid}"
            raise ControlError(ErrorCode.NOT_FOUND, f"no {which} is attached")
        targets.sort(key=lambda c: c.session.session if c.session else 0)
        loop = asyncio.get_running_loop()
        waits = []
        for conn in targets:
            self._next_command += 1
            command_id = f"d-{self._next_command}"
            try:
                data = encode(request(command_id, op, **params))
            except ProtocolError as exc:
                raise ControlError(exc.code, exc.message) from exc
            future: asyncio.Future[Reply] = loop.create_future()
            if len(conn.pending) >= MAX_PENDING_COMMANDS:
                # A job that never answers: forget its oldest timed-out commands first.
                for stale in [k for k, (_, f) in conn.pending.items() if f.done()]:
                    del conn.pending[stale]
                    if len(conn.pending) < MAX_PENDING_COMMANDS:
                        break
            conn.pending[command_id] = (op, future)
            self._log.info(
                "control.command_sent", job=job, pid=_session_pid(conn), op=op, id=command_id
            )
            self._write(conn, data)  # on failure _drop() resolves the future "disconnected"
            waits.append(self._await_reply(command_id, future, timeout_s))
        return list(await asyncio.gather(*waits))

    async def _await_reply(
        self, command_id: str, future: asyncio.Future[Reply], timeout_s: float
    ) -> Reply:
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            # The pending entry stays: a late set_knob reply still updates the knob.
            return Reply(
                id=command_id,
                ok=False,
                error_code=ErrorCode.INTERNAL,
                error_message=_TIMEOUT_MESSAGE,
            )

    # ------------------------------------------------------------------ connections

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:
            writer.transport.abort()
            return
        if len(self._connections) >= self._max_connections:
            self._log.warning("control.too_many_connections", limit=self._max_connections)
            writer.transport.abort()
            return
        try:
            peer = peer_credentials(writer.get_extra_info("socket"))
        except OSError as exc:
            self._log.warning("control.peercred_failed", error=str(exc))
            writer.transport.abort()
            return
        self._next_connection += 1
        conn = _Connection(number=self._next_connection, reader=reader, writer=writer, peer=peer)
        self._connections[conn.number] = conn
        task = asyncio.current_task()
        if task is not None:
            self._connection_tasks.add(task)
        self._log.debug("control.connected", conn=conn.number, pid=peer.pid, uid=peer.uid)
        try:
            await self._serve(conn)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a bug here must not take the server down
            self._log.error("control.connection_failed", conn=conn.number, error=repr(exc))
        finally:
            self._drop(conn, abort=False)
            if task is not None:
                self._connection_tasks.discard(task)

    async def _serve(self, conn: _Connection) -> None:
        while not conn.closed:
            try:
                line = await conn.reader.readline()
            except (ValueError, asyncio.LimitOverrunError):
                self._send(
                    conn,
                    error_reply(None, ErrorCode.TOO_LARGE, f"line exceeds {MAX_LINE_BYTES} bytes"),
                )
                self._log.warning("control.line_too_large", conn=conn.number, pid=conn.peer.pid)
                return
            except OSError:
                return
            if not line.endswith(b"\n"):
                return  # EOF, possibly after half a line: nothing to answer
            if not line.strip():
                continue
            await self._dispatch_line(conn, line)

    def _drop(self, conn: _Connection, *, abort: bool) -> None:
        if self._connections.pop(conn.number, None) is None and conn.closed:
            return
        conn.closed = True
        for command_id, (_op, future) in conn.pending.items():
            if not future.done():
                future.set_result(
                    Reply(
                        id=command_id,
                        ok=False,
                        error_code=ErrorCode.CONFLICT,
                        error_message=_DISCONNECTED_MESSAGE,
                    )
                )
        conn.pending.clear()
        if conn.session is not None:
            self._log.info(
                "control.job_detached",
                job=conn.session.name,
                pid=conn.session.pid,
                session=conn.session.session,
            )
        if abort:
            conn.writer.transport.abort()
        else:
            conn.writer.close()
        self._log.debug("control.disconnected", conn=conn.number)

    def _write(self, conn: _Connection, data: bytes) -> bool:
        transport = conn.writer.transport
        if conn.closed or transport.is_closing():
            self._drop(conn, abort=True)
            return False
        conn.writer.write(data)
        if transport.get_write_buffer_size() > MAX_WRITE_BUFFER_BYTES:
            self._log.warning(
                "control.slow_reader_disconnected",
                conn=conn.number,
                pid=conn.peer.pid,
                buffered_bytes=transport.get_write_buffer_size(),
            )
            self._drop(conn, abort=True)
            return False
        return True

    def _send(self, conn: _Connection, reply: dict[str, Any]) -> bool:
        """Encode and queue a reply; a reply that cannot be encoded becomes an error reply."""
        try:
            data = encode(reply)
        except ProtocolError as exc:
            self._log.error("control.reply_unencodable", id=reply.get("id"), error=exc.message)
            data = encode(
                error_reply(reply.get("id"), exc.code, f"reply could not be encoded: {exc.message}")
            )
        return self._write(conn, data)

    # ------------------------------------------------------------------ dispatch

    async def _dispatch_line(self, conn: _Connection, line: bytes) -> None:
        try:
            message = decode_line(line)
        except ProtocolError as exc:
            self._log.debug("control.bad_line", conn=conn.number, error=exc.message)
            self._send(conn, error_reply(_salvage_id(line), exc.code, exc.message))
            return
        if isinstance(message, Reply):
            self._on_job_reply(conn, message)
            return
        req = message
        if req.op in ("hello", "report", "event"):
            try:
                if req.op == "hello":
                    result = self._hello(conn, req)
                elif req.op == "report":
                    result = self._report(conn, req)
                else:
                    result = self._event(conn, req)
            except ProtocolError as exc:
                self._send(conn, error_reply(req.id, exc.code, exc.message))
                return
            self._send(conn, ok_reply(req.id, result))
            return
        if req.op in JOB_COMMAND_OPS:
            self._send(
                conn,
                error_reply(
                    req.id,
                    ErrorCode.BAD_REQUEST,
                    f"{req.op!r} is sent by the daemon to jobs, not by clients",
                ),
            )
            return
        if req.op in ADMIN_OPS and not self.is_admin(conn.peer):
            self._log.info("control.forbidden", op=req.op, pid=conn.peer.pid, uid=conn.peer.uid)
            self._send(
                conn,
                error_reply(
                    req.id,
                    ErrorCode.FORBIDDEN,
                    f"{req.op!r} needs root, the daemon's user or the admin group",
                ),
            )
            return
        while len(conn.inflight) >= MAX_INFLIGHT_PER_CONNECTION:
            await asyncio.wait(conn.inflight, return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.ensure_future(self._run_handler(conn, req))
        conn.inflight.add(task)
        self._handler_tasks.add(task)
        task.add_done_callback(conn.inflight.discard)
        task.add_done_callback(self._handler_tasks.discard)

    async def _run_handler(self, conn: _Connection, req: Request) -> None:
        try:
            result = await self._handler(req, conn.peer)
        except (ProtocolError, ControlError) as exc:
            code = exc.code if exc.code in ErrorCode.ALL else ErrorCode.INTERNAL
            reply = error_reply(req.id, code, exc.message)
        except Exception as exc:
            self._log.error(
                "control.handler_failed",
                op=req.op,
                pid=conn.peer.pid,
                error=repr(exc),
                exc_info=True,
            )
            reply = error_reply(
                req.id, ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
            )
        else:
            reply = ok_reply(req.id, result)
        self._send(conn, reply)

    def _on_job_reply(self, conn: _Connection, reply: Reply) -> None:
        entry = conn.pending.get(reply.id) if isinstance(reply.id, str) else None
        if entry is None:
            self._log.debug("control.unexpected_reply", conn=conn.number, id=reply.id)
            return
        op, future = entry
        del conn.pending[reply.id]  # type: ignore[arg-type]  # str checked above
        if reply.ok and op == "set_knob" and conn.session is not None:
            self._apply_knob(conn.session, reply.result)
        self._log.info(
            "control.command_done",
            job=conn.session.name if conn.session else None,
            id=reply.id,
            op=op,
            ok=reply.ok,
            error=reply.error_code,
        )
        if not future.done():
            future.set_result(reply)

    def _apply_knob(self, session: _JobSession, result: Any) -> None:
        if not isinstance(result, Mapping):
            return
        name = result.get("knob")
        value = result.get("value")
        if not isinstance(name, str) or not _is_knob_value(value):
            self._log.warning("control.bad_set_knob_reply", job=session.name, result=repr(result))
            return
        old = session.knobs.get(name)
        session.knobs[name] = Knob(
            name=name,
            value=value,
            min=old.min if old else None,
            max=old.max if old else None,
            applied_at_s=self._clock(),
        )
        self._log.info("control.knob_applied", job=session.name, knob=name, value=value)

    # ------------------------------------------------------------------ job ops

    def _hello(self, conn: _Connection, req: Request) -> dict[str, Any]:
        if conn.session is not None:
            raise ProtocolError(ErrorCode.CONFLICT, "this connection already said hello")
        params = req.params
        if params.get("role") != "job":
            raise ProtocolError(ErrorCode.BAD_REQUEST, 'hello needs "role": "job"')
        name = params.get("job")
        if (
            not isinstance(name, str)
            or len(name) > JOB_NAME_MAX_CHARS
            or not JOB_NAME_PATTERN.fullmatch(name)
        ):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"'job' must be 1-{JOB_NAME_MAX_CHARS} letters, digits, '.', '_' or '-', "
                "not starting with '-'",
            )
        pid = params.get("pid")
        if not _is_int(pid) or pid <= 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'pid' must be a positive integer")
        if pid != conn.peer.pid and conn.peer.uid != 0:
            raise ProtocolError(ErrorCode.FORBIDDEN, "a job may only speak for its own pid")
        owner = self._job_owner(name)
        if owner is not None and owner != conn.peer.uid and conn.peer.uid != 0:
            # A name is bound to the user whose processes hold it: nobody else may pose as
            # that job (and so draw its knob changes or report crashes in its name).
            raise ProtocolError(
                ErrorCode.FORBIDDEN, f"job {name!r} is attached by another user (uid {owner})"
            )
        cuda_devices = params.get("cuda_devices")
        if cuda_devices is None:
            cuda_devices = []
        if (
            not isinstance(cuda_devices, list)
            or len(cuda_devices) > MAX_CUDA_DEVICES
            or not all(isinstance(d, str) and len(d) <= 64 for d in cuda_devices)
        ):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"'cuda_devices' must be a list of at most {MAX_CUDA_DEVICES} short strings",
            )
        raw_knobs = params.get("knobs")
        if isinstance(raw_knobs, dict) and len(raw_knobs) > MAX_KNOBS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"at most {MAX_KNOBS} knobs")
        knobs = _parse_knobs(raw_knobs)
        study = params.get("study")
        if study is not None and not isinstance(study, str):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'study' must be a string or null")
        trial_number = _trial_number(params.get("trial"))
        self._next_session += 1
        conn.session = _JobSession(
            session=self._next_session,
            name=name,
            pid=pid,
            connected_at_s=self._clock(),
            cuda_devices=tuple(cuda_devices),
            knobs=knobs,
            study=study,
            trial_number=trial_number,
        )
        self._log.info(
            "control.job_attached",
            job=name,
            pid=pid,
            session=self._next_session,
            knobs={k: v.value for k, v in knobs.items()},
            cuda_devices=list(cuda_devices),
            study=study,
            trial=trial_number,
        )
        return {
            "protocol": PROTOCOL_VERSION,
            "daemon_version": __version__,
            "session": self._next_session,
        }

    def _report(self, conn: _Connection, req: Request) -> dict[str, Any]:
        """Validate a ``report`` whole, then store it (a bad one changes nothing).

        Required: ``steps``, ``epoch``, ``step_time_s``, ``data_wait_s``,
        ``data_wait_fraction``, ``samples_per_s``. Optional: ``cuda_memory``,
        ``oom_events``, ``knobs`` (current values; a change is recorded as applied now)
        and ``trial`` (``{number, params}`` or null: the trial the job runs now).
        Unknown keys are ignored, so that a newer hook can talk to an older daemon.
        """
        session = conn.session
        if session is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "say hello (role: job) before 'report'")
        body = req.params.get("report")
        if not isinstance(body, dict):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'report' must be an object")
        report = JobReport(
            timestamp_s=self._clock(),
            steps=_count(body, "steps"),
            epoch=_count(body, "epoch"),
            step_time_s=_seconds(body, "step_time_s"),
            data_wait_s=_seconds(body, "data_wait_s"),
            data_wait_fraction=_fraction(body, "data_wait_fraction"),
            samples_per_s=_seconds(body, "samples_per_s"),
            cuda_memory=_cuda_memory(body.get("cuda_memory")),
            oom_events=_count(body, "oom_events") if "oom_events" in body else 0,
        )
        knob_values = _report_knobs(body.get("knobs"), session.knobs)
        trial_number = session.trial_number
        if "trial" in body:
            trial_number = _trial_number(body["trial"])
        # Everything is valid: apply.
        session.last_report = report
        if trial_number != session.trial_number:
            self._log.info(
                "control.job_trial", job=session.name, pid=session.pid, trial=trial_number
            )
            session.trial_number = trial_number
        now = report.timestamp_s
        for name, value in knob_values.items():
            old = session.knobs[name]
            if old.value == value:  # same kind: bool-ness checked by _report_knobs
                continue
            session.knobs[name] = Knob(name, value, old.min, old.max, applied_at_s=now)
            self._log.info(
                "control.knob_applied", job=session.name, knob=name, value=value, source="job"
            )
        return {}

    def _job_owner(self, name: str) -> int | None:
        """The uid of the live job connections named ``name``, or None if none is attached."""
        for conn in self._connections.values():
            if conn.session is not None and not conn.closed and conn.session.name == name:
                return conn.peer.uid
        return None

    def _event(self, conn: _Connection, req: Request) -> dict[str, Any]:
        """Validate a job ``event`` and queue it as a :class:`JobEvent` for the next tick.

        The event is stamped with the server's clock and the session's job name and pid;
        ``trial_number`` defaults to the session's current trial. At most
        :data:`EVENTS_PER_S` per connection (a token bucket); more get ``conflict``.
        """
        session = conn.session
        if session is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "say hello (role: job) before 'event'")
        now = time.monotonic()
        conn.event_tokens = min(
            EVENTS_PER_S, conn.event_tokens + (now - conn.event_tokens_at) * EVENTS_PER_S
        )
        conn.event_tokens_at = now
        if conn.event_tokens < 1.0:
            raise ProtocolError(
                ErrorCode.CONFLICT, f"more than {EVENTS_PER_S:g} events per second; slow down"
            )
        conn.event_tokens -= 1.0
        body = req.params.get("event")
        if not isinstance(body, dict):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "'event' must be an object")
        kind = body.get("kind")
        if kind not in EVENT_KINDS:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"event 'kind' must be one of {sorted(EVENT_KINDS)}"
            )
        trial_state = _choice(body, "trial_state", TRIAL_STATES, required=kind == "trial")
        crash_kind = _choice(body, "crash_kind", CRASH_KINDS, required=kind == "crash")
        trial_number = session.trial_number
        if body.get("trial_number") is not None:
            trial_number = _trial_number({"number": body["trial_number"]})
        message = body.get("message", "")
        if message is None:
            message = ""
        if not isinstance(message, str) or len(message) > EVENT_MESSAGE_MAX_CHARS:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"event 'message' must be a string of at most {EVENT_MESSAGE_MAX_CHARS} characters",
            )
        event = JobEvent(
            timestamp_s=self._clock(),
            job=session.name,
            kind=kind,
            pid=session.pid,
            crash_kind=crash_kind,
            trial_number=trial_number,
            trial_state=trial_state,
            message=message,
        )
        self.post_event(event)
        self._log.info(
            "control.job_event",
            job=session.name,
            pid=session.pid,
            kind=kind,
            crash_kind=crash_kind,
            trial=trial_number,
            trial_state=trial_state,
            message=message[:200],
        )
        return {}


# ---------------------------------------------------------------------- validation helpers


def _session_pid(conn: _Connection) -> int | None:
    return conn.session.pid if conn.session else None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and math.isfinite(value)


def _is_knob_value(value: object) -> TypeGuard[KnobValue]:
    return isinstance(value, bool) or _is_number(value)


def _count(body: Mapping[str, Any], key: str) -> int:
    value = body.get(key)
    if not _is_int(value) or value < 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"report '{key}' must be a non-negative integer")
    return int(value)


def _seconds(body: Mapping[str, Any], key: str) -> float:
    value = body.get(key)
    if not _is_number(value) or value < 0:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"report '{key}' must be a finite non-negative number"
        )
    return float(value)


def _fraction(body: Mapping[str, Any], key: str) -> float:
    value = _seconds(body, key)
    if value > 1.0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"report '{key}' must be between 0 and 1")
    return value


def _cuda_memory(raw: object) -> tuple[CudaMemory, ...]:
    """A report's ``cuda_memory`` list -> CudaMemory tuple (``None``/absent: empty)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_CUDA_DEVICES_PER_REPORT:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"report 'cuda_memory' must be a list of at most {MAX_CUDA_DEVICES_PER_REPORT} objects",
        )
    entries: list[CudaMemory] = []
    seen: set[int] = set()
    for item in raw:
        if not isinstance(item, dict):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "report 'cuda_memory' items must be objects")
        fields = ("device", "allocated_bytes", "reserved_bytes", "peak_allocated_bytes")
        values: list[int] = []
        for key in fields:
            value = item.get(key)
            if not _is_int(value) or value < 0:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"report 'cuda_memory' {key!r} must be a non-negative integer",
                )
            values.append(value)
        if values[0] in seen:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"report 'cuda_memory' lists device {values[0]} twice"
            )
        seen.add(values[0])
        entries.append(CudaMemory(*values))
    return tuple(entries)


def _report_knobs(raw: object, declared: Mapping[str, Knob]) -> dict[str, KnobValue]:
    """A report's ``knobs`` ``{name: value}``: declared names, right kind, within bounds."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "report 'knobs' must be an object {name: value}")
    values: dict[str, KnobValue] = {}
    for name, value in raw.items():
        knob = declared.get(name)
        if knob is None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"report 'knobs': {name!r} was not declared in hello"
            )
        if not _is_knob_value(value) or isinstance(value, bool) != isinstance(knob.value, bool):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"report 'knobs': {name!r} must be a {type(knob.value).__name__}",
            )
        problem = knob.bounds_error(value)
        if problem is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"report 'knobs': {problem}")
        values[name] = value
    return values


def _trial_number(raw: object) -> int | None:
    """``{number, params}`` or null -> the trial number (None without one)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'trial' must be {number, params} or null")
    number = raw.get("number")
    if number is not None and (not _is_int(number) or number < 0):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "'trial.number' must be a non-negative integer or null"
        )
    if not isinstance(raw.get("params") or {}, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'trial.params' must be an object")
    return number


def _choice(
    body: Mapping[str, Any], key: str, allowed: frozenset[str], *, required: bool
) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"this event needs {key!r} (one of {sorted(allowed)})",
            )
        return None
    if value not in allowed:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"event {key!r} must be one of {sorted(allowed)}"
        )
    return str(value)


def _parse_knobs(raw: object) -> dict[str, Knob]:
    """``{name: {value, min?, max?}}`` -> Knob objects; ProtocolError bad_request if malformed."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'knobs' must be an object {name: {value, ...}}")
    knobs: dict[str, Knob] = {}
    for name, spec in raw.items():
        if not name or len(name) > _KNOB_NAME_MAX_CHARS:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"knob names must be 1..{_KNOB_NAME_MAX_CHARS} characters",
            )
        if not isinstance(spec, dict) or not _is_knob_value(spec.get("value")):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"knob {name!r} must be {{value: int|float|bool, min?, max?}}",
            )
        value: KnobValue = spec["value"]
        low = spec.get("min")
        high = spec.get("max")
        for bound, label in ((low, "min"), (high, "max")):
            if bound is not None and not _is_number(bound):
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"knob {name!r} '{label}' must be a number or null"
                )
        if low is not None and high is not None and low > high:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"knob {name!r} has min > max")
        knob = Knob(name=name, value=value, min=low, max=high)
        problem = knob.bounds_error(value)
        if problem is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, problem)
        knobs[name] = knob
    return knobs


def _salvage_id(line: bytes) -> str | int | None:
    """The ``id`` of a line that failed validation, if it is at least an object with a valid id."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(message, dict):
        return None
    value = message.get("id")
    if isinstance(value, bool):
        return None
    if isinstance(value, int) or (isinstance(value, str) and len(value) <= 128):
        return value
    return None
