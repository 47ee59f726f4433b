"""Who is on the other end of a Unix socket: ``SO_PEERCRED`` plus supplementary groups.

``SO_PEERCRED`` (socket(7), unix(7)) returns the ``struct ucred {pid_t pid; uid_t uid;
gid_t gid;}`` of the peer *as it was when it called connect(2)*: the kernel records it,
so a peer cannot lie about it. The kernel does not hand over supplementary groups on a
stream socket, so they are read from ``/proc/<pid>/status`` (proc(5), line ``Groups:``);
if the process is already gone the set is empty, which can only take rights away.

Linux only, like the daemon.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PeerCredentials", "peer_credentials", "read_supplementary_groups"]

_UCRED = struct.Struct("=iII")
"""``struct ucred`` of socket(7): ``pid_t pid`` (signed), ``uid_t uid``, ``gid_t gid``."""


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The credentials of a connected peer.

    ``pid``, ``uid`` and ``gid`` come from ``SO_PEERCRED`` (kernel-verified at connect
    time); ``groups`` are the peer's supplementary group ids from
    ``/proc/<pid>/status``.
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
    return PeerCredentials(
        pid=pid, uid=uid, gid=gid, groups=read_supplementary_groups(pid, proc_root=proc_root)
    )
