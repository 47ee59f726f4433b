"""The tick: sample -> policy engine -> write-ahead journal -> act, then READY/WATCHDOG/STATUS.

One tick runs every ``interval_s`` on the event loop, so a stuck loop stops the watchdog
pings and systemd restarts the daemon (``WatchdogSec=``, systemd.service(5)).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Final

from gpuwatchd.actuators import Actuator, DecisionRecord
from gpuwatchd.config import Settings
from gpuwatchd.cordon import CordonActions
from gpuwatchd.daemon.restore import PRUNE_EVERY_S, JournalKeeper
from gpuwatchd.daemon.xids import XidWatch
from gpuwatchd.jobs.attribution import TrialAttribution
from gpuwatchd.jobs.crashes import CrashHandler
from gpuwatchd.jobs.procfs import PidSlurmJobs
from gpuwatchd.jobs.records import WorkerCrash
from gpuwatchd.jobs.runner import JobRunner
from gpuwatchd.metrics.account import MetricsAccount
from gpuwatchd.model import (
    NA,
    Decision,
    Finding,
    GpuSample,
    HostSample,
    JobInfo,
    SlurmJob,
    Snapshot,
)
from gpuwatchd.policy.actions import public_params
from gpuwatchd.policy.engine import PolicyEngine
from gpuwatchd.sampling import GpuSampler
from gpuwatchd.sampling.host import HostSampler
from gpuwatchd.sampling.open import open_gpu_sampler
from gpuwatchd.systemd import Notifier
from gpuwatchd.xid import XidEvent, XidLog

if TYPE_CHECKING:  # pragma: no cover - typing only
    from apscheduler.schedulers.asyncio import AsyncIOScheduler

    from gpuwatchd.control.server import ControlServer
    from gpuwatchd.slurm_actions import SlurmActions

__all__ = [
    "INITIAL_SAMPLE_POLL_S",
    "INITIAL_SAMPLE_WAIT_S",
    "MAX_FAILED_TICKS_IN_ROW",
    "TickStats",
    "Ticker",
]

MAX_FAILED_TICKS_IN_ROW: Final = 30
"""After this many failed ticks in a row the watchdog pings stop (WatchdogSec= restarts us)."""

INITIAL_SAMPLE_WAIT_S: Final = 2.0
"""Seconds (event-loop clock) the first GPU sample, the one managed workers are placed on,
waits at most for a GPU whose first NVML read missed the sampler's deadline. Such a GPU
has no reading yet (NA memory) and ``gpus: auto`` would rank it last, as if full (issue
21: both workers on GPU 0 at load 13-16 on 2 cores, where the daemon's deadline is
``min(CALL_DEADLINE_S, interval / 4)``, 50 ms at ``--interval 0.2``). A healthy H100
answers a whole read in about 10 ms (tests/data/gpu/h100_nvml_probe.json); 2 s is 8x
:data:`gpuwatchd.sampling.nvml.CALL_DEADLINE_S`, and a driver call that is really hung
delays the start by that much, once."""

INITIAL_SAMPLE_POLL_S: Final = 0.05
"""Seconds between two reads of the first sample while a GPU has no reading yet."""


@dataclass(slots=True)
class TickStats:
    """Counters shown by ``gpuwatchctl status``: ticks done and the last tick's duration."""

    ticks: int = 0
    last_tick_duration_s: float = 0.0
    last_tick_at_s: float | None = None
    failed_ticks: int = 0


class Ticker:
    """Runs the tick and keeps what it saw (snapshot, active findings, Xid log, stats).

    The collaborators are the daemon's, made before it (docs/daemon-internals.md,
    "Wiring"): ``server`` the control server (its attached jobs; none before it is
    started), ``xids`` the Xid watch, ``cordons`` the cordon actions (handed each tick's
    GPU inventory), ``account`` the metrics' counts (each tick's snapshot and duration).
    Decisions are carried out once the daemon hands the ticker its actuator
    (:meth:`act_with`, at start); before, a tick only logs them.
    ``clock``: the daemon's clock (seconds).
    ``slurm``: sees each tick's attached jobs (the arrays its ladder acts on) and job
    events, reads those arrays' tasks for unreported crashes (their ``crash`` events go
    into the next snapshot); None off Slurm.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        engine: PolicyEngine,
        keeper: JournalKeeper,
        crashes: CrashHandler,
        attribution: TrialAttribution,
        jobs: JobRunner,
        decisions: deque[DecisionRecord],
        notifier: Notifier,
        server: ControlServer,
        xids: XidWatch,
        cordons: CordonActions,
        account: MetricsAccount,
        clock: Callable[[], float],
        logger: Any,
        slurm: SlurmActions | None = None,
    ) -> None:
        self._settings = settings
        self._slurm = slurm
        self._engine = engine
        self._keeper = keeper
        self._crashes = crashes
        self._attribution = attribution
        self._jobs = jobs
        self.decisions = decisions
        self._notifier = notifier
        self._server = server
        self.xids = xids
        self._cordons = cordons
        self._account = account
        self._actuator: Actuator | None = None
        self._clock = clock
        self._pid_slurm = PidSlurmJobs()
        self._log = logger
        self.stats = TickStats()
        self.active: dict[tuple[str, str], Finding] = {}
        """The findings in force, by (detector, subject): a new dict each tick, never
        changed in place (the status view tells a tick's findings by the dict)."""
        self.last_snapshot: Snapshot | None = None
        self.gpu_sampler: GpuSampler | None = None
        self.host_sampler: HostSampler | None = None
        self._initial_gpus: tuple[GpuSample, ...] = ()
        self._gpu_errors: dict[int, str] = {}
        self._gpu_stale: dict[int, str] = {}
        self._status_line = ""
        self._ready_sent = False
        self._failed_in_row = 0

    def act_with(self, actuator: Actuator) -> None:
        """Carry out the decisions of the ticks from now with ``actuator``."""
        self._actuator = actuator

    # -- samplers ------------------------------------------------------------------------

    def open_samplers(self) -> None:
        """Open the GPU and host samplers (call it before :meth:`tick`)."""
        self.gpu_sampler = open_gpu_sampler(
            self._settings.devices, logger=self._log, interval_s=self._settings.interval_s
        )
        self.host_sampler = HostSampler()
        self.xids.use_sampler(self.gpu_sampler)

    def close_samplers(self) -> None:
        """Close the GPU sampler (idempotent)."""
        if self.gpu_sampler is not None:
            self.gpu_sampler.close()

    @property
    def gpu_status(self) -> str:
        """The GPU sampler's status, ``"starting"`` before it is open."""
        return self.gpu_sampler.status if self.gpu_sampler else "starting"

    async def sample_initial_gpus(self) -> None:
        """Take a first GPU sample for placing managed workers before the first tick.

        A GPU whose first read missed the sampler's deadline (``stale`` with no reading
        yet) is read again every :data:`INITIAL_SAMPLE_POLL_S` until it has one (the
        sampler then hands its last complete read) or :data:`INITIAL_SAMPLE_WAIT_S`
        passed; one still without a reading is logged ``gpu.stale`` and placement ranks
        its unknown memory last (:mod:`gpuwatchd.jobs.placement`). Never raises: a
        failing sampler is logged and leaves no sample.
        """
        sampler = self.gpu_sampler
        if self._initial_gpus or sampler is None:
            return
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + INITIAL_SAMPLE_WAIT_S
        while True:
            try:
                gpus = sampler.sample(self._clock())
            except Exception as exc:
                self._log.error("gpu sampling failed", error=f"{type(exc).__name__}: {exc}")
                return
            self._initial_gpus = gpus
            unread = [g for g in gpus if g.stale is not None and g.memory_used_bytes is NA]
            if not unread:
                return
            if loop.time() >= give_up_at:
                self._log_gpu_errors(tuple(unread))  # gpu.stale once; a tick clears it
                return
            await asyncio.sleep(INITIAL_SAMPLE_POLL_S)

    def gpu_inventory(self) -> tuple[GpuSample, ...]:
        """The GPUs the supervisor places workers on: the last snapshot's (or the first sample)."""
        snap = self.last_snapshot
        return snap.gpus if snap is not None and snap.gpus else self._initial_gpus

    def _sample_gpus(self) -> tuple[float, tuple[GpuSample, ...], str, tuple[XidEvent, ...]]:
        """The GPUs' sample: ``(now_s, gpus, gpu_status, xids)`` for :meth:`_snapshot`; a
        failing sampler degrades it."""
        assert self.gpu_sampler is not None
        now = self._clock()
        gpu_status = self.gpu_sampler.status
        try:
            gpus = self.gpu_sampler.sample(now)
        except Exception as exc:
            self._log.error("gpu sampling failed", error=f"{type(exc).__name__}: {exc}")
            gpus, gpu_status = (), f"degraded: {type(exc).__name__}: {exc}"
        self._log_gpu_errors(gpus)
        self.xids.poll(now)
        xids = self.xids.take_pending()
        return now, gpus, gpu_status, xids

    def _sample_host(self, now: float, jobs: tuple[JobInfo, ...]) -> HostSample | None:
        """The host's sample with each of ``jobs``' processes (psutil: /proc reads, about
        50 us a job); None when it fails. Touches the host sampler alone, which only the
        tick uses: :meth:`tick_steps` runs it in a worker thread."""
        assert self.host_sampler is not None
        try:
            return self.host_sampler.sample(now, [job.pid for job in jobs])
        except Exception as exc:
            self._log.error("host sampling failed", error=f"{type(exc).__name__}: {exc}")
            return None

    def _snapshot(
        self,
        jobs: tuple[JobInfo, ...],
        now: float,
        gpus: tuple[GpuSample, ...],
        gpu_status: str,
        xids: tuple[XidEvent, ...],
        host: HostSample | None,
    ) -> Snapshot:
        """The :class:`Snapshot` of :meth:`_sample_gpus`'s sample, ``host`` and the job
        events."""
        events = self._crashes.take_events()
        if self._slurm is not None:
            self._slurm.note_events(events)  # the trials Slurm tasks ran, for their crashes
            events += self._slurm.take_events()  # tasks dead without their hook's word
        supervisor = self._jobs.supervisor
        managed = supervisor.job_states() if supervisor is not None else ()
        return Snapshot(
            timestamp_s=now,
            gpus=gpus,
            host=host,
            jobs=jobs,
            gpu_status=gpu_status,
            events=events,
            managed=managed,
            xids=xids,
            process_slurm=self._process_slurm(jobs, gpus),
        )

    def _process_slurm(
        self, jobs: tuple[JobInfo, ...], gpus: tuple[GpuSample, ...]
    ) -> tuple[tuple[int, SlurmJob], ...]:
        """:attr:`~gpuwatchd.model.Snapshot.process_slurm`: the Slurm job of each GPU
        process, the one its attached job's hello named, else the one its environment and
        cgroup path say (read for processes without such a hello only); in pid order."""
        on_gpus = {process.pid for gpu in gpus for process in gpu.processes}
        named = {job.pid: job.slurm for job in jobs if job.slurm is not None}
        hellos = [(pid, slurm) for pid, slurm in named.items() if pid in on_gpus]
        read = self._pid_slurm(pid for pid in on_gpus if pid not in named)
        return tuple(sorted((*hellos, *read), key=lambda item: item[0]))

    def _log_gpu_errors(self, gpus: tuple[GpuSample, ...]) -> None:
        for gpu in gpus:
            was_stale = self._gpu_stale.get(gpu.index)
            if gpu.stale != was_stale:
                if gpu.stale is None:
                    self._gpu_stale.pop(gpu.index, None)
                    self._log.info("gpu.stale_cleared", gpu=gpu.index, gpu_uuid=gpu.uuid)
                elif was_stale is None:
                    self._gpu_stale[gpu.index] = gpu.stale
                    self._log.error(
                        "gpu.stale",
                        gpu=gpu.index,
                        gpu_uuid=gpu.uuid,
                        call=gpu.stale,
                    )
            previous = self._gpu_errors.get(gpu.index)
            if gpu.error != previous:
                if gpu.error is None:
                    self._gpu_errors.pop(gpu.index, None)
                    self._log.info("gpu recovered", gpu=gpu.index, gpu_uuid=gpu.uuid)
                else:
                    self._gpu_errors[gpu.index] = gpu.error
                    self._log.error(
                        "gpu degraded", gpu=gpu.index, gpu_uuid=gpu.uuid, error=gpu.error
                    )

    # -- Xid errors ----------------------------------------------------------------------

    @property
    def xid_log(self) -> XidLog:
        """The Xid errors seen (the :class:`~gpuwatchd.daemon.xids.XidWatch`'s log)."""
        return self.xids.log

    def poll_xid(self, now: float) -> None:
        """Drain the GPU sampler's pending Xid errors (:meth:`XidWatch.poll`)."""
        self.xids.poll(now)

    def xid_evidence(self, crash: WorkerCrash) -> tuple[XidEvent, ...]:
        """The Xid errors on ``crash``'s GPU around its time (:meth:`XidWatch.evidence`)."""
        return self.xids.evidence(crash)

    def xid_watch(self) -> dict[str, Any] | None:
        """``status``'s ``xid_watch``: which GPUs report Xid errors (None without NVML)."""
        sampler: Any = self.gpu_sampler
        devices = getattr(sampler, "xid_devices", None)
        if devices is None:
            return None
        return {
            "gpus": list(devices),
            "unsupported": {str(k): v for k, v in sampler.xid_unsupported.items()},
            "error": sampler.xid_error,
        }

    # -- the tick ------------------------------------------------------------------------

    def tick(self, jobs: tuple[JobInfo, ...] = ()) -> Snapshot:
        """One tick: sample, detect, decide, journal, act. Returns the snapshot it worked on.

        Must run on the event loop when decisions may include ``set_knob`` (the
        actuator starts a task there). :meth:`tick_steps` is the same tick in steps.
        """
        steps = self._steps(jobs)
        work = next(steps)
        with contextlib.suppress(StopIteration):
            while True:
                work = steps.send(work() if work is not None else None)
        assert self.last_snapshot is not None
        return self.last_snapshot

    async def tick_steps(self, jobs: tuple[JobInfo, ...] = ()) -> Snapshot:
        """:meth:`tick`, giving the event loop a turn between its steps (see :meth:`_steps`)
        and sampling the host in a worker thread, so that a ``status`` or a job's report
        that arrives during a tick is answered before the tick ends (issue 24: with 64
        attached jobs the host's sample is 3 of the tick's 4 ms of CPU, docs/benchmarks.md).
        ``stats.last_tick_duration_s`` counts the steps alone."""
        steps = self._steps(jobs)
        work = next(steps)
        with contextlib.suppress(StopIteration):
            while True:
                if work is None:
                    await asyncio.sleep(0)
                    work = steps.send(None)
                else:
                    work = steps.send(await asyncio.to_thread(work))
        assert self.last_snapshot is not None
        return self.last_snapshot

    def _steps(
        self, jobs: tuple[JobInfo, ...]
    ) -> Generator[Callable[[], HostSample | None] | None, HostSample | None, None]:
        """The tick's steps, one per ``send``: each yields None (a turn) or the host's
        sample to take (its result sent back): the supervisor's and Slurm's view of
        ``jobs``; the GPUs' sample; the host's; the policy engine, the journal and the
        actions (then the tick's snapshot, findings and decisions are published
        together); the GPU inventory; the managed jobs' reconciliation. The duration
        counts the steps' time only, the host's sample included (``time.perf_counter``,
        seconds)."""
        spent_s = 0.0
        started = time.perf_counter()
        if self._slurm is not None:
            self._slurm.observe(jobs)  # the arrays the ladder acts on, between tasks too
        supervisor = self._jobs.supervisor
        if supervisor is not None:
            supervisor.observe(jobs)
            self._attribution.observe(jobs)
            # The supervisor's crash events -> the crash handler (trials failed, then the
            # ``crash`` job event the policy engine sees in a later tick's snapshot).
            for crash in supervisor.take_crashes():
                self._crashes.handle(crash)
        spent_s += time.perf_counter() - started
        yield None
        started = time.perf_counter()
        sampled = self._sample_gpus()
        now = sampled[0]
        host = yield functools.partial(self._sample_host, now, jobs)
        snapshot = self._snapshot(jobs, *sampled, host)
        if self._slurm is not None:
            self._slurm.start_scan(now)  # Slurm's word on tasks that died unreported
        spent_s += time.perf_counter() - started
        yield None
        started = time.perf_counter()
        result = self._engine.step(snapshot)
        active = self._track_findings(result.findings, now)
        actuator = self._actuator
        records = [
            actuator.plan(d)
            if actuator is not None
            else DecisionRecord(d, "dry-run", "no actuator (daemon not running)", now)
            for d in result.decisions
        ]
        # No turn between the engine and the actions: a ``pause`` answered in between
        # would see actions decided before it carried out after it.
        recorded = self._keeper.record_tick(now, result.findings, records)
        if recorded:
            self._crashes.journaled()
        for record in records:
            if not recorded:
                pass  # no action without a record: record_tick marked it failed
            elif actuator is not None:
                actuator.start(record)
            else:
                self._log_unactuated(record.decision)
            self.decisions.append(record)
        self.active = active
        self.last_snapshot = snapshot
        spent_s += time.perf_counter() - started
        yield None
        started = time.perf_counter()
        inventory = self.gpu_inventory()
        self._cordons.note_gpus(inventory)  # the cordoned GPUs' indexes, to the supervisor
        if supervisor is not None:
            supervisor.note_gpus(inventory)  # where workers go next
        spent_s += time.perf_counter() - started
        yield None
        started = time.perf_counter()
        self._jobs.reconcile()
        self.stats.ticks += 1
        self.stats.last_tick_at_s = snapshot.timestamp_s
        self.stats.last_tick_duration_s = spent_s + time.perf_counter() - started
        self._account.observe_tick(snapshot, self.stats.last_tick_duration_s)

    def _log_unactuated(self, decision: Decision) -> None:
        self._log.info(
            "decision",
            policy=decision.policy,
            action=decision.action,
            job=decision.job,
            params=public_params(decision.action, decision.params),
            dry_run=True,
        )

    def _track_findings(
        self, findings: Sequence[Finding], now_s: float
    ) -> dict[tuple[str, str], Finding]:
        """Log findings that start and clear (the journal keeps its own account); returns
        the findings in force, by (detector, subject), for :attr:`active`."""
        current = {(f.detector, f.subject): f for f in findings}
        for key, finding in current.items():
            if key not in self.active:
                self._log.warning(
                    "finding",
                    detector=finding.detector,
                    subject=finding.subject,
                    gpu=finding.gpu_index,
                    job=finding.job,
                    value=round(finding.value, 2),
                    threshold=finding.threshold,
                    held_s=round(now_s - finding.since_s, 1),
                    message=finding.message,
                )
        for key, finding in self.active.items():
            if key not in current:
                self._log.info(
                    "finding cleared",
                    detector=finding.detector,
                    subject=finding.subject,
                    gpu=finding.gpu_index,
                    job=finding.job,
                )
        return current

    async def tick_job(self) -> None:
        """The scheduled tick: :meth:`tick_steps`, then READY (once), WATCHDOG and STATUS."""
        try:
            await self.tick_steps(self._server.jobs())
            self._failed_in_row = 0
        except Exception as exc:
            self.stats.failed_ticks += 1
            self._failed_in_row += 1
            self._log.exception("tick failed", error=f"{type(exc).__name__}: {exc}")
        if not self._ready_sent:
            # After the first tick, failed or not: the socket answers and the loop runs.
            self._ready_sent = True
            self._notifier.ready()
            self._log.info(
                "ready",
                socket=self._settings.socket,
                interval_s=self._settings.interval_s,
                gpus=self.gpu_sampler.status if self.gpu_sampler else None,
            )
        if self._failed_in_row < MAX_FAILED_TICKS_IN_ROW:
            self._notifier.watchdog()
        elif self._failed_in_row == MAX_FAILED_TICKS_IN_ROW:
            self._log.error(
                "every tick fails; no more watchdog pings, systemd will restart the daemon",
                failed_in_row=self._failed_in_row,
            )
        line = self.summary()
        if line != self._status_line:
            self._status_line = line
            self._notifier.status(line)

    def summary(self) -> str:
        """One-line state for systemd's ``STATUS=`` (``systemctl status`` shows it)."""
        snap = self.last_snapshot
        gpus = f"{len(snap.gpus)} GPUs" if snap and snap.gpus else self.gpu_status
        jobs = len(snap.jobs) if snap else 0
        paused = ", paused" if self._engine.paused else ""
        return (
            f"{gpus}, {jobs} jobs, {len(self._engine.policies.policies)} policies, "
            f"{len(self.active)} findings{paused}"
        )

    def schedule(
        self, loop: asyncio.AbstractEventLoop, prune: Callable[[], Awaitable[None]]
    ) -> AsyncIOScheduler:
        """An APScheduler on ``loop`` running :meth:`tick_job` every ``interval_s`` (the
        first at once) and ``prune`` daily; not started. Warns when the interval is too
        long for systemd's watchdog."""
        from apscheduler.schedulers.asyncio import AsyncIOScheduler

        interval_s = self._settings.interval_s
        watchdog_s = self._notifier.watchdog_interval_s()
        if watchdog_s is not None and interval_s > watchdog_s:
            self._log.warning(
                "tick interval is longer than half of WatchdogSec; systemd will restart the daemon",
                interval_s=interval_s,
                watchdog_ping_s=watchdog_s,
            )
        scheduler = AsyncIOScheduler(event_loop=loop)
        scheduler.add_job(
            self.tick_job,
            "interval",
            seconds=interval_s,
            id="tick",
            next_run_time=datetime.now(timezone.utc),
            max_instances=1,
            coalesce=True,
            misfire_grace_time=max(1, math.ceil(interval_s)),
        )
        # A coroutine, so APScheduler runs it on the loop's thread: sqlite3 connections
        # refuse to be used from the executor's threads.
        scheduler.add_job(prune, "interval", seconds=PRUNE_EVERY_S, id="prune")
        return scheduler
