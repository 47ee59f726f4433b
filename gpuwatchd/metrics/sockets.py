"""The metrics endpoint's listening socket: systemd's (socket activation,
sd_listen_fds(3)) or one of ``--metrics-listen HOST:PORT``. No prometheus-client here:
the daemon looks for a socket at every start, and imports :mod:`.serve` only when there
is one (or a textfile to write)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import MutableMapping
from typing import Final

__all__ = [
    "LISTEN_FDS_START",
    "ActivationError",
    "activated_socket",
    "listen_socket",
    "parse_listen",
]

LISTEN_FDS_START: Final = 3
"""The first fd systemd passes (``SD_LISTEN_FDS_START``, sd_listen_fds(3))."""


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


class ActivationError(Exception):
    """systemd passed a ``metrics`` fd that is not a listening stream socket."""


_LISTEN_VARS: Final = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def activated_socket(
    environ: MutableMapping[str, str] | None = None,
    name: str = "metrics",
    *,
    pid: int | None = None,
) -> socket.socket | None:
    """The listening socket systemd passed under ``name``, as sd_listen_fds(3) does it.

    The fds are ours when ``LISTEN_PID`` is this process (``pid``, default
    :func:`os.getpid`); then all ``LISTEN_FDS`` of them (from fd 3) get ``FD_CLOEXEC``.
    The three variables are removed from ``environ`` in any case (``unset_environment``),
    so no worker the daemon starts sees them. The fd whose ``LISTEN_FDNAMES`` entry is
    ``name`` (``FileDescriptorName=`` of the .socket unit) is returned; a single fd
    with no name or systemd's default name (``unknown``, or the unit's name) is taken
    too. None when nothing was passed. Raises :class:`ActivationError` when that fd is
    not a listening ``SOCK_STREAM`` socket (sd_is_socket(3)).
    """
    env = os.environ if environ is None else environ
    listen_pid, count_text, names_text = (env.pop(key, "") for key in _LISTEN_VARS)
    if listen_pid != str(os.getpid() if pid is None else pid):
        return None  # not set, or meant for another process (an inherited environment)
    count = int(count_text) if count_text.isdigit() else 0
    count = min(count, 1024)
    names = names_text.split(":") if names_text else []
    chosen: int | None = None
    for offset in range(count):
        fd = LISTEN_FDS_START + offset
        with contextlib.suppress(OSError):
            os.set_inheritable(fd, False)
        fd_name = names[offset] if offset < len(names) else ""
        if fd_name == name or (
            count == 1 and (fd_name in ("", "unknown") or fd_name.endswith(".socket"))
        ):
            chosen = fd if chosen is None else chosen
    if chosen is None:
        return None
    try:
        sock = socket.socket(fileno=chosen)
    except OSError as exc:
        raise ActivationError(f"fd {chosen} ({name}) is not a socket: {exc}") from None
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.type != socket.SOCK_STREAM or not listening:
        sock.detach()  # not ours to close
        raise ActivationError(f"fd {chosen} ({name}) is not a listening stream socket")
    return sock
