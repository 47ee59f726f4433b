"""Serving the metrics: an HTTP endpoint (on a socket from :mod:`.sockets`), and
node_exporter's textfile. The daemon imports this module only when it serves or writes
metrics: prometheus-client and its HTTP stack are 3.7 MiB of the daemon's memory.

The HTTP side is prometheus-client's WSGI app (content negotiation, OpenMetrics, gzip)
on its threading server, with a thread per connection, at most
:data:`MAX_CONNECTIONS` of them, each closed after :data:`REQUEST_TIMEOUT_S` without
progress: a scrape never runs on the event loop, a slow or idle client holds one
thread for seconds, and a flood of connections is answered 503 instead of growing
threads. A scrape asks the loop for the daemon's view (:func:`loop_source`), which
takes microseconds there, and builds the exposition in its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry, make_wsgi_app, write_to_textfile
from prometheus_client.exposition import ThreadingWSGIServer

from gpuwatchd.metrics.collector import DaemonCollector, ViewSource

__all__ = [
    "MAX_CONNECTIONS",
    "REQUEST_TIMEOUT_S",
    "SCRAPE_VIEW_TIMEOUT_S",
    "MetricsServer",
    "loop_source",
    "make_registry",
    "write_textfile",
]

SCRAPE_VIEW_TIMEOUT_S: Final = 2.0
"""How long a scrape waits for the event loop before it answers ``gpuwatchd_up 0``."""

REQUEST_TIMEOUT_S: Final = 5.0
"""A connection that sends or takes nothing for this long is closed (slow or idle clients)."""

MAX_CONNECTIONS: Final = 16
"""Connections served at once; more get ``503 Service Unavailable`` and are closed
(Prometheus opens one per target; a few more for people with curl)."""

_T = TypeVar("_T")


def make_registry(source: ViewSource, hostname: str) -> CollectorRegistry:
    """A registry holding only gpuwatchd's collector (no process/platform defaults)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(source, hostname))
    return registry


def loop_source(
    loop: asyncio.AbstractEventLoop,
    take: Callable[[], _T],
    timeout_s: float = SCRAPE_VIEW_TIMEOUT_S,
) -> Callable[[], _T | None]:
    """For another thread: a callable that runs ``take()`` on ``loop`` and returns its
    value, waiting at most ``timeout_s``; None on timeout, error or a closed loop."""

    async def _call() -> _T:
        return take()

    def source() -> _T | None:
        try:
            future = asyncio.run_coroutine_threadsafe(_call(), loop)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            return None
        try:
            return future.result(timeout_s)
        except Exception:
            future.cancel()
            return None

    return source


class _Handler(WSGIRequestHandler):
    """A request handler that logs nothing and gives up on a silent client."""

    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing (a scrape a second would flood the journal)."""


_BUSY: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 24\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n\r\ntoo many connections now"
)


class _BoundedServer(ThreadingWSGIServer):
    """prometheus-client's threading WSGI server with at most ``slots`` connections."""

    def __init__(self, sock: socket.socket, slots: int) -> None:
        # BaseServer's, not TCPServer's __init__: that one creates a socket of
        # address_family first, which the hardened unit's RestrictAddressFamilies= (no
        # AF_INET) refuses with EAFNOSUPPORT; the socket here is systemd's, already listening.
        socketserver.BaseServer.__init__(self, sock.getsockname()[:2], _Handler)
        self.socket = sock
        self._slots = threading.BoundedSemaphore(slots)
        self.refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            with contextlib.suppress(OSError):
                request.settimeout(0.1)
                request.sendall(_BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsServer:
    """The HTTP endpoint on an already listening socket, served from one daemon thread.

    Use as a context manager: entering starts the thread, leaving shuts it down and
    closes the socket. ``address`` is (host, port) of the socket; ``refused`` counts the
    connections turned away past ``max_connections``.
    """

    def __init__(
        self,
        sock: socket.socket,
        registry: CollectorRegistry,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        host, port = sock.getsockname()[:2]
        self.address: tuple[str, int] = (str(host), int(port))
        server = _BoundedServer(sock, max_connections)
        server.server_name = self.address[0]
        server.server_port = self.address[1]
        server.setup_environ()
        server.set_app(make_wsgi_app(registry))
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="gpuwatchd-metrics", daemon=True
        )

    @property
    def refused(self) -> int:
        """Connections answered 503 because :data:`MAX_CONNECTIONS` were open."""
        return self._server.refused

    def __enter__(self) -> MetricsServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._server.server_close()


def write_textfile(path: str | Path, registry: CollectorRegistry) -> None:
    """Write the exposition atomically to ``path`` (a temp file beside it renamed over
    it: prometheus-client's ``write_to_textfile``), for node_exporter's textfile
    collector, which reads ``*.prom`` files only. Raises OSError."""
    write_to_textfile(str(path), registry)
