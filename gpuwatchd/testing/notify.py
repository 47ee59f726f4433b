"""A real ``NOTIFY_SOCKET`` for tests: receive what a daemon tells systemd.

Specification: docs/modules.md#gpuwatchdtestingnotify
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = ["Notification", "NotifyListener", "parse_notification"]

#: Receive buffer per datagram. Generous on purpose: a test should see what was sent even
#: when it is longer than systemd itself would accept.
_MAX_DATAGRAM_BYTES = 65536

#: ``sizeof(struct sockaddr_un.sun_path)`` on Linux (unix(7)), including the final NUL.
_SUN_PATH_MAX = 108

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;} (unix(7))


def parse_notification(raw: str) -> dict[str, str]:
    """Parse one sd_notify(3) datagram ``"KEY=VALUE\\nKEY=VALUE"`` into a dict.

    Lines without ``=`` are ignored (systemd ignores them too); a repeated key keeps the
    last value.
    """
    fields: dict[str, str] = {}
    for line in raw.split("\n"):
        key, sep, value = line.partition("=")
        if sep and key:
            fields[key] = value
    return fields


@dataclass(frozen=True)
class Notification:
    """One received datagram: ``raw`` text, parsed ``fields``, sender ``pid`` (or None)."""

    raw: str
    fields: dict[str, str] = field(hash=False)
    pid: int | None


Predicate = Callable[[dict[str, str]], bool]


class NotifyListener:
    """A bound ``AF_UNIX`` ``SOCK_DGRAM`` socket at ``directory/name`` recording datagrams.

    Use as a context manager: ``__enter__`` binds and starts the receiver thread,
    ``__exit__`` stops it, closes the socket and removes the socket file.

    Raises :class:`ValueError` when the path is longer than a Unix socket address allows
    (107 bytes, unix(7)); use a shorter directory (``tempfile.mkdtemp(dir="/tmp")``).
    """

    def __init__(self, directory: str | os.PathLike[str], *, name: str = "notify.sock") -> None:
        self.path: str = os.fspath(Path(directory) / name)
        if len(os.fsencode(self.path)) >= _SUN_PATH_MAX:
            raise ValueError(
                f"socket path is {len(os.fsencode(self.path))} bytes, more than the "
                f"{_SUN_PATH_MAX - 1} a Unix socket address allows: {self.path}"
            )
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._notifications: list[Notification] = []

    # -- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> NotifyListener:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(self.path)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._receive, name=f"NotifyListener({self.path})", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the receiver, close the socket and unlink its file; idempotent."""
        if self._sock is None:
            return
        self._stop.set()
        # Wake the blocking recvmsg() with an empty datagram; the thread then sees _stop.
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waker:
                waker.sendto(b"", self.path)
        except OSError:
            pass  # the receive timeout below ends the thread anyway
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._sock.close()
        self._sock = None
        self._thread = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _receive(self) -> None:
        sock = self._sock
        assert sock is not None
        sock.settimeout(0.5)
        ancillary_size = socket.CMSG_SPACE(_UCRED.size)
        while not self._stop.is_set():
            try:
                data, ancdata, _flags, _addr = sock.recvmsg(_MAX_DATAGRAM_BYTES, ancillary_size)
            except TimeoutError:
                continue
            except OSError:
                return  # socket closed under us
            if self._stop.is_set():
                return
            if not data:
                continue
            pid: int | None = None
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = _UCRED.unpack(payload[: _UCRED.size])[0]
            raw = data.decode("utf-8", errors="replace")
            note = Notification(raw=raw, fields=parse_notification(raw), pid=pid)
            with self._cond:
                self._notifications.append(note)
                self._cond.notify_all()

    # -- what was received --------------------------------------------------------------

    @property
    def notifications(self) -> list[Notification]:
        """Every datagram received so far, oldest first (a copy)."""
        with self._cond:
            return list(self._notifications)

    @property
    def messages(self) -> list[dict[str, str]]:
        """Every datagram received so far, parsed into ``{KEY: VALUE}`` dicts."""
        return [n.fields for n in self.notifications]

    @property
    def raw(self) -> list[str]:
        """Every datagram received so far, as text."""
        return [n.raw for n in self.notifications]

    def __len__(self) -> int:
        """Number of datagrams received so far (use as ``start=`` of :meth:`wait_for`)."""
        with self._cond:
            return len(self._notifications)

    def wait_for(
        self, predicate: str | Predicate, timeout_s: float = 5.0, *, start: int = 0
    ) -> str:
        """Block until a datagram matches; return it as text.

        ``predicate`` is ``"KEY=VALUE"`` (the datagram has that exact assignment),
        ``"KEY"`` (it has that key with any value), or a callable taking the parsed
        dict. Datagrams already received count, from index ``start`` on (pass
        ``len(listener)`` to wait only for new ones, e.g. the ``READY=1`` after a reload).

        Raises :class:`TimeoutError` after ``timeout_s`` seconds, listing what was
        received.
        """
        match = _as_predicate(predicate)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            index = start
            while True:
                while index < len(self._notifications):
                    note = self._notifications[index]
                    index += 1
                    if match(note.fields):
                        return note.raw
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    received = [n.raw for n in self._notifications[start:]]
                    raise TimeoutError(
                        f"no notification matching {predicate!r} on {self.path} within "
                        f"{timeout_s:g}s; received {received!r}"
                    )
                self._cond.wait(remaining)


def _as_predicate(predicate: str | Predicate) -> Predicate:
    if callable(predicate):
        return predicate
    key, sep, value = predicate.partition("=")
    if sep:
        return lambda fields: fields.get(key) == value
    return lambda fields: key in fields
