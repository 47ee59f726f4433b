"""The hook's one background thread: all socket I/O with the daemon happens here.

The thread connects to the daemon's control socket (protocol v1, see
:mod:`gpuwatchd.control.protocol`), says ``hello``, sends one aggregated
``report`` per reporting period, sends the job's ``event`` messages as soon as they
are queued, answers the daemon's ``set_knob``/``drain``/``stop``
through a :class:`Session`, and reconnects with capped exponential backoff
(0.5 s doubling to 10 s) when the daemon is absent or goes away. The training
thread never waits on it: it only appends to deques and, for rare events (a knob
applied, the end of the ``with`` block), writes one byte to a non-blocking wake-up
socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
import weakref
from typing import Any, Final, Protocol

from gpuwatchd.control.protocol import (
    MAX_LINE_BYTES,
    Op,
    Reply,
    Request,
    decode_line,
    encode,
    error_reply,
    request,
)
from gpuwatchd.errors import ProtocolError

__all__ = [
    "BACKOFF_MAX_S",
    "BACKOFF_MIN_S",
    "MIN_REPORT_INTERVAL_S",
    "Connection",
    "Session",
    "Wakeup",
]

logger = logging.getLogger("gpuwatchd.hook")

BACKOFF_MIN_S: Final = 0.5
"""First wait before retrying a failed connect; doubles per failure up to BACKOFF_MAX_S."""
BACKOFF_MAX_S: Final = 10.0
MIN_REPORT_INTERVAL_S: Final = 0.25
"""Reports are sent at most 4 per second (docs/design.md, "Control protocol")."""
CONNECT_TIMEOUT_S: Final = 0.5
FLUSH_TIMEOUT_S: Final = 0.3
"""How long the last report and replies may take to leave when the ``with`` block ends."""
OUTBUF_LIMIT_BYTES: Final = 256 * 1024
"""Reports are skipped while this much is unsent (a daemon that stopped reading)."""


class Session(Protocol):
    """What the connection needs from the job side (implemented by
    :class:`gpuwatchd.hook._session.DaemonSession`).

    All methods are called on the background thread and must not block.
    ``generation`` numbers connections (1, 2, ...), so that state belonging to a
    lost connection (pending knob changes, their replies) can be dropped.
    """

    def hello_message(self, request_id: int) -> dict[str, Any]:
        """The ``hello`` request with the job's *current* knob values."""

    def take_report(self) -> dict[str, Any] | None:
        """Drain the step records and aggregate them; ``None`` when there were no steps."""

    def take_events(self) -> list[dict[str, Any]]:
        """Job events (``{kind, ...}``) to send now; those queued while disconnected too."""

    def discard_records(self) -> None:
        """Forget step records gathered while not connected."""

    def handle_request(self, message: Request, generation: int) -> list[dict[str, Any]]:
        """Handle a daemon request; return the replies to send now (maybe none yet)."""

    def take_replies(self, generation: int) -> list[dict[str, Any]]:
        """Replies queued by the training thread for this connection (others are dropped)."""

    def connection_lost(self, generation: int) -> None:
        """The connection ``generation`` is gone: drop what only it could be told."""

    def hello_accepted(self, result: dict[str, Any]) -> None:
        """The daemon's ok reply to ``hello`` (``knobs``: remembered values to apply;
        ``dropped_knobs``: declared knobs it left out)."""


_LIVE: weakref.WeakSet[Connection] = weakref.WeakSet()
_fork_hook_registered = False
_fork_hook_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) must not keep the daemon connection open:
    # the daemon would not see the job leave while workers live.
    for connection in list(_LIVE):
        connection.forget_fds_in_child()


def _register_fork_hook() -> None:
    global _fork_hook_registered
    with _fork_hook_lock:
        if not _fork_hook_registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook_registered = True


class Wakeup:
    """The hook thread's wake-up: a non-blocking socket pair, open from :meth:`open` to
    :meth:`close`. Any thread calls :meth:`wake` (one byte, never blocks; a full pair
    means the thread is awake anyway); the hook's thread selects on :attr:`reader`."""

    def __init__(self) -> None:
        self.reader: socket.socket | None = None
        self._writer: socket.socket | None = None

    def open(self) -> socket.socket:
        """Create the pair; returns the end the hook's thread reads."""
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        self.reader, self._writer = reader, writer
        return reader

    def wake(self) -> None:
        """Wake the thread now (a no-op before :meth:`open` and after :meth:`close`)."""
        writer = self._writer
        if writer is None:
            return
        with contextlib.suppress(OSError):
            writer.send(b"\0")

    def close(self) -> None:
        """Close both ends."""
        for sock in (self.reader, self._writer):
            if sock is not None:
                sock.close()
        self.reader = self._writer = None

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copies (the parent's stay open)."""
        for sock in (self.reader, self._writer):
            if sock is not None:
                with contextlib.suppress(OSError):
                    os.close(sock.detach())
        self.reader = self._writer = None


class Connection:
    """The background thread talking to the daemon at ``path`` for ``session``.

    ``wakeup``: what wakes the thread (shared with whoever queues for it, the session);
    ``report_interval_s`` (seconds, clamped to at least :data:`MIN_REPORT_INTERVAL_S`)
    is the reporting period. :attr:`connected` is true while a connection is up
    (``hello`` sent). Nothing happens until :meth:`start`.
    """

    def __init__(
        self, path: str, session: Session, wakeup: Wakeup, report_interval_s: float
    ) -> None:
        self.path = path
        self._session = session
        self._wakeup = wakeup
        self._interval_s = max(MIN_REPORT_INTERVAL_S, float(report_interval_s))
        self._stop = threading.Event()
        self._first_attempt = threading.Event()
        self._hello_answered = threading.Event()
        self._sock: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self._warned_absent = False
        self._warned_error_reply = False
        self.connected = False
        self.generation = 0
        self.last_error: str | None = None

    # -- called from the training thread -------------------------------------------

    def start(self) -> None:
        """Start the background thread (idempotent); it makes the first connect attempt."""
        if self._thread is not None:
            return
        _register_fork_hook()
        self._wakeup.open()
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._run, name="gpuwatchd-hook", daemon=True)
        self._thread.start()

    def wait_first_attempt(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the first connect attempt's outcome; True if known."""
        return self._first_attempt.wait(timeout_s)

    def wait_hello(self, timeout_s: float) -> bool:
        """When connected, wait up to ``timeout_s`` for the daemon's answer to ``hello``
        (so that knob values it hands back apply before the first loader is built);
        True when it came (or the connection is gone)."""
        if not self.connected:
            return True
        return self._hello_answered.wait(timeout_s)

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Ask the thread to flush a last report, close the socket and end.

        Waits at most ``timeout_s`` seconds; returns True when the thread has ended.
        """
        thread = self._thread
        self._stop.set()
        self._wakeup.wake()
        if thread is None:
            return True
        thread.join(timeout_s)
        ended = not thread.is_alive()
        if ended:
            self._wakeup.close()
            _LIVE.discard(self)
        return ended

    @property
    def alive(self) -> bool:
        """True while the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def forget_fds_in_child(self) -> None:
        """In a forked child: close this process's copies of the sockets (the parent's stay)."""
        sock = self._sock
        self._sock = None
        if sock is not None:
            with contextlib.suppress(OSError):
                os.close(sock.detach())
        self._wakeup.forget_in_child()
        selector = self._selector
        self._selector = None
        if selector is not None:
            with contextlib.suppress(OSError, ValueError):
                selector.close()

    # -- the background thread ---------------------------------------------------------

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _run(self) -> None:
        backoff_s = BACKOFF_MIN_S
        try:
            while not self._stop.is_set():
                sock = self._connect()
                if sock is None:
                    self._first_attempt.set()
                    if self._stop.wait(backoff_s):
                        break
                    backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)
                    continue
                self.generation += 1
                hello_ok = False
                try:
                    hello_ok = self._serve(sock, self.generation)
                finally:
                    self.connected = False
                    self._hello_answered.set()
                    self._session.connection_lost(self.generation)
                if self._stop.is_set():
                    break
                logger.info("gpuwatchd: connection to %s lost; reconnecting", self.path)
                backoff_s = BACKOFF_MIN_S if hello_ok else min(backoff_s * 2, BACKOFF_MAX_S)
                if self._stop.wait(backoff_s):
                    break
        except Exception:  # never let the hook's thread die loudly in the job
            logger.exception("gpuwatchd: hook thread failed; the job goes on unmonitored")
        finally:
            self.connected = False
            self._first_attempt.set()
            self._hello_answered.set()

    def _connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(self.path)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            self.last_error = str(exc)
            if not self._warned_absent:
                self._warned_absent = True
                logger.warning(
                    "gpuwatchd: no daemon at %s (%s); training goes on unmonitored, "
                    "retrying in the background",
                    self.path,
                    exc,
                )
            else:
                logger.debug("gpuwatchd: connect to %s failed: %s", self.path, exc)
            return None
        if self._warned_absent:
            logger.info("gpuwatchd: connected to %s", self.path)
        self.last_error = None
        return sock

    def _encode(self, message: dict[str, Any], out: bytearray) -> None:
        try:
            out += encode(message)
        except ProtocolError as exc:
            logger.debug("gpuwatchd: message not sent: %s", exc)

    def _serve(self, sock: socket.socket, generation: int) -> bool:
        """Talk over ``sock`` until it is lost or stop is asked; returns whether hello got ok."""
        wake_r = self._wakeup.reader
        assert wake_r is not None
        selector = selectors.DefaultSelector()
        self._sock = sock
        self._selector = selector
        out = bytearray()
        inbuf = bytearray()
        hello_ok = False
        try:
            selector.register(sock, selectors.EVENT_READ)
            selector.register(wake_r, selectors.EVENT_READ)
            self._session.discard_records()
            hello_id = self._new_id()
            self._encode(self._session.hello_message(hello_id), out)
            self.connected = True
            self._first_attempt.set()
            next_report_s = time.monotonic() + self._interval_s
            while True:
                if self._stop.is_set():
                    self._final_flush(sock, out, generation)
                    return hello_ok
                for reply in self._session.take_replies(generation):
                    self._encode(reply, out)
                self._queue_events(out)
                now_s = time.monotonic()
                if now_s >= next_report_s:
                    next_report_s = now_s + self._interval_s
                    self._queue_report(out)
                if out and not self._send(sock, out):
                    return hello_ok
                events = selectors.EVENT_READ | (selectors.EVENT_WRITE if out else 0)
                selector.modify(sock, events)
                timeout_s = max(0.0, next_report_s - time.monotonic())
                for key, mask in selector.select(timeout_s):
                    if key.fileobj is wake_r:
                        _drain(wake_r)
                        continue
                    if not mask & selectors.EVENT_READ:
                        continue
                    try:
                        data = sock.recv(65536)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        return hello_ok
                    if not data:
                        return hello_ok
                    inbuf += data
                    while True:
                        end = inbuf.find(b"\n")
                        if end < 0:
                            break
                        line = bytes(inbuf[:end])
                        del inbuf[: end + 1]
                        if self._handle_line(line, hello_id, generation, out):
                            hello_ok = True
                    if len(inbuf) > MAX_LINE_BYTES:
                        logger.warning("gpuwatchd: daemon sent an oversized line; reconnecting")
                        return hello_ok
        finally:
            self._sock = None
            self._selector = None
            selector.close()
            sock.close()

    def _queue_events(self, out: bytearray) -> None:
        for event in self._session.take_events():
            self._encode(request(self._new_id(), Op.EVENT, event=event), out)

    def _queue_report(self, out: bytearray) -> None:
        report = self._session.take_report()
        if report is None:
            return
        if len(out) > OUTBUF_LIMIT_BYTES:
            logger.debug("gpuwatchd: daemon is not reading; report skipped")
            return
        self._encode(request(self._new_id(), Op.REPORT, report=report), out)

    def _send(self, sock: socket.socket, out: bytearray) -> bool:
        """Send what the socket takes now; False when the connection is gone."""
        try:
            sent = sock.send(out)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        del out[:sent]
        return True

    def _handle_line(self, line: bytes, hello_id: int, generation: int, out: bytearray) -> bool:
        """Handle one line from the daemon; True for the ok reply to hello."""
        if not line.strip():
            return False
        try:
            message = decode_line(line)
        except ProtocolError as exc:
            self._encode(error_reply(None, exc.code, exc.message), out)
            return False
        if isinstance(message, Reply):
            if message.id != hello_id:
                if not message.ok:
                    self._log_error_reply(message)
                return False
            if message.ok:
                if isinstance(message.result, dict):
                    self._session.hello_accepted(message.result)
                self._hello_answered.set()
                return True
            logger.warning(
                "gpuwatchd: the daemon refused this job (%s: %s); training goes on unmonitored",
                message.error_code,
                message.error_message,
            )
            self._hello_answered.set()
            return False
        for reply in self._session.handle_request(message, generation):
            self._encode(reply, out)
        return False

    def _log_error_reply(self, reply: Reply) -> None:
        text = "gpuwatchd: daemon answered request %s with %s: %s"
        if not self._warned_error_reply:
            self._warned_error_reply = True
            logger.warning(text, reply.id, reply.error_code, reply.error_message)
        else:
            logger.debug(text, reply.id, reply.error_code, reply.error_message)

    def _final_flush(self, sock: socket.socket, out: bytearray, generation: int) -> None:
        for reply in self._session.take_replies(generation):
            self._encode(reply, out)
        self._queue_events(out)
        self._queue_report(out)
        deadline_s = time.monotonic() + FLUSH_TIMEOUT_S
        while out:
            if not self._send(sock, out):
                return
            remaining_s = deadline_s - time.monotonic()
            if not out or remaining_s <= 0:
                return
            with selectors.DefaultSelector() as waiter:
                waiter.register(sock, selectors.EVENT_WRITE)
                waiter.select(remaining_s)


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass
