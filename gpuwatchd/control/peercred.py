"""Who is on the other end of a Unix socket: ``SO_PEERCRED`` plus supplementary groups.

``SO_PEERCRED`` (socket(7), unix(7)) returns the ``struct ucred {pid_t pid; uid_t uid;
gid_t gid;}`` of the peer *as it was when it called connect(2)*: the kernel records it,
so a peer cannot lie about it. Supplementary groups come from ``SO_PEERGROUPS``
(socket(7), Linux >= 4.13), recorded by the kernel at connect time too; only where that
option is missing are they read from ``/proc/<pid>/status`` (proc(5), line ``Groups:``),
which races with pid reuse; if the process is already gone the set is empty, which can
only take rights away.

Linux only, like the daemon.
"""

from __future__ import annotations

import errno
import grp
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "SO_PEERGROUPS",
    "PeerCredentials",
    "admin_gid",
    "peer_credentials",
    "peer_groups",
    "read_supplementary_groups",
]

SO_PEERGROUPS = 59
"""``SO_PEERGROUPS`` from <asm-generic/socket.h> (Linux 4.13); Python's socket module lacks it."""
_MAX_GROUPS = 65536
"""NGROUPS_MAX on Linux (limits.h): the largest supplementary group list."""

_UCRED = struct.Struct("=iII")
"""``struct ucred`` of socket(7): ``pid_t pid`` (signed), ``uid_t uid``, ``gid_t gid``."""


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The credentials of a connected peer.

    ``pid``, ``uid`` and ``gid`` come from ``SO_PEERCRED`` (kernel-verified at connect
    time); ``groups`` are the peer's supplementary group ids (``SO_PEERGROUPS``, else
    ``/proc/<pid>/status``).
    """

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()


def read_supplementary_groups(pid: int, *, proc_root: str = "/proc") -> frozenset[int]:
    """Return the supplementary group ids of process ``pid`` (proc(5) ``Groups:`` line).

    Returns an empty set when the process is gone, ``/proc`` is not mounted, or the
    line is missing or unreadable; never raises for those cases.
    """
    try:
        text = (Path(proc_root) / str(pid) / "status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("Groups:"):
            groups: set[int] = set()
            for field in line[len("Groups:") :].split():
                try:
                    groups.add(int(field))
                except ValueError:
                    continue
            return frozenset(groups)
    return frozenset()


def peer_groups(sock: socket.socket) -> frozenset[int] | None:
    """Supplementary group ids of the peer from ``SO_PEERGROUPS``, or None if unsupported.

    The kernel answers ``ERANGE`` when the buffer is too small; the buffer then grows
    up to :data:`_MAX_GROUPS` entries of ``gid_t`` (4 bytes).
    """
    size = 64 * 4
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE and size < _MAX_GROUPS * 4:
                size *= 16
                continue
            if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL):
                return None
            raise
        count = len(raw) // 4
        return frozenset(struct.unpack(f"={count}I", raw[: count * 4]))


def peer_credentials(sock: socket.socket, *, proc_root: str = "/proc") -> PeerCredentials:
    """Return the :class:`PeerCredentials` of the peer of a connected ``AF_UNIX`` socket.

    Raises ``OSError`` if the socket is not connected or the platform has no
    ``SO_PEERCRED`` (not Linux).
    """
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        raise OSError("SO_PEERCRED is not available on this platform (gpuwatchd needs Linux)")
    raw = sock.getsockopt(socket.SOL_SOCKET, option, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    groups = peer_groups(sock)
    if groups is None:
        groups = read_supplementary_groups(pid, proc_root=proc_root)
    return PeerCredentials(pid=pid, uid=uid, gid=gid, groups=groups)


def admin_gid(group: str | None, logger: Any) -> int | None:
    """The gid of the admin group ``group`` (``None`` for none, or an unknown one: logged).

    ``logger``: structlog-style; an unknown group is a warning, not an error, because
    root and the daemon's own user stay admins.
    """
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        logger.warning(
            "control.admin_group_missing",
            group=group,
            detail="only root and the daemon's user are admins",
        )
        return None
