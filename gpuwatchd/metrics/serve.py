"""Serving the metrics: an HTTP endpoint (own socket or systemd's), and node_exporter's textfile.

The HTTP side is prometheus-client's WSGI app on its threading server, in one daemon
thread, so a scrape never runs on the event loop; a scrape asks the loop for the
``status`` object (:func:`loop_status_source`) and waits at most
:data:`SCRAPE_STATUS_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from prometheus_client import CollectorRegistry, make_wsgi_app, write_to_textfile
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from gpuwatchd.metrics.collector import DaemonCounters, StatusCollector, StatusSource

__all__ = [
    "LISTEN_FDS_START",
    "SCRAPE_STATUS_TIMEOUT_S",
    "MetricsServer",
    "activated_socket",
    "listen_socket",
    "loop_status_source",
    "make_registry",
    "parse_listen",
    "write_textfile",
]

LISTEN_FDS_START: Final = 3
"""The first fd systemd passes (SD_LISTEN_FDS_START, sd_listen_fds(3))."""

SCRAPE_STATUS_TIMEOUT_S: Final = 2.0
"""How long a scrape waits for the event loop's status before it answers ``gpuwatchd_up 0``."""

_REQUEST_TIMEOUT_S: Final = 5.0
"""A scrape connection that sends nothing for this long is closed (slow or idle clients)."""


def make_registry(
    source: StatusSource, counters: DaemonCounters, hostname: str
) -> CollectorRegistry:
    """A registry holding only gpuwatchd's collector (no process/platform defaults)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(source, counters, hostname))
    return registry


def loop_status_source(
    loop: asyncio.AbstractEventLoop, status: Callable[[], Mapping[str, Any]]
) -> StatusSource:
    """A :data:`StatusSource` for another thread: runs ``status()`` on ``loop``, waits
    at most :data:`SCRAPE_STATUS_TIMEOUT_S`; None on timeout, error or a closed loop."""

    async def _call() -> Mapping[str, Any]:
        return status()

    def source() -> Mapping[str, Any] | None:
        try:
            future = asyncio.run_coroutine_threadsafe(_call(), loop)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            return None
        try:
            return future.result(SCRAPE_STATUS_TIMEOUT_S)
        except Exception:
            future.cancel()
            return None

    return source


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port). Raises ValueError."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, e.g. 127.0.0.1:9879, not {value!r}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port must be 1..65535, not {port}")
    return host.strip("[]"), port


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``. Raises OSError (address in use, ...)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=64)


def activated_socket(
    environ: Mapping[str, str] | None = None, name: str = "metrics"
) -> socket.socket | None:
    """The listening socket systemd passed for ``name`` (sd_listen_fds(3)), or None.

    Reads ``LISTEN_PID`` (must be this process), ``LISTEN_FDS`` and ``LISTEN_FDNAMES``
    (``FileDescriptorName=`` of the .socket unit; an unnamed single fd is taken too).
    """
    env = os.environ if environ is None else environ
    if env.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        count = int(env.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    for offset in range(max(0, min(count, 64))):
        fd_name = names[offset] if offset < len(names) else "unknown"
        if fd_name == name or (count == 1 and fd_name in ("unknown", "")):
            sock = socket.socket(fileno=LISTEN_FDS_START + offset)
            os.set_inheritable(sock.fileno(), False)  # workers must not inherit it
            return sock
    return None


class _Handler(_SilentHandler):
    """prometheus-client's quiet handler with a read timeout per connection."""

    timeout = _REQUEST_TIMEOUT_S


class MetricsServer:
    """The HTTP endpoint on an already listening socket, served from one daemon thread.

    Use as a context manager: entering starts the thread, leaving shuts it down and
    closes the socket. ``address`` is (host, port) of the socket.
    """

    def __init__(self, sock: socket.socket, registry: CollectorRegistry) -> None:
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self.address: tuple[str, int] = (str(host), int(port))
        server = ThreadingWSGIServer(self.address, _Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = sock
        server.server_name = self.address[0]
        server.server_port = self.address[1]
        server.setup_environ()
        server.set_app(make_wsgi_app(registry))
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="gpuwatchd-metrics", daemon=True
        )

    def __enter__(self) -> MetricsServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._server.server_close()


def write_textfile(path: str | Path, registry: CollectorRegistry) -> None:
    """Write the exposition atomically to ``path`` (a temp file renamed over it), for
    node_exporter's textfile collector. Raises OSError."""
    write_to_textfile(str(path), registry)
