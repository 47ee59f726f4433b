"""The daemon's metrics export: which endpoint to open, the textfile loop, the counters' feed."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gpuwatchd.errors import ConfigError
from gpuwatchd.metrics.collector import DaemonCounters
from gpuwatchd.metrics.serve import (
    MetricsServer,
    activated_socket,
    listen_socket,
    loop_status_source,
    make_registry,
    parse_listen,
    write_textfile,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.config import Settings
    from gpuwatchd.supervisor.records import WorkerCrash

__all__ = ["MetricsExport"]


class MetricsExport:
    """Counters fed by the daemon, and the endpoints of ``--metrics-listen``,
    ``--metrics-textfile`` and a systemd-activated ``metrics`` socket.

    ``status``: the daemon's ``status_report`` (called on the event loop only).
    """

    def __init__(
        self, settings: Settings, status: Callable[[], Mapping[str, Any]], logger: Any
    ) -> None:
        self.counters = DaemonCounters()
        self._settings = settings
        self._status = status
        self._log = logger
        self._hostname = socket.gethostname()

    def crashed(self, crash: WorkerCrash) -> WorkerCrash:
        """Count ``crash`` (unless the supervisor stopped the worker itself); returns it."""
        if not crash.intentional:
            self.counters.worker_crashed(crash.job, crash.crash_info.kind)
        return crash

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        """Open what the settings and the environment ask for; ``stack`` closes it.

        Raises :class:`ConfigError` when ``--metrics-listen`` cannot be bound.
        """
        loop = asyncio.get_running_loop()
        sock = activated_socket()
        where = "systemd socket"
        if sock is None and self._settings.metrics_listen is not None:
            host, port = parse_listen(self._settings.metrics_listen)
            try:
                sock = listen_socket(host, port)
            except OSError as exc:
                raise ConfigError(
                    f"metrics: cannot listen on {host}:{port}: {exc.strerror or exc}"
                ) from None
            where = "--metrics-listen"
        if sock is not None:
            source = loop_status_source(loop, self._status)
            server = stack.enter_context(
                MetricsServer(sock, make_registry(source, self.counters, self._hostname))
            )
            self._log.info("metrics.listening", address=list(server.address), source=where)
        if self._settings.metrics_textfile is not None:
            task = loop.create_task(self._textfile_loop(self._settings.metrics_textfile))
            stack.callback(task.cancel)

    async def _textfile_loop(self, path: str) -> None:
        period_s = max(self._settings.interval_s, 5.0)
        failing = False
        while True:
            await asyncio.sleep(period_s)  # first after some ticks: never an empty file
            registry = make_registry(_fixed(self._status()), self.counters, self._hostname)
            try:
                await asyncio.to_thread(write_textfile, path, registry)
            except OSError as exc:
                if not failing:
                    self._log.warning("metrics.textfile_failed", path=path, error=str(exc))
                failing = True
            else:
                failing = False


def _fixed(status: Mapping[str, Any]) -> Callable[[], Mapping[str, Any] | None]:
    """A status source that always returns ``status`` (taken on the loop)."""
    return lambda: status
