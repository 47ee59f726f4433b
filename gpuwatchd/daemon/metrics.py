"""The daemon's metrics export: what a scrape reads (:class:`MetricsSources`), the endpoints.

Everything here runs on the event loop except the HTTP server's thread, which asks the
loop for a :class:`~gpuwatchd.metrics.view.MetricsView` (docs/metrics.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd import __version__
from gpuwatchd.config import Settings
from gpuwatchd.control.server import ControlServer
from gpuwatchd.daemon.restore import JournalKeeper
from gpuwatchd.daemon.tick import Ticker
from gpuwatchd.errors import ConfigError
from gpuwatchd.jobs.supervisor import Supervisor
from gpuwatchd.metrics.account import MetricsAccount
from gpuwatchd.metrics.sockets import (
    ActivationError,
    activated_socket,
    listen_socket,
    parse_listen,
)
from gpuwatchd.metrics.view import ManagedJobView, MetricsView
from gpuwatchd.model import Snapshot
from gpuwatchd.policy.engine import PolicyEngine

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.metrics.serve import MetricsServer

__all__ = ["TEXTFILE_MIN_PERIOD_S", "MetricsExport", "MetricsSources"]

TEXTFILE_MIN_PERIOD_S: Final = 5.0
"""The textfile is rewritten every tick interval, but not more often than this
(node_exporter reads it at each of its scrapes, commonly every 15 s or more)."""



def studies_of(settings: Settings) -> dict[str, str]:
    """The Optuna study of each managed job that has one (job name -> study name), for
    :class:`MetricsAccount`."""
    return {job.name: job.optuna.study for job in settings.jobs if job.optuna}


@dataclass(frozen=True, slots=True)
class MetricsSources:
    """The parts of the daemon a scrape reads, handed to :class:`MetricsExport` (it reads
    them, never changes them): ``settings``, the policy ``engine`` (paused, ladders), the
    ``ticker`` (snapshot, findings, Xid log, tick counts), the journal ``keeper`` (failed
    writes), the control ``server`` (attached jobs) and the ``supervisor`` (managed
    workers; None without ``jobs:``)."""

    settings: Settings
    engine: PolicyEngine
    ticker: Ticker
    keeper: JournalKeeper
    server: ControlServer
    supervisor: Supervisor | None


class MetricsExport:
    """The daemon's :class:`MetricsView` and the endpoints of ``--metrics-listen``,
    ``--metrics-textfile`` and a systemd-activated ``metrics`` socket.

    Made by the :class:`~gpuwatchd.daemon.Daemon` after its parts: ``sources`` what a
    scrape reads; ``account`` the counts the ticker (each tick) and the journal keeper
    (each decision that reached its outcome) feed; ``started_at_s``: the daemon's start,
    Unix seconds.
    """

    def __init__(
        self,
        sources: MetricsSources,
        account: MetricsAccount,
        started_at_s: float,
        logger: Any,
    ) -> None:
        self._sources = sources
        self._started_at_s = started_at_s
        self._settings = sources.settings
        self._log = logger
        self._hostname = socket.gethostname()
        self.account = account
        self.server: MetricsServer | None = None

    def view(self) -> MetricsView:
        """The daemon's state now, for one scrape (on the event loop: references to its
        frozen values and copies of its counts)."""
        sources = self._sources
        ticker = sources.ticker
        jobs = sources.server.jobs()
        return MetricsView(
            version=__version__,
            started_at_s=self._started_at_s,
            ticks=ticker.stats.ticks,
            failed_ticks=ticker.stats.failed_ticks,
            paused=sources.engine.paused,
            snapshot=ticker.last_snapshot,
            jobs=jobs,
            findings=tuple(ticker.active.values()),
            managed=self._managed(),
            journal_failed_writes=sources.keeper.failed_writes,
            xid_totals=dict(ticker.xid_log.totals),
            account=self.account.copy(),
            process_slurm=self._process_slurm(ticker.last_snapshot),
        )

    @staticmethod
    def _process_slurm(snapshot: Snapshot | None) -> dict[int, str]:
        """The Slurm job id of each GPU process of ``snapshot`` that runs in one, as
        ``status`` shows it (:attr:`~gpuwatchd.model.Snapshot.process_slurm`)."""
        if snapshot is None:
            return {}
        return {pid: slurm.job_id for pid, slurm in snapshot.process_slurm}

    def _managed(self) -> tuple[ManagedJobView, ...]:
        supervisor = self._sources.supervisor
        if supervisor is None:
            return ()
        out = []
        for job in self._settings.jobs:
            states: dict[str, int] = {}
            restarts = 0
            for worker in supervisor.workers(job.name):
                states[worker.state] = states.get(worker.state, 0) + 1
                restarts += worker.restarts
            ladder = self._sources.engine.parallelism(job.name)
            out.append(
                ManagedJobView(
                    job=job.name,
                    parallelism=job.workers if ladder is None else ladder,
                    min_workers=job.min_workers,
                    max_workers=job.workers,
                    workers=states,
                    restarts=restarts,
                    study=job.optuna.study if job.optuna else None,
                )
            )
        return tuple(out)

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        """Open what the settings and the environment ask for; ``stack`` closes it.

        A socket systemd passed (``FileDescriptorName=metrics``) comes first, then
        ``--metrics-listen``. Raises :class:`ConfigError` when ``--metrics-listen``
        cannot be bound; a bad systemd fd is logged (``metrics.activation_failed``) and
        the daemon runs without the endpoint.
        """
        loop = asyncio.get_running_loop()
        where = "systemd socket"
        try:
            sock = activated_socket()
        except ActivationError as exc:
            self._log.error("metrics.activation_failed", error=str(exc))
            sock = None
        if sock is None and self._settings.metrics_listen is not None:
            try:
                host, port = parse_listen(self._settings.metrics_listen)
                sock = listen_socket(host, port)
            except (ValueError, OSError) as exc:
                text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise ConfigError(
                    f"metrics: cannot listen on {self._settings.metrics_listen}: {text}"
                ) from None
            where = "--metrics-listen"
        if sock is not None:
            from gpuwatchd.metrics.serve import MetricsServer, loop_source, make_registry

            registry = make_registry(loop_source(loop, self.view), self._hostname)
            self.server = stack.enter_context(MetricsServer(sock, registry))
            self._log.info("metrics.listening", address=list(self.server.address), source=where)
        if self._settings.metrics_textfile is not None:
            task = loop.create_task(self._textfile_loop(self._settings.metrics_textfile))
            stack.callback(task.cancel)

    async def _textfile_loop(self, path: str) -> None:
        from gpuwatchd.metrics.serve import make_registry, write_textfile

        period_s = max(self._settings.interval_s, TEXTFILE_MIN_PERIOD_S)
        failing = False
        while True:
            await asyncio.sleep(period_s)  # first after some ticks: never an empty file
            registry = make_registry(_fixed(self.view()), self._hostname)
            try:
                await asyncio.to_thread(write_textfile, path, registry)
            except OSError as exc:
                if not failing:
                    self._log.warning("metrics.textfile_failed", path=path, error=str(exc))
                failing = True
            else:
                if failing:
                    self._log.info("metrics.textfile_recovered", path=path)
                failing = False


def _fixed(view: MetricsView) -> Callable[[], MetricsView | None]:
    """A view source that always returns ``view`` (taken on the loop)."""
    return lambda: view
