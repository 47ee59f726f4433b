"""Blocking client of the control socket (protocol v1), used by ``gpuwatchctl`` and the hook.

Deliberately light: the standard library, :mod:`gpuwatchd.control.protocol` and
:mod:`gpuwatchd.errors` only (no asyncio, no structlog), so importing it inside a
training job costs nothing.

Example::

    with ControlClient() as client:          # $GPUWATCHD_SOCKET or /run/gpuwatchd/control.sock
        print(client.call("status"))

A job connection also *receives* requests from the daemon (``set_knob``, ``drain``,
``stop``). Those that arrive while :meth:`ControlClient.call` waits for its reply are
kept, in order, and returned by :meth:`ControlClient.poll_requests`, which also reads
whatever else has arrived; the job answers them with :meth:`ControlClient.send`.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from types import TracebackType
from typing import Any, Final

from gpuwatchd.control.protocol import (
    DEFAULT_SOCKET_PATH,
    MAX_LINE_BYTES,
    SOCKET_ENV,
    ErrorCode,
    Reply,
    Request,
    decode_line,
    encode,
    request,
)
from gpuwatchd.errors import ControlError, ProtocolError

__all__ = ["ControlClient", "default_socket_path"]

UNAVAILABLE: Final = "unavailable"
"""The :class:`~gpuwatchd.errors.ControlError` code when no daemon answered."""

_RECV_BYTES: Final = 65536
_MSG_NOSIGNAL: Final = getattr(socket, "MSG_NOSIGNAL", 0)
"""send(2) flag: EPIPE instead of SIGPIPE when the daemon went away (the hook runs in
processes that may not ignore SIGPIPE)."""


def default_socket_path() -> str:
    """The socket path: ``$GPUWATCHD_SOCKET`` if set and non-empty, else
    :data:`DEFAULT_SOCKET_PATH`."""
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET_PATH


class ControlClient:
    """One blocking connection to gpuwatchd's control socket; a context manager.

    ``path`` defaults to :func:`default_socket_path`; ``timeout_s`` bounds connecting
    and each :meth:`call` (seconds). The connection is opened on first use and reopened
    on the next use after the daemon closed it. Not thread-safe: use one client per
    thread, or serialise access.
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, timeout_s: float = 5.0
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.path = os.fspath(path) if path is not None else default_socket_path()
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        self._next_id = 0
        self._requests: deque[Request] = deque()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        """True while a connection is open."""
        return self._sock is not None

    def connect(self) -> None:
        """Open the connection if it is not open.

        Raises :class:`~gpuwatchd.errors.ControlError` ``unavailable`` ("no gpuwatchd at
        <path>: ...") when the socket is missing, refuses, or does not accept within
        ``timeout_s``, and ``forbidden`` when the socket's permissions keep this user out
        (the socket is mode 0660: be root, the daemon's user, or in its group).
        """
        if self._sock is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
        except PermissionError as exc:
            sock.close()
            raise ControlError(
                ErrorCode.FORBIDDEN,
                f"permission denied on {self.path} (need root, the daemon's user or its group)",
            ) from exc
        except (TimeoutError, OSError) as exc:
            sock.close()
            raise ControlError(UNAVAILABLE, f"no gpuwatchd at {self.path}: {_reason(exc)}") from exc
        self._sock = sock
        self._buffer.clear()

    def close(self) -> None:
        """Close the connection (idempotent). Requests not yet polled are kept."""
        sock, self._sock = self._sock, None
        self._buffer.clear()
        if sock is not None:
            sock.close()

    def call(self, op: str, **params: Any) -> Any:
        """Send request ``op`` with ``params`` and return the ``result`` of its reply.

        Waits at most ``timeout_s`` for the reply with the same id. Daemon requests that
        arrive meanwhile are kept for :meth:`poll_requests`; other lines are ignored.

        Raises :class:`~gpuwatchd.errors.ControlError`: the daemon's error code and
        message for an error reply (``bad_request``, ``forbidden``, ...); ``unavailable``
        when there is no daemon, the connection breaks, or the reply does not come in
        time; ``too_large``/``internal`` when the request cannot be encoded.
        """
        self._next_id += 1
        request_id = self._next_id
        try:
            data = encode(request(request_id, op, **params))
        except ProtocolError as exc:
            raise ControlError(exc.code, exc.message) from exc
        reused = self._sock is not None
        self.connect()
        deadline = time.monotonic() + self.timeout_s
        try:
            self._send_bytes(data)
        except ControlError:
            if not reused:
                raise
            # The daemon closed our idle connection (e.g. it restarted): a send that
            # failed was never received, so it is safe to send once more on a new one.
            self.connect()
            self._send_bytes(data)
        while True:
            line = self._read_line(deadline)
            if line is None:
                self.close()
                raise ControlError(
                    UNAVAILABLE,
                    f"no gpuwatchd at {self.path}: no reply to {op!r} within {self.timeout_s:g} s",
                )
            message = self._decode(line)
            if isinstance(message, Request):
                self._requests.append(message)
                continue
            if message is None:
                continue
            if message.id == request_id or (message.id is None and not message.ok):
                # An error about a line the daemon could not even parse has id null;
                # we send one request at a time, so it is about ours.
                if message.ok:
                    return message.result
                raise ControlError(
                    message.error_code or ErrorCode.INTERNAL, message.error_message or ""
                )

    def poll_requests(self, timeout_s: float = 0.0) -> list[Request]:
        """Return the daemon's requests received so far, waiting up to ``timeout_s`` for one.

        For job connections: the daemon sends ``set_knob``/``drain``/``stop`` requests
        (ids ``"d-<n>"``); answer each with :meth:`send` of an ``ok_reply`` once applied.
        Returns ``[]`` when nothing arrived. Raises ControlError ``unavailable`` if the
        connection is closed or breaks.
        """
        if self._sock is None:
            raise ControlError(UNAVAILABLE, f"not connected to gpuwatchd at {self.path}")
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            line = self._read_line(deadline, wait=not self._requests)
            if line is None:
                break
            message = self._decode(line)
            if isinstance(message, Request):
                self._requests.append(message)
        taken = list(self._requests)
        self._requests.clear()
        return taken

    def send(self, message: dict[str, Any]) -> None:
        """Send one message (e.g. a reply to a daemon request) without waiting for anything.

        Raises ControlError ``unavailable`` if the connection cannot be used, and the
        protocol code if the message cannot be encoded.
        """
        try:
            data = encode(message)
        except ProtocolError as exc:
            raise ControlError(exc.code, exc.message) from exc
        self.connect()
        self._send_bytes(data)

    # ------------------------------------------------------------------ internals

    def _send_bytes(self, data: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.settimeout(self.timeout_s)
            self._sock.sendall(data, _MSG_NOSIGNAL)
        except (TimeoutError, OSError) as exc:
            self.close()
            raise ControlError(
                UNAVAILABLE, f"lost gpuwatchd at {self.path}: {_reason(exc)}"
            ) from exc

    def _read_line(self, deadline: float, *, wait: bool = True) -> bytes | None:
        """One complete line, or None when ``deadline`` passed (or, with ``wait=False``,
        when no whole line is buffered or immediately readable)."""
        while True:
            newline = self._buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self._buffer[: newline + 1])
                del self._buffer[: newline + 1]
                return line
            if len(self._buffer) >= MAX_LINE_BYTES:
                self.close()
                raise ControlError(
                    ErrorCode.TOO_LARGE, f"gpuwatchd at {self.path} sent an oversized line"
                )
            sock = self._sock
            if sock is None:
                raise ControlError(UNAVAILABLE, f"not connected to gpuwatchd at {self.path}")
            remaining = deadline - time.monotonic() if wait else 0.0
            try:
                if remaining <= 0:
                    sock.setblocking(False)
                else:
                    sock.settimeout(remaining)
                chunk = sock.recv(_RECV_BYTES)
            except (TimeoutError, BlockingIOError):
                return None
            except OSError as exc:
                self.close()
                raise ControlError(
                    UNAVAILABLE, f"lost gpuwatchd at {self.path}: {_reason(exc)}"
                ) from exc
            finally:
                if self._sock is not None:
                    self._sock.settimeout(self.timeout_s)
            if not chunk:
                self.close()
                raise ControlError(UNAVAILABLE, f"gpuwatchd at {self.path} closed the connection")
            self._buffer += chunk

    @staticmethod
    def _decode(line: bytes) -> Request | Reply | None:
        try:
            return decode_line(line)
        except ProtocolError:
            return None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
