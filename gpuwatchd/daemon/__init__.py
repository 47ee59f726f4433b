"""The composition root: wires samplers, the policy engine, the journal, actuators, the
managed jobs and the control socket into one :class:`Daemon`.

The tick lives in :mod:`.tick`, the journal in :mod:`.restore`, the control ops in
:mod:`.ops`, the HPO crash path in :mod:`gpuwatchd.jobs`. Only :mod:`gpuwatchd.cli`
imports this package; docs/daemon-internals.md names its parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from gpuwatchd import __version__
from gpuwatchd.actuators import Actuator, DecisionRecord, JobCommander
from gpuwatchd.config import Settings
from gpuwatchd.control.peercred import PeerCredentials, admin_gid
from gpuwatchd.control.protocol import EncodedText, Request
from gpuwatchd.control.server import ControlServer
from gpuwatchd.cordon import CORDONS_FILENAME, CordonActions, Cordons, resume_cordons
from gpuwatchd.daemon import ops
from gpuwatchd.daemon.metrics import MetricsExport, MetricsSources, studies_of
from gpuwatchd.daemon.ops import EventSource
from gpuwatchd.daemon.ops.events import events as events_reply
from gpuwatchd.daemon.ops.status import fit
from gpuwatchd.daemon.reload import PolicyLoader
from gpuwatchd.daemon.report import JOB_DICTS, status_dict
from gpuwatchd.daemon.restore import JournalKeeper, restore_horizon_s
from gpuwatchd.daemon.statusview import StatusView
from gpuwatchd.daemon.tick import Ticker, TickStats
from gpuwatchd.daemon.xids import XidWatch
from gpuwatchd.errors import ActionRefused, PolicyError
from gpuwatchd.jobs.actions import SupervisorActions
from gpuwatchd.jobs.attribution import TrialAttribution
from gpuwatchd.jobs.crashes import STOP_HANDLING_TIMEOUT_S, CrashHandler
from gpuwatchd.jobs.drain import DrainRequests
from gpuwatchd.jobs.ledger import CRASH_LEDGER_FILENAME, CrashLedger
from gpuwatchd.jobs.orphans import OrphanSweeper
from gpuwatchd.jobs.procfs import read_cgroup_identity
from gpuwatchd.jobs.runner import JobRunner
from gpuwatchd.jobs.study_recovery import StudyRecovery
from gpuwatchd.jobs.supervisor import Supervisor
from gpuwatchd.journal import Journal
from gpuwatchd.logs import get_logger
from gpuwatchd.metrics.account import MetricsAccount
from gpuwatchd.model import Decision, JobInfo, Snapshot
from gpuwatchd.policy.engine import PolicyEngine
from gpuwatchd.policy.holds import KnobHolds
from gpuwatchd.policy.schema import PolicySet
from gpuwatchd.policyfiles import load_policies, resolve_policy_paths
from gpuwatchd.slurm import Slurm, SlurmError
from gpuwatchd.slurm_actions import SlurmActions, node_name
from gpuwatchd.systemd import Notifier

__all__ = ["Daemon", "TickStats", "restore_horizon_s"]

RECENT_DECISIONS: Final = 50
"""Decisions ``status`` shows (the journal keeps them all)."""


def _scaled_clock(clock: Callable[[], float], speed: float) -> Callable[[], float]:
    """A clock that runs ``speed`` times faster than ``clock`` from now on.

    With ``--devices replay:… --replay-speed N`` the policy engine lives on this
    clock, so ``for:`` durations and cooldowns are measured in trace seconds.
    """
    anchor = clock()

    def scaled() -> float:
        return anchor + (clock() - anchor) * speed

    return scaled


def _ladders(settings: Settings) -> dict[str, tuple[int, int]]:
    """The engine's parallelism ladders, job name -> (ceiling, floor): the managed jobs'
    ``workers``/``min_workers`` and the Slurm arrays' ``max_workers``/``min_workers``."""
    ladders = {job.name: (job.workers, job.min_workers) for job in settings.jobs}
    if settings.slurm is not None:
        for array in settings.slurm.arrays.values():
            ladders[array.name] = (array.max_workers, array.min_workers)
    return ladders


class Daemon:
    """The gpuwatchd daemon: one instance per process.

    ``clock`` (seconds, default :func:`time.time`) stamps snapshots; ``notifier``
    defaults to a :class:`~gpuwatchd.systemd.Notifier` (a no-op outside systemd).
    Use :meth:`run` in a process; :meth:`tick` alone in benchmarks.

    Raises :class:`~gpuwatchd.errors.PolicyError` for broken policies and
    :class:`~gpuwatchd.errors.SupervisorError` for a managed job that cannot run (an
    unknown ``user``, ``user`` without root).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        notifier: Notifier | None = None,
        logger: Any = None,
    ) -> None:
        self.settings = settings
        replay = settings.devices.startswith("replay:")
        if replay and settings.replay_speed != 1.0:
            clock = _scaled_clock(clock, settings.replay_speed)
        self._clock = clock
        self._notifier = notifier or Notifier()
        self.log: Any = logger or get_logger("gpuwatchd.daemon")
        self._started_at_s = clock()
        self._started_monotonic_s = time.monotonic()
        self._policy_paths = resolve_policy_paths(settings.policies)
        self._policies_loaded_at_s = clock()
        # A pause of more than three ticks (daemon stopped, host suspended) breaks every
        # streak; in replay the engine's clock runs replay_speed times faster.
        speed = settings.replay_speed if replay else 1.0
        # the operator's overrides: placed by the knob op, consulted by the tuner and the
        # actuator, rebuilt from the journal at start
        self.knob_holds = KnobHolds(clock)
        self.engine = PolicyEngine(
            load_policies(self._policy_paths),
            dry_run=settings.dry_run,
            max_gap_s=3 * settings.interval_s * speed,
            managed_jobs=_ladders(settings),
            knob_holds=self.knob_holds,
        )
        job_configs = {job.name: job for job in settings.jobs}
        self._stop: asyncio.Event | None = None
        self._loader = PolicyLoader()
        # The parts, in dependency order: each gets the objects it uses, made before it
        # (docs/daemon-internals.md, "Wiring"). What run() opens later (the journal, the
        # socket, the samplers) is opened inside these objects, never swapped in.
        account = MetricsAccount(studies_of(settings))
        decisions: deque[DecisionRecord] = deque(maxlen=RECENT_DECISIONS)
        self.keeper = keeper = JournalKeeper(
            settings, self.engine, decisions, clock, self.log, account=account
        )
        study = StudyRecovery(get_logger("gpuwatchd.jobs.study"))
        ledger = CrashLedger(Path(settings.state_dir) / CRASH_LEDGER_FILENAME, self.log)
        self.cordons: Cordons = Cordons(
            Path(settings.state_dir) / CORDONS_FILENAME, get_logger("gpuwatchd.cordon")
        )
        self.cordons.load()  # before any worker is placed
        drains = DrainRequests()  # the supervisor asks, the job runner answers
        self.supervisor: Supervisor | None = None
        self.managed: SupervisorActions | None = None
        if settings.jobs:
            self.supervisor = Supervisor(
                settings.jobs,
                state_dir=settings.state_dir,
                socket_path=settings.socket,
                clock=clock,
                logger=get_logger("gpuwatchd.jobs"),
                ledger=ledger,
                drains=drains,
                gpus_expected=settings.devices != "none",
                launcher=settings.launcher,
            )
            self.managed = SupervisorActions(
                self.supervisor,
                settings.jobs,
                study,
                get_logger("gpuwatchd.actuators"),
                ledger=ledger,
            )
        self.gpu_cordons = CordonActions(
            self.cordons, self.supervisor, clock, get_logger("gpuwatchd.cordon")
        )
        self.slurm: SlurmActions | None = None
        if settings.slurm is not None:
            self.slurm = SlurmActions(
                Slurm(settings.slurm.conf, timeout_s=settings.slurm.timeout_s),
                settings.slurm.arrays,
                node=node_name(settings.slurm.node, settings.config_path),
                max_drained_nodes=settings.slurm.max_drained_nodes,
                logger=get_logger("gpuwatchd.slurm"),
                study=study,
            )
        self.attribution = TrialAttribution(settings.jobs, study, get_logger("gpuwatchd.jobs"))
        orphans = None
        if self.supervisor is not None:
            orphans = OrphanSweeper(self.supervisor, settings.jobs, study, self.log, ledger=ledger)
        # made now, listening from run(): until then it has no hooks and queues events
        self.server = ControlServer(
            settings.socket,
            self.handle,  # the control ops' entry (ops.dispatch over this daemon)
            admin_gid=admin_gid(settings.admin_group, self.log),
            clock=clock,
            logger=get_logger("gpuwatchd.control"),
            cgroup_of=read_cgroup_identity,
        )
        xids = XidWatch(clock, self.log)
        self.jobs = JobRunner(
            supervisor=self.supervisor,
            managed=self.managed,
            study=study,
            jobs=job_configs,
            engine=self.engine,
            server=self.server,
            drains=drains,
            logger=self.log,
            orphans=orphans,
        )
        self.crashes = CrashHandler(
            ledger=ledger,
            attribution=self.attribution,
            managed=self.managed,
            supervisor=self.supervisor,
            job_names=job_configs,
            server=self.server,
            journals=keeper,
            xids=xids,
            clock=clock,
            logger=self.log,
        )
        # carries out decisions once run() hands it to the ticker (ticks before only log)
        self.actuator = Actuator(
            self.server,
            get_logger("gpuwatchd.actuators"),
            clock,
            on_outcome=keeper.on_outcome,
            managed=self.managed,
            gpus=self.gpu_cordons,
            holds=self.knob_holds,
            slurm=self.slurm,
        )
        self.ticker = Ticker(
            settings=settings,
            engine=self.engine,
            keeper=keeper,
            crashes=self.crashes,
            attribution=self.attribution,
            jobs=self.jobs,
            decisions=decisions,
            notifier=self._notifier,
            server=self.server,
            xids=xids,
            cordons=self.gpu_cordons,
            account=account,
            clock=clock,
            logger=self.log,
            slurm=self.slurm,
        )
        sources = MetricsSources(
            settings=settings,
            engine=self.engine,
            ticker=self.ticker,
            keeper=keeper,
            server=self.server,
            supervisor=self.supervisor,
        )
        self.metrics = MetricsExport(
            sources, account, self._started_at_s, get_logger("gpuwatchd.metrics")
        )
        # -- the status view (issue 24): `status` answered from parts kept encoded
        self.status_view = StatusView(
            settings=settings,
            ticker=self.ticker,
            keeper=self.keeper,
            started_at_s=self._started_at_s,
            started_monotonic_s=self._started_monotonic_s,
        )

    def record_decision(self, decision: Decision) -> DecisionRecord:
        """Journal an operator's ``decision`` as pending (:meth:`JournalKeeper.record_decision`)."""
        return self.keeper.record_decision(decision)

    def decision_done(self, record: DecisionRecord) -> None:
        """Journal the outcome of a record from :meth:`record_decision`."""
        self.keeper.on_outcome(record)

    # -- the parts, for benchmarks and tests ---------------------------------------------

    @property
    def stats(self) -> TickStats:
        """Ticks done and the last tick's duration."""
        return self.ticker.stats

    def open_samplers(self) -> None:
        """Open the GPU and host samplers (:meth:`run` does; call it before :meth:`tick`)."""
        self.ticker.open_samplers()

    def open_journal(self) -> Journal:
        """Open and restore the journal (:meth:`JournalKeeper.open`); :meth:`run` does."""
        return self.keeper.open()

    def close_journal(self) -> None:
        """Close the journal (idempotent, errors logged)."""
        self.keeper.close()

    def tick(self, jobs: tuple[JobInfo, ...] = ()) -> Snapshot:
        """One tick (:meth:`Ticker.tick`)."""
        return self.ticker.tick(jobs)

    def status(self) -> dict[str, Any]:
        """The ``status`` reply (:mod:`gpuwatchd.daemon.ops.status`)."""
        return fit(self.status_report())

    def events(self, params: dict[str, Any]) -> dict[str, Any]:
        """The ``events`` reply (:mod:`gpuwatchd.daemon.ops.events`); raises ProtocolError."""
        return events_reply(self, params)

    # -- what the control ops see (ops.ControlTarget) ------------------------------------

    async def handle(self, request: Request, peer: PeerCredentials) -> Any:
        """Answer one control request (:func:`gpuwatchd.daemon.ops.dispatch`)."""
        return await ops.dispatch(self, request, peer)

    @property
    def paused(self) -> bool:
        """Whether remediation is paused."""
        return self.engine.paused

    def set_paused(self, paused: bool, *, by_uid: int) -> None:
        """Pause or resume remediation (``gpuwatchctl pause``/``resume``)."""
        self.engine.paused = paused
        self.log.warning("remediation " + ("paused" if paused else "resumed"), by_uid=by_uid)

    async def set_cordon(self, gpu: int, cordoned: bool, *, by_uid: int) -> str:
        """``gpuwatchctl gpu cordon|uncordon N``: cordon GPU ``gpu`` (its managed workers
        move) or lift its cordon, whoever set it. Returns what was done (one line); raises
        :class:`~gpuwatchd.errors.ActionRefused` (a GPU not cordoned, a bad index)."""
        by = f"operator uid {by_uid}"
        if cordoned:
            return await self.gpu_cordons.cordon(gpu, None, by, "gpuwatchctl gpu cordon")
        return self.gpu_cordons.uncordon(gpu, None, by=by, operator=True)

    async def resume_node(self, *, by_uid: int) -> tuple[str, str]:
        """``gpuwatchctl node resume``: this node back in service in Slurm, journaled as a
        decision of policy ``operator``. Returns ``(node, detail)``; raises
        :class:`~gpuwatchd.errors.ActionRefused` without ``slurm:`` or when Slurm refuses."""
        if self.slurm is None:
            raise ActionRefused("no slurm: section in the config; gpuwatchd does not act on Slurm")
        node = self.slurm.node
        decision = Decision(
            policy="operator",
            action="resume_node",
            params={"node": node, "by_uid": by_uid},
            timestamp_s=self._clock(),
            findings=(),
            reason=f"gpuwatchctl node resume by uid {by_uid}",
        )
        record = self.record_decision(decision)
        try:
            record.detail = await self.slurm.resume()
            record.outcome = "applied"
        except SlurmError as exc:
            record.outcome, record.detail = "refused", str(exc)
        record.finished_at_s = self._clock()
        self.decision_done(record)
        if record.outcome != "applied":
            raise ActionRefused(record.detail)
        return node, record.detail

    def status_report(self) -> dict[str, Any]:
        """The whole ``status`` object (:func:`gpuwatchd.daemon.report.status_dict`)."""
        return status_dict(
            settings=self.settings,
            ticker=self.ticker,
            keeper=self.keeper,
            jobs=self._attached(),
            managed=self.jobs.report(),
            policies=self.policies_report(),
            paused=self.engine.paused,
            cordons=self.cordons.report(self.ticker.gpu_inventory()),
            holds=self.knob_holds.in_force(),
            started_at_s=self._started_at_s,
            started_monotonic_s=self._started_monotonic_s,
        )

    def status_reply(self, *, full: bool = False, brief: bool = False) -> EncodedText:
        """The ``status`` reply as the socket sends it (:class:`StatusView`); ``full``: with
        each policy's definition (then it is :meth:`status_report`'s object, fitted);
        ``brief``: what ``gpuwatchctl status`` shows (:mod:`gpuwatchd.daemon.ops.status`)."""
        return self.status_view.reply(
            jobs=self._attached(),
            managed=self.jobs.report(),
            policies=self.engine.policies,
            policies_loaded_at_s=self._policies_loaded_at_s,
            paused=self.engine.paused,
            cordons=self.cordons.report(self.ticker.gpu_inventory()),
            holds=self.knob_holds.in_force(),
            full=full,
            brief=brief,
        )

    def jobs_report(self) -> dict[str, Any]:
        """The ``jobs`` reply."""
        snap = self.ticker.last_snapshot
        return {
            "jobs": JOB_DICTS(self._attached(), snap),
            "managed": self.jobs.report(),
        }

    def policies_report(self) -> dict[str, Any]:
        """The ``policy.show`` reply."""
        out = dict(self.engine.policies.to_dict())
        out["loaded_at_s"] = self._policies_loaded_at_s
        out["paused"] = self.engine.paused
        out["dry_run"] = self.settings.dry_run
        return out

    def event_source(self) -> EventSource | None:
        """The open journal."""
        return self.keeper.journal

    def commander(self) -> JobCommander | None:
        """The control server (its hooks answer once :meth:`run` started it)."""
        return self.server

    async def control_job(self, job: str, action: str, *, by_uid: int) -> tuple[int, int]:
        """``gpuwatchctl job start|stop|restart`` (:meth:`JobRunner.control`); the crash
        events of the workers it stopped are handled before the reply (their trials cut
        short are failed and re-enqueued). Raises SupervisorError."""
        try:
            return await self.jobs.control(job, action, by_uid=by_uid)
        finally:
            await self._handle_crashes_now()

    def _attached(self) -> tuple[JobInfo, ...]:
        return self.server.jobs()

    async def reload_policies(self, path: str | None = None) -> PolicySet:
        """Load policies from ``path`` (or the configured sources) and swap them in atomically.

        The files are read and parsed off the event loop (:class:`.reload.PolicyLoader`:
        a worker thread, one at a time, within 10 s). Raises
        :class:`~gpuwatchd.errors.PolicyError` (file and line, or the time limit) and
        keeps the running policies when any file is broken.
        """
        paths = (path,) if path else resolve_policy_paths(self.settings.policies)
        self._notifier.reloading()
        try:
            policies = await self._loader.load(paths)
        except PolicyError as exc:
            self.log.error("policy.reload_failed", error=str(exc))
            raise
        finally:
            self._notifier.ready_after_reload()
        self.engine.reload(policies)
        self._policy_paths = tuple(paths)
        self._policies_loaded_at_s = self._clock()
        self.log.info(
            "policies reloaded",
            sources=list(policies.sources),
            policies=[p.name for p in policies.policies],
        )
        return policies

    # -- process lifecycle ---------------------------------------------------------------

    async def run(self) -> int:
        """Run until SIGTERM/SIGINT (or :meth:`request_stop`); return the exit status (0).

        Every resource is pushed on one exit stack as it is acquired, so a failed start
        releases what was taken and a stop releases it in reverse order.
        """
        self._stop = asyncio.Event()
        Path(self.settings.state_dir).mkdir(parents=True, exist_ok=True)
        async with contextlib.AsyncExitStack() as stack:
            await self._start(stack)
            await self._stop.wait()
        self.log.info("stopped", ticks=self.stats.ticks)
        return 0

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        loop = asyncio.get_running_loop()
        self.keeper.open()  # first: a journal that cannot be opened stops the start
        stack.callback(self.keeper.close)
        self.keeper.restore_holds(self.knob_holds)
        self.ticker.open_samplers()
        stack.callback(self.ticker.close_samplers)
        server = self.server
        server.knob_memory = self.keeper.knob_memory()  # handed back at hello
        await server.start()  # raises when another gpuwatchd listens there
        stack.push_async_callback(server.close)
        await self.metrics.start(stack)  # before any worker starts: it takes LISTEN_FDS
        self.ticker.act_with(self.actuator)
        await self.crashes.replay_ledger()
        await self.keeper.resume_interrupted(self.managed, [j.name for j in self.settings.jobs])
        if self.supervisor is not None:
            await self.ticker.sample_initial_gpus()
        inventory = self.ticker.gpu_inventory()  # then each tick hands the latest
        self.gpu_cordons.note_gpus(inventory)
        if self.supervisor is not None:
            self.supervisor.note_gpus(inventory)
        await self.jobs.restore()  # adopt the workers left running; the dead ones: crashes
        stack.push_async_callback(self._stop_jobs)
        # The workers that ended while no daemon ran: their trials failed and re-enqueued
        # before a replacement starts (it asks the retries first), then the orphan sweep.
        await self._handle_crashes_now()
        await self.jobs.start()
        if self.keeper.journal is not None and not self.settings.dry_run:
            # after the workers are adopted: a resumed cordon moves them too
            await resume_cordons(self.keeper.journal, self.gpu_cordons, self._clock(), self.log)
        stack.push_async_callback(self.actuator.close)
        if self.slurm is not None:
            stack.push_async_callback(self.slurm.close)  # a crash scan in progress
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            stack.callback(loop.remove_signal_handler, signum)
        scheduler = self.ticker.schedule(loop, self.keeper.prune_job)
        self.log.info(
            "starting",
            version=__version__,
            pid=os.getpid(),
            socket=self.settings.socket,
            devices=self.settings.devices,
            policies=list(self._policy_paths),
            dry_run=self.settings.dry_run,
        )
        # What the start built (modules, policies, a replayed trace) lives as long as the
        # daemon: frozen out of the collector's sight, a full collection no longer walks
        # it with the loop held (issue 24; docs/benchmarks.md).
        gc.collect()
        gc.freeze()
        scheduler.start()
        stack.callback(scheduler.shutdown, wait=False)
        stack.callback(self._stopping)

    async def _stop_jobs(self) -> None:
        """Stop the managed jobs (each per its ``on_daemon_stop``), then hand the crash
        events of the workers that ended meanwhile to the crash handler, as a tick does,
        and wait for it (the trials cut short are failed and re-enqueued) before the
        study storages close. No tick runs by now (the scheduler stopped first)."""
        await self.jobs.stop()
        await self._handle_crashes_now(STOP_HANDLING_TIMEOUT_S)
        await self.jobs.close()

    async def _handle_crashes_now(self, timeout_s: float | None = None) -> None:
        """The supervisor's crash events -> the crash handler, as a tick hands them over,
        then wait until they are handled (at most ``timeout_s`` seconds, None: no limit).
        At start (before any replacement worker starts and before the start's orphan
        sweep, which then finds them handled) and at stop (no tick runs any more; within
        the stop budget)."""
        if self.supervisor is not None:
            for crash in self.supervisor.take_crashes():
                self.crashes.handle(crash)
        await self.crashes.finish(timeout_s)

    def _stopping(self) -> None:
        self._notifier.stopping()
        self.log.info("stopping")
        self.jobs.stopping = True

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop cleanly (SIGTERM and SIGINT call this)."""
        if self._stop is not None:
            self._stop.set()

    def _on_sighup(self) -> None:
        self.log.info("SIGHUP: reloading policies")
        self._loader.spawn(self.reload_policies)  # a failure is logged; the policies stay
