"""sd_notify(3) for the daemon: readiness, status, watchdog pings, reload and stop.

Specification: docs/modules.md#gpuwatchdsystemd
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Final

import sdnotify

__all__ = ["SYSTEMD_NOTIFY_ENV_VARS", "Notifier", "strip_notify_env", "watchdog_interval_s"]

#: Variables systemd sets for the main process only (sd_notify(3), sd_watchdog_enabled(3)).
#: Child processes (managed workers) must not inherit them: with ``NotifyAccess=main`` their
#: messages are rejected and logged by systemd, and ``WATCHDOG_PID`` would not match them.
SYSTEMD_NOTIFY_ENV_VARS: Final[tuple[str, ...]] = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")



def _log() -> Any:
    """This module's logger, imported when first needed: :func:`strip_notify_env` is used
    by ``gpuwatchd replay`` and ``gpuwatchctl``, which need no structlog (docs/benchmarks.md)."""
    from gpuwatchd.logs import get_logger

    return get_logger("gpuwatchd.systemd")


def strip_notify_env(env: Mapping[str, str]) -> dict[str, str]:
    """Return a copy of ``env`` without :data:`SYSTEMD_NOTIFY_ENV_VARS`.

    Use it for the environment of processes the daemon starts, the equivalent of
    sd_notify(3)'s ``unset_environment`` for children only (the daemon keeps its own).
    """
    return {k: v for k, v in env.items() if k not in SYSTEMD_NOTIFY_ENV_VARS}


def watchdog_interval_s(
    environ: Mapping[str, str] | None = None, *, pid: int | None = None
) -> float | None:
    """How often to send ``WATCHDOG=1``, in seconds, or ``None`` when the watchdog is off.

    Follows sd_watchdog_enabled(3): the watchdog is on when ``$WATCHDOG_USEC`` holds a
    positive decimal number of microseconds (systemd sets it from ``WatchdogSec=``) and,
    if ``$WATCHDOG_PID`` is set, it equals our pid (``pid``, default :func:`os.getpid`).
    The returned interval is *half* the timeout, as sd_watchdog_enabled(3) recommends
    ("the daemon should call sd_notify ... WATCHDOG=1 ... every half of that time").

    ``environ`` defaults to :data:`os.environ`, read at call time. A malformed value
    (not a positive integer) is logged as a warning and treated as "off"; nothing is
    raised, matching sd_watchdog_enabled(3), which then returns a negative errno.
    """
    env = os.environ if environ is None else environ
    raw_usec = env.get("WATCHDOG_USEC")
    if raw_usec is None:
        return None
    raw_pid = env.get("WATCHDOG_PID")
    if raw_pid is not None:
        try:
            watchdog_pid = int(raw_pid)
        except ValueError:
            _log().warning("systemd.watchdog_pid_invalid", watchdog_pid=raw_pid)
            return None
        if watchdog_pid != (os.getpid() if pid is None else pid):
            return None  # the watchdog is meant for another process (e.g. our parent)
    try:
        usec = int(raw_usec)
    except ValueError:
        usec = -1
    if usec <= 0:
        _log().warning("systemd.watchdog_usec_invalid", watchdog_usec=raw_usec)
        return None
    return usec / 2 / 1_000_000


def _monotonic_usec() -> int:
    """``CLOCK_MONOTONIC`` in microseconds, the clock sd_notify(3) names for MONOTONIC_USEC."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def _one_line(text: str) -> str:
    """Collapse ``text`` to one line: sd_notify(3) ``STATUS=`` is a single-line string."""
    return " ".join(text.split())


class Notifier:
    """Sends sd_notify(3) messages to systemd; does nothing outside systemd.

    ``$NOTIFY_SOCKET`` is read when the notifier is constructed. It is "enabled" when
    the variable names a Unix socket: a path starting with ``/`` or an abstract socket
    starting with ``@`` (sdnotify maps ``@`` to the leading NUL byte itself). Any other
    value (unset, empty, ``vsock:...``) disables it. The socket is connected lazily on
    the first message. Every method is safe to call from any thread and never raises;
    the first send failure is logged as a warning (later ones are dropped silently).

    Typical sequence (sd_notify(3)): :meth:`ready` once serving, :meth:`status` with a
    one-line summary, :meth:`watchdog` every :meth:`watchdog_interval_s` seconds from
    the tick, :meth:`reloading` then :meth:`ready_after_reload` around a SIGHUP reload,
    :meth:`stopping` when shutdown begins.
    """

    def __init__(self) -> None:
        address = os.environ.get("NOTIFY_SOCKET", "")
        self._address: str | None = address if address[:1] in ("/", "@") else None
        if address and self._address is None:
            _log().warning("systemd.notify_socket_unsupported", notify_socket=address)
        self._lock = threading.Lock()
        self._notifier: Any = None  # sdnotify.SystemdNotifier once connected
        self._failed = False

    @property
    def enabled(self) -> bool:
        """True when ``$NOTIFY_SOCKET`` named a Unix socket at construction time."""
        return self._address is not None

    def ready(self) -> None:
        """``READY=1``: start-up is complete (sd_notify(3); ends ``Type=notify`` start-up)."""
        self._send("READY=1")

    def status(self, text: str) -> None:
        """``STATUS=<text>``: free-form one-line status shown by ``systemctl status``.

        Newlines and runs of whitespace in ``text`` are collapsed to single spaces.
        """
        self._send(f"STATUS={_one_line(text)}")

    def watchdog(self) -> None:
        """``WATCHDOG=1``: keep-alive ping for ``WatchdogSec=`` (sd_notify(3))."""
        self._send("WATCHDOG=1")

    def reloading(self) -> None:
        """``RELOADING=1`` plus ``MONOTONIC_USEC=<CLOCK_MONOTONIC in µs>``.

        sd_notify(3): a service reloading its configuration sends ``RELOADING=1`` and,
        for ``Type=notify-reload``, must include ``MONOTONIC_USEC=`` so the manager can
        order reload cycles; it sends ``READY=1`` (:meth:`ready_after_reload`) when done.
        """
        self._send(f"RELOADING=1\nMONOTONIC_USEC={_monotonic_usec()}")

    def ready_after_reload(self) -> None:
        """``READY=1`` after :meth:`reloading`: the reload is complete (sd_notify(3))."""
        self._send("READY=1")

    def stopping(self) -> None:
        """``STOPPING=1``: shutdown has begun (sd_notify(3))."""
        self._send("STOPPING=1")

    def watchdog_interval_s(self) -> float | None:
        """Half of ``$WATCHDOG_USEC`` in seconds, or ``None``; see :func:`watchdog_interval_s`.

        Always ``None`` when the notifier is disabled: without a notify socket there is
        nobody to ping.
        """
        if not self.enabled:
            return None
        return watchdog_interval_s()

    def _send(self, state: str) -> None:
        """Send one datagram ``state``; never raises (see the class docstring)."""
        if self._address is None:
            return
        with self._lock:
            try:
                if self._notifier is None:
                    # debug=True makes sdnotify raise instead of silently swallowing, so
                    # that we can log the failure once; we still never propagate it.
                    self._notifier = sdnotify.SystemdNotifier(debug=True)
                self._notifier.notify(state)
            except Exception as exc:  # OSError, or TypeError from a broken socket object
                self._notifier = None
                if not self._failed:
                    self._failed = True
                    _log().warning(
                        "systemd.notify_failed",
                        notify_socket=self._address,
                        state=state.split("\n", 1)[0],
                        error=str(exc),
                    )
