"""Fair use of the control socket: connection limits per uid, a reserve for admins, idle
timeouts, and warnings whose number does not grow with an attack.

No sockets: the server asks :class:`Admission` whether a peer may connect and tells it
when one leaves, and asks :class:`LogLimiter` whether a warning is due. Limits and their
reasons: docs/protocol-internals.md, "Fair use".
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from gpuwatchd.control.peercred import PeerCredentials

__all__ = ["Admission", "ConnectionLimits", "LogLimiter"]

_LOG_KEYS_MAX: Final = 4096
"""Keys a :class:`LogLimiter` remembers; past it, keys older than one interval go."""


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How many connections the server holds and how long a silent one may stay.

    ``max_connections``: connections of non-admin peers in all. ``per_uid``: connections
    one non-admin uid may hold (an HPO study of many workers runs under one uid, hence
    well above one job per GPU). ``admin_reserve``: connections beyond ``max_connections``
    that only admins (root, the daemon's user, the admin group) may use, so
    ``gpuwatchctl status`` as root answers on a flooded socket. With the defaults the
    daemon needs at most 544 descriptors for clients, under systemd's soft
    ``LimitNOFILE`` of 1024. ``first_line_timeout_s``: a connection that sends no
    complete line within this many seconds of connecting is closed.
    ``idle_timeout_s``: a connection that is not a job session (``hello``), has no
    request running and sends nothing for this long is closed; job sessions never time
    out for silence (a job may report once an epoch).
    """

    max_connections: int = 512
    per_uid: int = 128
    admin_reserve: int = 32
    first_line_timeout_s: float = 10.0
    idle_timeout_s: float = 600.0

    def silence_s(self, lines_read: int, job_session: bool) -> float | None:
        """How long a connection that has sent ``lines_read`` lines may now stay silent
        (None: no limit, a job session)."""
        if lines_read == 0:
            return self.first_line_timeout_s
        return None if job_session else self.idle_timeout_s

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.per_uid < 1 or self.admin_reserve < 0:
            raise ValueError("connection limits must be positive (admin_reserve >= 0)")
        if not (self.first_line_timeout_s > 0 and self.idle_timeout_s > 0):
            raise ValueError("connection timeouts must be positive")


class Admission:
    """Counts open connections per uid and decides who may open another.

    ``is_admin(peer)`` says who may use the admin reserve. Not thread-safe (the event
    loop's).
    """

    def __init__(
        self, limits: ConnectionLimits, is_admin: Callable[[PeerCredentials], bool]
    ) -> None:
        self.limits = limits
        self._is_admin = is_admin
        self._by_uid: Counter[int] = Counter()
        self._total = 0

    @property
    def total(self) -> int:
        """Connections admitted and not yet released."""
        return self._total

    def admit(self, peer: PeerCredentials) -> str | None:
        """Count ``peer``'s new connection and return None, or return why it is refused
        (``"per_uid"`` or ``"total"``) and count nothing."""
        limits = self.limits
        if self._is_admin(peer):
            if self._total >= limits.max_connections + limits.admin_reserve:
                return "total"
        elif self._by_uid[peer.uid] >= limits.per_uid:
            return "per_uid"
        elif self._total >= limits.max_connections:
            return "total"
        self._by_uid[peer.uid] += 1
        self._total += 1
        return None

    def release(self, peer: PeerCredentials) -> None:
        """Forget one admitted connection of ``peer``."""
        if self._by_uid[peer.uid] <= 1:
            self._by_uid.pop(peer.uid, None)
        else:
            self._by_uid[peer.uid] -= 1
        self._total = max(0, self._total - 1)


class LogLimiter:
    """At most one log line per key (e.g. event and uid) per ``interval_s`` seconds.

    :meth:`due` answers None while a key's interval runs (counting the suppressed
    occurrence) and, once it is over, the number suppressed since the last line, which
    the caller logs as ``suppressed=N``. So an attack of any size costs one line per uid
    per interval. ``clock`` defaults to ``time.monotonic`` (seconds).
    """

    def __init__(self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self._interval_s = interval_s
        self._clock = clock
        self._keys: dict[object, tuple[float, int]] = {}

    def due(self, key: object) -> int | None:
        """None to stay silent now; else the suppressed count to log with this line."""
        now = self._clock()
        last = self._keys.get(key)
        if last is not None and now - last[0] < self._interval_s:
            self._keys[key] = (last[0], last[1] + 1)
            return None
        if len(self._keys) >= _LOG_KEYS_MAX:
            cutoff = now - self._interval_s
            self._keys = {k: v for k, v in self._keys.items() if v[0] >= cutoff}
        self._keys[key] = (now, 0)
        return 0 if last is None else last[1]
