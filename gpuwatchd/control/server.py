"""The daemon's side of the control socket: an asyncio Unix stream server for protocol v1.

It owns the socket file and every connection, answers the job half of the protocol
(:mod:`~gpuwatchd.control.sessions`) and passes every other request to the daemon's
:class:`RequestHandler`. Rights, limits and robustness: docs/protocol-internals.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from gpuwatchd import __version__
from gpuwatchd.control import socketfile
from gpuwatchd.control.fairness import Admission, ConnectionLimits, LogLimiter
from gpuwatchd.control.knobmemory import KnobMemory
from gpuwatchd.control.messages import (
    JOB_NAME_MAX_CHARS,
    MAX_CUDA_DEVICES_PER_REPORT,
    salvage_id,
)
from gpuwatchd.control.peercred import PeerCredentials, peer_credentials
from gpuwatchd.control.protocol import (
    ADMIN_OPS,
    JOB_COMMAND_OPS,
    JOB_OPS,
    MAX_LINE_BYTES,
    MAX_SOURCE_CHARS,
    PROTOCOL_VERSION,
    ErrorCode,
    Op,
    Reply,
    Request,
    RequestHandler,
    decode_line,
    encode,
    error_reply,
    ok_reply,
    request,
)
from gpuwatchd.control.sessions import EVENTS_PER_S, Connection, JobSession, open_session
from gpuwatchd.control.socketfile import SOCKET_MODE
from gpuwatchd.errors import ControlError, GpuwatchError, ProtocolError
from gpuwatchd.model import CgroupIdentity, JobEvent, JobInfo

__all__ = [
    "JOB_NAME_MAX_CHARS",
    "MAX_CUDA_DEVICES_PER_REPORT",
    "MAX_INFLIGHT_PER_CONNECTION",
    "MAX_WRITE_BUFFER_BYTES",
    "SOCKET_MODE",
    "ConnectionLimits",
    "ControlServer",
    "PeerCredentials",
    "RequestHandler",
]

MAX_WRITE_BUFFER_BYTES: Final = 1024 * 1024
"""Replies queued for one client beyond this many bytes disconnect it (it does not read)."""
MAX_INFLIGHT_PER_CONNECTION: Final = 32
"""Handler requests one connection may have running at once; beyond it, reading pauses."""
MAX_PENDING_COMMANDS: Final = 256
"""Daemon->job commands kept per connection awaiting a (possibly late) reply."""
_CLOSE_TIMEOUT_S: Final = 5.0
_MAX_PENDING_EVENTS: Final = 10_000
"""Job events kept for the next tick at most (a tick drains them every second)."""
_TIMEOUT_MESSAGE: Final = "timeout"
_DISCONNECTED_MESSAGE: Final = "disconnected"


async def _readline(reader: asyncio.StreamReader, timeout_s: float | None) -> bytes:
    """``reader.readline()`` within ``timeout_s`` seconds (None: no limit); raises
    :class:`asyncio.TimeoutError`. On Python 3.11 and later through
    ``asyncio.timeout``, in the reading task itself: ``asyncio.wait_for`` starts a task
    for every line, about 40 us of a ``status`` round trip (bench/control.py)."""
    if timeout_s is None:
        return await reader.readline()
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await reader.readline()
    return await asyncio.wait_for(reader.readline(), timeout_s)  # pragma: no cover - 3.10


class ControlServer:
    """Serve protocol v1 on a Unix stream socket at ``path``.

    ``handler`` answers the non-job ops (see :class:`RequestHandler`). ``admin_gid`` is
    the group whose members may use :data:`~gpuwatchd.control.protocol.ADMIN_OPS`.
    ``socket_gid`` is the group the socket file is given to (who may connect at all:
    jobs, ``gpuwatchctl status``); None keeps the process's group (systemd ``Group=``).
    The two differ on purpose: users whose jobs attach are not thereby admins.
    ``clock`` (seconds, default ``time.time``) stamps connections, reports and applied
    knobs. ``logger`` is a structlog-style logger (``logger.info("event", key=value)``);
    the default is ``structlog.get_logger("gpuwatchd.control")``. ``limits`` bounds
    connections per uid and in all (with a reserve for admins) and closes silent ones
    (:class:`~gpuwatchd.control.fairness.ConnectionLimits`); refused connections are
    closed on accept and logged at most once per uid a minute.
    ``knob_memory``: the knob values jobs applied, handed back at ``hello`` (docs/protocol.md).
    ``cgroup_of(pid)``: what a job's process's cgroup path says (its systemd unit and
    Kubernetes pod), read once at its ``hello``; None: not read.

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
        limits: ConnectionLimits | None = None,
        knob_memory: KnobMemory | None = None,
        cgroup_of: Callable[[int], CgroupIdentity] | None = None,
    ) -> None:
        self._path = Path(path)
        self._cgroup_of = cgroup_of
        self._handler = handler
        self._admin_gid = admin_gid
        self._socket_gid = socket_gid
        self._clock = clock
        if logger is None:
            import structlog

            logger = structlog.get_logger("gpuwatchd.control")
        self._log: Any = logger
        self.limits = limits or ConnectionLimits()
        self._admission = Admission(self.limits, self.is_admin)
        self._warn = LogLimiter()
        self.knob_memory = knob_memory if knob_memory is not None else KnobMemory()
        self._server: asyncio.AbstractServer | None = None
        self._socket_id: tuple[int, int] | None = None
        self._connections: dict[int, Connection] = {}
        self._sessions: dict[int, JobSession] = {}
        """The open connections' job sessions by session number: attach order (numbers
        grow), so :meth:`jobs` neither filters the connections nor sorts."""
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
        await socketfile.remove_stale(path, self._log)
        sock: socket.socket | None = None
        try:
            sock, self._socket_id = socketfile.bind(path, self._socket_gid, self._log)
            # The reader raises once a line's content exceeds `limit` bytes, so
            # MAX_LINE_BYTES - 1 keeps whole lines (newline included) within MAX_LINE_BYTES.
            self._server = await asyncio.start_unix_server(
                self._on_connect, sock=sock, limit=MAX_LINE_BYTES - 1
            )
        except OSError as exc:
            if sock is not None:
                sock.close()
                with contextlib.suppress(OSError):
                    path.unlink()
            raise GpuwatchError(f"cannot listen on {path}: {exc.strerror or exc}") from exc
        self._log.info(
            "control.listening", path=str(path), mode=oct(SOCKET_MODE), admin_gid=self._admin_gid
        )

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
            socketfile.unlink_if_ours(self._path, self._socket_id)
            self._log.info("control.closed", path=str(self._path))

    # ------------------------------------------------------------------ queries

    @property
    def connection_count(self) -> int:
        """Open client connections (jobs, ``gpuwatchctl`` and others)."""
        return len(self._connections)

    def jobs(self) -> tuple[JobInfo, ...]:
        """The attached jobs, one :class:`~gpuwatchd.model.JobInfo` per job connection.

        Ordered by attach order; a job disappears when its connection closes.
        """
        return tuple(session.info() for session in self._sessions.values())

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
        source: str | None = None,
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
                arrives after the timeout still updates the knob. A ``set_knob`` with a ``source``
                (``policy <name>``, ``operator``) that a job applied is remembered in
        knob_memory; the ``source`` also goes to the job as a ``set_knob`` param (cut to
        :data:`~gpuwatchd.control.protocol.MAX_SOURCE_CHARS`), so a request it supersedes
        is answered naming who superseded it.

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
        if op == Op.SET_KNOB and source and "source" not in params:
            # the job names who superseded a request it had not applied yet
            params = {**params, "source": source[:MAX_SOURCE_CHARS]}
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
            conn.add_pending(command_id, (op, future, source), MAX_PENDING_COMMANDS)
            self._log.info(
                "control.command_sent",
                job=job,
                pid=conn.session.pid if conn.session else None,
                op=op,
                id=command_id,
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
        try:
            peer = peer_credentials(writer.get_extra_info("socket"))
        except OSError as exc:
            self._log.warning("control.peercred_failed", error=str(exc))
            writer.transport.abort()
            return
        refused = self._admission.admit(peer)
        if refused is not None:
            self._warn_once("control.too_many_connections", peer, reason=refused)
            writer.transport.abort()
            return
        self._next_connection += 1
        conn = Connection(number=self._next_connection, reader=reader, writer=writer, peer=peer)
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
            self._admission.release(peer)
            self._drop(conn, abort=False)
            if task is not None:
                self._connection_tasks.discard(task)

    def _warn_once(
        self, event: str, peer: PeerCredentials, level: str = "warning", **kw: Any
    ) -> None:
        """Log ``event`` for ``peer``'s uid at most once a minute (:class:`LogLimiter`)."""
        suppressed = self._warn.due((event, peer.uid))
        if suppressed is not None:
            getattr(self._log, level)(
                event, uid=peer.uid, pid=peer.pid, suppressed=suppressed, **kw
            )

    async def _serve(self, conn: Connection) -> None:
        lines = 0
        while not conn.closed:
            try:
                line = await _readline(
                    conn.reader, self.limits.silence_s(lines, conn.session is not None)
                )
            except asyncio.TimeoutError:
                if conn.inflight:
                    continue  # a request still running is not silence (readline kept the data)
                self._warn_once("control.idle_closed", conn.peer, first_line=lines == 0)
                return
            except (ValueError, asyncio.LimitOverrunError):
                self._send(
                    conn,
                    error_reply(None, ErrorCode.TOO_LARGE, f"line exceeds {MAX_LINE_BYTES} bytes"),
                )
                self._warn_once("control.line_too_large", conn.peer)
                return
            except OSError:
                return
            lines += 1
            if not line.endswith(b"\n"):
                return  # EOF, possibly after half a line: nothing to answer
            if not line.strip():
                continue
            await self._dispatch_line(conn, line)

    def _drop(self, conn: Connection, *, abort: bool) -> None:
        if self._connections.pop(conn.number, None) is None and conn.closed:
            return
        conn.closed = True
        if conn.session is not None:
            self._sessions.pop(conn.session.session, None)
        for command_id, (_op, future, _source) in conn.pending.items():
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

    def _write(self, conn: Connection, data: bytes) -> bool:
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

    def _send(self, conn: Connection, reply: dict[str, Any]) -> bool:
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

    async def _dispatch_line(self, conn: Connection, line: bytes) -> None:
        try:
            message = decode_line(line)
        except ProtocolError as exc:
            self._log.debug("control.bad_line", conn=conn.number, error=exc.message)
            self._send(conn, error_reply(salvage_id(line), exc.code, exc.message))
            return
        if isinstance(message, Reply):
            self._on_job_reply(conn, message)
            return
        req = message
        if req.op in JOB_OPS:
            try:
                result = self._job_op(conn, req)
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
            self._warn_once("control.forbidden", conn.peer, level="info", op=req.op)
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

    async def _run_handler(self, conn: Connection, req: Request) -> None:
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

    def _on_job_reply(self, conn: Connection, reply: Reply) -> None:
        entry = conn.pending.get(reply.id) if isinstance(reply.id, str) else None
        if entry is None:
            self._log.debug("control.unexpected_reply", conn=conn.number, id=reply.id)
            return
        op, future, source = entry
        del conn.pending[reply.id]  # type: ignore[arg-type]  # str checked above
        if reply.ok and op == Op.SET_KNOB and conn.session is not None:
            conn.session.apply_knob_reply(
                reply.result, self._clock(), self._log, source, self.knob_memory
            )
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

    # ------------------------------------------------------------------ job ops

    def _hello(self, conn: Connection, req: Request) -> dict[str, Any]:
        if conn.session is not None:
            raise ProtocolError(ErrorCode.CONFLICT, "this connection already said hello")
        try:
            session = open_session(
                req.params,
                conn.peer,
                owner_of=self._job_owner,
                number=self._next_session + 1,
                now_s=self._clock(),
                log=self._log,
                cgroup_of=self._cgroup_of,
            )
        except ProtocolError as exc:
            # A refused hello leaves a job unwatched until it says hello again: never silent.
            # (at most once a minute per uid, with the count suppressed: a client cannot
            # flood the journal)
            job = req.params.get("job")
            self._warn_once(
                "control.hello_refused",
                conn.peer,
                job=job[:JOB_NAME_MAX_CHARS] if isinstance(job, str) else None,
                error=exc.code,
                detail=exc.message,
            )
            raise
        self._next_session += 1
        conn.session = self._sessions[session.session] = session
        return {
            "protocol": PROTOCOL_VERSION,
            "daemon_version": __version__,
            "session": self._next_session,
            "knobs": conn.session.remembered_knobs(self.knob_memory, self._log),
            "dropped_knobs": [d.as_reply() for d in session.dropped_knobs],
        }

    def _job_owner(self, name: str) -> int | None:
        """The uid of the live job connections named ``name``, or None if none is attached."""
        for conn in self._connections.values():
            if conn.session is not None and not conn.closed and conn.session.name == name:
                return conn.peer.uid
        return None

    def _job_op(self, conn: Connection, req: Request) -> dict[str, Any]:
        """Answer ``hello``, ``report`` (checked whole, :func:`.messages.parse_report`) or
        ``event`` (queued as a :class:`JobEvent` for the next tick, stamped with the
        server's clock and the session's job and pid; at most :data:`EVENTS_PER_S` per
        connection, a token bucket; more get ``conflict``)."""
        if req.op == Op.HELLO:
            return self._hello(conn, req)
        session = conn.session
        if session is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"say hello (role: job) before {req.op!r}")
        if req.op == Op.REPORT:
            session.report(req.params, self._clock(), self._log, self.knob_memory)
        elif not conn.events.take(time.monotonic()):
            raise ProtocolError(
                ErrorCode.CONFLICT, f"more than {EVENTS_PER_S:g} events per second; slow down"
            )
        else:
            self.post_event(session.event(req.params, self._clock(), self._log))
        return {}
