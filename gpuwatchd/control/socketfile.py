"""The control socket's file: bound with its mode and group before listening, a stale one
removed, and only our own one unlinked on close (docs/design.md, "Control protocol")."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from pathlib import Path
from typing import Any, Final

from gpuwatchd.errors import GpuwatchError

__all__ = ["SOCKET_MODE", "SocketId", "bind", "remove_stale", "unlink_if_ours"]

SOCKET_MODE: Final = 0o660
"""Mode of the socket file: owner and group may connect (connect(2) needs write permission)."""
_STALE_PROBE_TIMEOUT_S: Final = 1.0

SocketId = tuple[int, int]
"""``(st_dev, st_ino)`` of the socket file this process bound."""


async def remove_stale(path: Path, log: Any) -> None:
    """Remove ``path`` if it is a socket nothing answers on (a dead daemon's leftover).

    Raises :class:`GpuwatchError` if another process listens there, if ``path`` is not a
    socket, or if it cannot be inspected or probed.
    """
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
    log.info("control.stale_socket_removed", path=str(path))


def bind(path: Path, gid: int | None, log: Any) -> tuple[socket.socket, SocketId]:
    """A non-blocking Unix stream socket bound at ``path`` with :data:`SOCKET_MODE` and,
    when ``gid`` is given and the process may, that group (a refused chown is logged).

    Raises :class:`OSError`; the file is removed again if it was created.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = False
    try:
        sock.bind(os.fspath(path))
        bound = True
        os.chmod(path, SOCKET_MODE)
        if gid is not None:
            try:
                os.chown(path, -1, gid)
            except PermissionError as exc:
                log.warning(
                    "control.chown_failed",
                    path=str(path),
                    gid=gid,
                    error=exc.strerror or str(exc),
                )
        info = os.stat(path)
        sock.setblocking(False)
    except OSError:
        sock.close()
        if bound:
            with contextlib.suppress(OSError):
                path.unlink()
        raise
    return sock, (info.st_dev, info.st_ino)


def unlink_if_ours(path: Path, socket_id: SocketId | None) -> None:
    """Remove ``path`` if it is still the socket file with ``socket_id``; quiet otherwise."""
    try:
        info = path.lstat()
    except OSError:
        return
    if (info.st_dev, info.st_ino) == socket_id:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
