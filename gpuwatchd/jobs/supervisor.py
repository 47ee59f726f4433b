"""The supervisor: runs each managed job as N worker processes and keeps them running.

One :class:`Supervisor` per daemon, on the daemon's asyncio loop: it launches each slot's
process (:mod:`.launch` or :mod:`.unit_launch`), watches it, carries out the exit table
and the state table of :mod:`.worker` when it ends, stops and drains workers, and after a
daemon restart adopts the workers still running (``workers.json``, :mod:`.workers_file`).
Behaviour in full: docs/supervisor-internals.md and docs/managed-jobs.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpuwatchd.config import JobConfig
from gpuwatchd.control.protocol import exit_line_of
from gpuwatchd.crash import CrashInfo, classify, signal_of
from gpuwatchd.errors import SupervisorError
from gpuwatchd.jobs import launch, unit_launch, workers_file
from gpuwatchd.jobs.drain import DrainRequests
from gpuwatchd.jobs.job import Job
from gpuwatchd.jobs.ledger import CrashLedger
from gpuwatchd.jobs.output import DEFAULT_OUTPUT_MAX_BYTES, OutputFiles, StderrTail
from gpuwatchd.jobs.placement import Placement, choose_gpu
from gpuwatchd.jobs.procfs import (
    is_same_process,
    parent_pid,
    read_environ,
    read_host_oom_kills,
    read_oom_counter,
    read_stat,
    started_wall_s,
)
from gpuwatchd.jobs.records import TrialHolder, WorkerCrash, WorkerInfo
from gpuwatchd.jobs.transient_unit import launch_identifier, unit_name
from gpuwatchd.jobs.worker import (
    EXIT_LINE_NOTE,
    LIVE,
    WORKER_STATES,
    Action,
    Event,
    Intent,
    Phase,
    Worker,
    WorkerState,
    event_of,
    is_intentional,
    phase_of,
)
from gpuwatchd.jobs.worker import transition as exit_transition
from gpuwatchd.jobs.workers_file import STATE_FILE
from gpuwatchd.logs import get_logger
from gpuwatchd.model import GpuSample, JobInfo, ManagedJobState
from gpuwatchd.restart import RestartPolicy

__all__ = [
    "OPERATOR_STOP",
    "SHIM_CLEAN_NOTE",
    "STATE_FILE",
    "UNIT_CLEAN_NOTE",
    "WORKER_STATES",
    "GoneWorker",
    "Supervisor",
    "TrialHolder",
    "WorkerCrash",
    "WorkerInfo",
    "WorkerState",
]

OPERATOR_STOP: Final = "stopped by an operator"
"""The ``held`` reason and note of slots stopped by ``gpuwatchctl job stop``."""
_PARENT_HOPS: Final = 8
"""How far up the process tree a hook's pid is looked for among our workers."""
_CLEAN_EVENTS: Final = frozenset(
    {
        Event.EXITED_CLEAN,
        Event.EXITED_CLEAN_SHUTDOWN,
        Event.EXITED_CLEAN_BY_HOOK,
        Event.EXITED_CLEAN_BY_HOOK_SHUTDOWN,
    }
)
UNIT_CLEAN_NOTE: Final = "exited with status 0 while gpuwatchd was down (its unit says)"
SHIM_CLEAN_NOTE: Final = (
    "exited with status 0 while gpuwatchd was down (its launcher shim's exit file says)"
)
EXIT_FILE_WAIT_S: Final = 2.0
"""How long the exit file of a worker that ended may stay empty before its end is
unknown: the launcher shim writes it within milliseconds of the worker's end, unless it
was killed with the worker."""
_UNIT_ENV: Final = frozenset({"GPUWATCHD_WORKER_ID", "CUDA_VISIBLE_DEVICES"})


@dataclass(frozen=True, slots=True)
class GoneWorker:
    """A worker that ended while no daemon watched it: its record (from ``workers.json``,
    or made from its unit), its launch's stderr and, with the systemd launcher, its
    ended unit whose exit status and ``Result`` systemd kept (``None``: status unknown)."""

    rec: workers_file.RecordedWorker
    tail: StderrTail
    unit: str | None = None


def _check_name(name: str) -> None:
    if not name or name.startswith(".") or "/" in name or "\0" in name:
        raise SupervisorError(f"job name {name!r} cannot name a directory (no '/', no leading '.')")


class Supervisor:
    """Runs managed jobs' workers (behaviour: docs/supervisor-internals.md).

    ``jobs``: the config's :class:`~gpuwatchd.config.JobConfig` entries. ``state_dir``:
    the daemon's state directory (``<state_dir>/jobs/<job>/`` is created). ``socket_path``:
    given to workers as ``GPUWATCHD_SOCKET``. ``clock``: seconds (``time.time``) for the
    timestamps shown and the budget window (process uptimes use :func:`time.monotonic`).
    ``logger``: a structlog-style logger (``info(event, **kw)``). The GPUs it places
    workers on are handed to it by :meth:`note_gpus` (the daemon's latest sample, each
    tick); until then there are none. Every worker that ended without a clean exit is a
    :class:`WorkerCrash` *event*: written into ``ledger`` (the daemon's
    :class:`~gpuwatchd.jobs.ledger.CrashLedger`, if given) before ``workers.json`` stops
    naming the dead process, so a daemon killed in between still finds the death at its
    next start, then put in the supervisor's outbox, which the daemon's tick empties
    (:meth:`take_crashes`) and hands to its crash handler. The supervisor calls nothing
    back: its restart policy goes on at once. ``drains``: where it asks a worker's hook
    to finish its trial and exit (:class:`~gpuwatchd.jobs.drain.DrainRequests`, answered
    by the daemon's job runner through the control server); without it, or while nobody
    answers, drains fall back to SIGTERM.
    An *adopted* worker's exit status is read from its launcher shim's exit file (or its
    unit, with the systemd launcher); a launch of an older daemon, without the shim, ends
    clean only with the hook's exit line in that launch's stderr, else a crash
    (docs/managed-jobs.md, "How a worker's end is known").
    ``auto_restart=False`` leaves crashed workers ``stopped`` for a policy to restart.
    ``poll_interval_s``: how often stderr tails, output caps and adopted workers are
    checked. ``environ``: the base environment of workers (default ``os.environ`` at
    start time, without systemd's ``NOTIFY_SOCKET``/``WATCHDOG_*``). ``gpus_expected``:
    False when the daemon watches no GPUs (``--devices none``): a worker placed without
    a GPU is then normal, not warned about. ``launcher``: ``subprocess`` (children of the
    daemon), ``systemd`` (each worker a transient unit, :mod:`.unit_launch`) or ``auto``
    (systemd when the daemon is itself a unit; :func:`.unit_launch.resolve`).
    The NVML indexes of the cordoned GPUs (:mod:`gpuwatchd.cordon`) are handed to it by
    :meth:`note_cordoned`; they are never chosen for a worker, not even by
    ``restart_worker(gpu=...)`` or ``place_next``.

    Raises :class:`~gpuwatchd.errors.SupervisorError` for a duplicate or unusable job name,
    a bad ``launcher`` or a ``unit_properties`` entry outside the allow-list,
    an unknown ``user``, or a ``user`` other than ours when not root, and
    :class:`~gpuwatchd.errors.ConfigError` for a bad ``restart:`` mapping.
    """

    def __init__(
        self,
        jobs: Sequence[JobConfig],
        *,
        state_dir: str | Path,
        socket_path: str | Path,
        clock: Callable[[], float] = time.time,
        logger: Any = None,
        ledger: CrashLedger | None = None,
        drains: DrainRequests | None = None,
        auto_restart: bool = True,
        poll_interval_s: float = 1.0,
        output_max_bytes: int = DEFAULT_OUTPUT_MAX_BYTES,
        environ: Mapping[str, str] | None = None,
        gpus_expected: bool = True,
        launcher: str = "subprocess",
    ) -> None:
        self._clock = clock
        self._cordoned: frozenset[int] = frozenset()
        self._gpus_expected = gpus_expected
        self._log = logger if logger is not None else get_logger("gpuwatchd.jobs")
        self._launcher = unit_launch.chosen(launcher, environ, self._log if jobs else None)
        self._gpus: tuple[GpuSample, ...] = ()
        self._ledger = ledger
        self._crashes: list[WorkerCrash] = []
        """The outbox: crash events not yet taken by the daemon (:meth:`take_crashes`)."""
        self._drains = drains
        self._auto_restart = auto_restart
        self._poll_interval_s = poll_interval_s
        self._output_max_bytes = output_max_bytes
        self._environ = environ
        self._socket_path = str(socket_path)
        self._jobs_dir = Path(state_dir) / "jobs"
        self._jobs: dict[str, Job] = {}
        for cfg in jobs:
            _check_name(cfg.name)
            if cfg.name in self._jobs:
                raise SupervisorError(f"job {cfg.name!r} is configured twice")
            if not cfg.command:
                raise SupervisorError(f"job {cfg.name!r} has an empty command")
            policy = RestartPolicy.from_mapping(cfg.restart, job=cfg.name)
            unit_launch.check_job(cfg.name, cfg.unit_properties)  # with either launcher
            popen_user, user_env = launch.user_settings(cfg)
            self._jobs[cfg.name] = Job(
                cfg=cfg,
                policy=policy,
                directory=self._jobs_dir / cfg.name,
                allowed_gpus=None if isinstance(cfg.gpus, str) else tuple(cfg.gpus),
                popen_user=popen_user,
                user_env=user_env,
                parallelism=cfg.workers,
                fingerprint=workers_file.fingerprint(cfg),
            )
        self._restored = False
        """Whether :meth:`restore` ran (the workers of an earlier daemon adopted); until
        :meth:`stop`."""
        self._launched = False
        """Whether :meth:`start` ran (the missing workers started)."""
        self._stopping = False
        self._poller: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    def take_crashes(self) -> tuple[WorkerCrash, ...]:
        """The crash events since the last call, oldest first (the daemon's tick takes
        them for its crash handler; a worker the supervisor stopped itself is one with
        ``intentional=True``)."""
        taken, self._crashes = tuple(self._crashes), []
        return taken

    @property
    def crashes_pending(self) -> tuple[WorkerCrash, ...]:
        """The crash events not taken yet (:meth:`take_crashes`), oldest first."""
        return tuple(self._crashes)

    def note_gpus(self, gpus: Sequence[GpuSample]) -> None:
        """The GPUs to place workers on from now: the daemon's latest sample (its tick
        hands each snapshot's; the first sample before :meth:`start`). ``()``: no GPU."""
        self._gpus = tuple(gpus)

    def note_cordoned(self, indexes: frozenset[int]) -> None:
        """The NVML indexes of the cordoned GPUs from now (the daemon's cordon actions
        hand them over at each GPU inventory and each cordon change)."""
        self._cordoned = frozenset(indexes)

    @property
    def job_names(self) -> tuple[str, ...]:
        """The managed jobs' names, in config order."""
        return tuple(self._jobs)

    async def restore(self) -> None:
        """Adopt the still-running workers of an earlier daemon; start none.

        For each job, ``workers.json`` is read: a recorded worker whose pid is alive with
        the recorded start time is adopted; one that is gone ended cleanly or is a crash
        event as its launcher shim's exit file or its unit says (:meth:`_settle_gone`;
        the exit files left empty are waited for :data:`EXIT_FILE_WAIT_S` in all), put in
        the outbox (:meth:`take_crashes`). The recorded parallelism (the ladder's last
        value) is restored, else the config's ``workers``. :meth:`start` then starts the
        missing workers: in between, the daemon fails and re-enqueues the trials of the
        workers that died while it was down, so that a replacement asks their retries
        first. Raises :class:`SupervisorError` if called twice or the state directory is
        unusable.
        """
        if self._restored:
            raise SupervisorError("the supervisor is already started", code="conflict")
        for job in self._jobs.values():
            try:
                job.directory.mkdir(parents=True, exist_ok=True, mode=0o750)
            except OSError as exc:
                raise SupervisorError(
                    f"job {job.cfg.name!r}: cannot create {job.directory}: {exc.strerror}"
                ) from None
        self._restored = True
        self._stopping = False
        if os.geteuid() == 0:
            for job in self._jobs.values():
                if job.cfg.user is None:
                    self._log.warning(
                        "workers run as root: set 'user:' for this job",
                        job=job.cfg.name,
                    )
        reports: list[WorkerCrash] = []
        # one wait for all the exit files left empty (their shims died with the workers,
        # as at a reboot): not EXIT_FILE_WAIT_S each, one after another, before READY=1
        exit_file_deadline = time.monotonic() + EXIT_FILE_WAIT_S
        for job in self._jobs.values():
            job.workers.clear()  # records of an earlier run of this object are stale
            gone = await self._settle_gone(job, await self._adopt(job), exit_file_deadline)
            for report in gone:
                self._record(report)  # before workers.json forgets the dead pid
            reports += gone
            self._persist(job)
        self._crashes += reports
        self._poller = asyncio.create_task(self._poll_loop(), name="gpuwatchd-supervisor-poll")

    async def start(self) -> None:
        """:meth:`restore` (unless done), then start workers until each job has its
        parallelism. Raises :class:`SupervisorError` if called twice (``conflict``) or
        as :meth:`restore` does."""
        if not self._restored:
            await self.restore()
        elif self._launched:
            raise SupervisorError("the supervisor is already started", code="conflict")
        self._launched = True
        for job in self._jobs.values():
            missing = job.parallelism - len(self._active(job))
            for _ in range(max(0, missing)):
                await self._launch(job, self._new_slot(job))

    async def stop(
        self,
        mode: str = "stop",
        *,
        jobs: Iterable[str] | None = None,
        drain_timeout_s: float | None = None,
    ) -> None:
        """Stop supervising: ``stop`` (default), ``drain`` or ``leave`` the workers.

        ``stop``: SIGTERM to each worker's process group, SIGKILL after the job's
        ``restart.stop_timeout``; nothing is left behind. ``drain``: each worker is asked
        to finish its trial and exit (``drains``); a worker that cannot be asked, or
        has not exited after ``drain_timeout_s`` (``None``: wait), is stopped as above.
        ``leave``: the workers keep running and ``workers.json`` names them, for the next
        daemon to adopt. ``jobs`` limits the stop to those jobs (the rest keep running and
        supervised). Pending restarts are cancelled. Raises :class:`SupervisorError` for an
        unknown mode or job.
        """
        if mode not in ("stop", "drain", "leave"):
            raise SupervisorError(f"unknown stop mode {mode!r} (stop, drain or leave)")
        selected = [self._job(name) for name in jobs] if jobs is not None else None
        targets = selected if selected is not None else list(self._jobs.values())
        if selected is None:
            self._stopping = True
            if self._poller is not None:
                self._poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._poller
                self._poller = None
        for job in targets:
            for w in list(job.workers.values()):
                if w.state == "backoff":
                    self._cancel_task(w)
                    w.to("stopped", "stopped with the daemon")
                    w.next_start_at_s = None
        if mode == "leave":
            for job in targets:
                for w in job.workers.values():
                    if w.task is not None and w.state in LIVE:
                        w.task.cancel()  # stop waiting; the process goes on
                self._persist(job)
                self._log.info(
                    "workers left running",
                    job=job.cfg.name,
                    pids=[w.pid for w in job.workers.values() if w.pid is not None],
                )
                job.workers.clear()  # workers.json names them for the next start
            if selected is None:
                self._restored = self._launched = False
            return
        if mode == "drain":
            live = [
                (job, w) for job in targets for w in job.workers.values() if w.state == "running"
            ]
            await asyncio.gather(*(self._drain(job, w, remove_after=False) for job, w in live))
            waits = [self._wait_done(w) for _, w in live]
            if waits:
                _, pending = await asyncio.wait(
                    [asyncio.ensure_future(x) for x in waits], timeout=drain_timeout_s
                )
                for task in pending:
                    task.cancel()
        still = [(job, w) for job in targets for w in job.workers.values() if w.state in LIVE]
        await asyncio.gather(*(self._terminate(job, w, "kill") for job, w in still))
        for job in targets:
            for w in job.workers.values():
                if w.state in LIVE or w.state == "backoff":
                    w.to("stopped")
            self._persist(job)
        if selected is None:
            await self._settle_background()
            self._restored = self._launched = False

    async def set_parallelism(self, job: str, n: int, mode: str = "drain") -> None:
        """Run ``n`` workers of ``job`` (0 ≤ n ≤ the config's ``workers``).

        Raising starts workers on the lowest free slot numbers. Lowering takes away first
        slots that run nothing (``failed``, ``stopped``, ``backoff``), then the newest
        running workers (latest start): with ``mode="drain"`` each is asked through
        ``drains`` to finish its trial and exit (SIGTERM if it cannot be asked);
        with ``mode="now"`` it gets SIGTERM at once (SIGKILL after the stop timeout) and
        its end is a crash event with ``intentional=True`` so its trial can be failed and
        re-enqueued. Returns once the workers are started or asked to leave.
        Raises :class:`SupervisorError` for an unknown job, a bad ``n`` or ``mode``.
        """
        target = self._job(job)
        if mode not in ("drain", "now"):
            raise SupervisorError(f"unknown parallelism mode {mode!r} (drain or now)")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= target.cfg.workers:
            raise SupervisorError(
                f"job {job!r}: parallelism must be an integer in 0..{target.cfg.workers}, not {n!r}"
            )
        active = self._active(target)
        previous = target.parallelism
        target.parallelism = n
        self._log.info(
            "parallelism set",
            job=job,
            previous=previous,
            parallelism=n,
            mode=mode,
            active=len(active),
        )
        if n > len(active):
            for _ in range(n - len(active)):
                await self._launch(target, self._new_slot(target))
        elif n < len(active):
            rank = {"failed": 0, "stopped": 0, "backoff": 1, "running": 2}
            order = sorted(active, key=lambda w: (rank.get(w.state, 3), -(w.started_at_s or 0.0)))
            for w in order[: len(active) - n]:
                if w.state in ("failed", "stopped", "backoff"):
                    self._cancel_task(w)
                    del target.workers[w.number]
                    self._log.info("worker removed", job=job, worker=w.number, state=w.state)
                elif w.state == "stopping" or w.exiting:
                    w.remove_after = True  # already on its way out: removed after its exit
                elif mode == "drain":
                    await self._drain(target, w, remove_after=True)
                else:
                    w.remove_after = True
                    self._spawn_background(self._terminate(target, w, "kill"))
        self._persist(target)

    async def restart_worker(self, job: str, worker: int, gpu: int | None = None) -> None:
        """Restart one worker now, optionally on NVML GPU ``gpu``.

        A running worker is stopped (SIGTERM, SIGKILL after the stop timeout; a crash
        event with ``intentional=True``) and started again at once, in the background; a worker
        in backoff starts at once; a ``stopped`` or ``failed`` one starts again with its
        crash-loop count reset. Explicit restarts do not spend the restart budget.
        Raises :class:`SupervisorError`: unknown job or worker (``not_found``), a worker
        that is draining or stopping (``conflict``), a negative ``gpu``.
        """
        target = self._job(job)
        w = target.workers.get(worker)
        if w is None:
            raise SupervisorError(f"job {job!r} has no worker {worker!r}", code="not_found")
        if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0):
            raise SupervisorError(f"gpu must be a non-negative NVML index, not {gpu!r}")
        if w.state in ("draining", "stopping") or w.exiting:
            raise SupervisorError(
                f"job {job!r} worker {worker} is {w.state}; cannot restart it now",
                code="conflict",
            )
        w.pin_gpu = gpu
        w.restarts += 1
        self._log.info("worker restart requested", job=job, worker=worker, gpu=gpu, state=w.state)
        if w.state == "running":
            self._spawn_background(self._terminate(target, w, "restart"))
            return
        self._cancel_task(w)
        w.stalled_streak = 0
        w.streak = 0
        await self._launch(target, w)

    async def stop_job(self, job: str) -> int:
        """``gpuwatchctl job stop``: stop every worker of ``job`` and keep them down.

        As :meth:`stop` with ``jobs=[job]`` (SIGTERM, SIGKILL after the stop timeout; the
        cut-short trials are reported with ``intentional=True``); the slots stay down
        across daemon restarts (``workers.json``) until :meth:`start_job`. Returns how
        many processes were running. Raises :class:`SupervisorError` (``not_found``).
        """
        target = self._job(job)
        running = sum(1 for w in target.workers.values() if w.state in LIVE)
        await self.stop("stop", jobs=[job])
        for w in target.workers.values():
            w.held, w.note = OPERATOR_STOP, OPERATOR_STOP
        self._log.info("job.stopped", job=job, workers=running)
        self._persist(target)
        return running

    async def start_job(self, job: str) -> int:
        """``gpuwatchctl job start``: start ``job``'s slots that run nothing, up to its
        parallelism; finished, operator-stopped, failed and budget-stopped slots alike.

        Crash-loop counts are reset; the restart budget is not spent. Returns how many
        workers were started. Raises :class:`SupervisorError` (``not_found``).
        """
        target = self._job(job)
        started = 0
        for w in sorted(target.workers.values(), key=_num):
            if w.state in LIVE or w.exiting or w.remove_after:
                continue
            if len([x for x in self._active(target) if x.state in LIVE]) >= target.parallelism:
                break
            self._cancel_task(w)
            w.held, w.stalled_streak, w.streak = None, 0, 0
            await self._launch(target, w)
            started += 1
        while len(self._active(target)) < target.parallelism:
            await self._launch(target, self._new_slot(target))
            started += 1
        self._log.info("job.started", job=job, workers=started)
        return started

    async def restart_job(self, job: str) -> tuple[int, int]:
        """``gpuwatchctl job restart``: :meth:`stop_job` then :meth:`start_job`;
        returns (stopped, started)."""
        stopped = await self.stop_job(job)
        started = await self.start_job(job)
        return stopped, started

    def place_next(self, job: str, gpu: int) -> None:
        """Put ``job``'s next worker start (restart or new worker) on NVML GPU ``gpu``.

        One-shot (``place_on_idle_gpu``); logged with the next ``worker placed``.
        Raises :class:`SupervisorError` for an unknown job or a negative index.
        """
        target = self._job(job)
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise SupervisorError(f"gpu must be a non-negative NVML index, not {gpu!r}")
        target.place_next = gpu
        self._log.info("next placement requested", job=job, gpu=gpu)

    def note_trial(self, pid: int, trial_number: int | None) -> bool:
        """Record that the worker ``pid`` (or its descendant) runs Optuna trial ``trial_number``.

        The number is passed on in :class:`WorkerCrash` and kept in ``workers.json``.
        Returns False when ``pid`` is not one of our workers.
        """
        found = self._find_pid(pid)
        if found is None:
            return False
        job, w = found
        if w.trial_number != trial_number:
            w.trial_number = trial_number
            self._persist(job)
        return True

    def trial_holders(self, jobs: Iterable[str]) -> tuple[TrialHolder, ...] | None:
        """The worker launches of ``jobs`` that may hold RUNNING trials now: each slot whose
        process runs or whose end is being handled (:class:`TrialHolder`). ``None`` while
        a slot of one of them is being started (its process may already run trials under
        a pid not yet known). Raises :class:`SupervisorError` (``not_found``)."""
        holders: list[TrialHolder] = []
        for name in jobs:
            job = self._job(name)
            if job.launching:
                return None
            for w in job.workers.values():
                if w.pid is None and not w.exiting:
                    continue
                ticks = w.start_ticks
                if ticks is None and w.pid is not None and w.pid > 0:
                    stat = read_stat(w.pid)
                    ticks = None if stat is None else stat.start_ticks
                started = None if ticks is None else started_wall_s(ticks)
                holders.append(TrialHolder(w.worker_id, started))
        return tuple(holders)

    def note_progress(self, pid: int) -> bool:
        """Record that worker ``pid`` (or its descendant) made progress: its hook spoke or
        one of its trials finished (a death after progress is not part of a crash loop).
        Returns False when ``pid`` is not one of our workers."""
        found = self._find_pid(pid)
        if found is None:
            return False
        job, w = found
        job.hooked = True
        if not w.progressed:
            w.progressed = True
            self._persist(job)
        return True

    def note_exception(self, pid: int, text: str | None) -> bool:
        """Record the hook's last exception text for the worker ``pid`` (for classification).

        Returns False when ``pid`` is not one of our workers.
        """
        found = self._find_pid(pid)
        if found is None:
            return False
        found[1].last_exception = text
        return True

    def observe(self, jobs: Iterable[JobInfo]) -> None:
        """Take the trial numbers of the jobs attached through the hook (call every tick);
        an attached worker has made progress (:meth:`note_progress`)."""
        for info in jobs:
            if self.note_trial(info.pid, info.trial_number):
                self.note_progress(info.pid)

    def parallelism(self, job: str) -> int:
        """The number of workers ``job`` should run now (the ladder's value)."""
        return self._job(job).parallelism

    def workers(self, job: str | None = None) -> list[WorkerInfo]:
        """Every worker slot (of ``job``, or of all jobs), ordered by job and slot number."""
        targets = [self._job(job)] if job is not None else list(self._jobs.values())
        return [self._info(j, w) for j in targets for w in sorted(j.workers.values(), key=_num)]

    def job_states(self) -> tuple[ManagedJobState, ...]:
        """Each job's slots for this tick's snapshot (:class:`~gpuwatchd.model.ManagedJobState`)."""
        out = []
        for job in self._jobs.values():
            slots = sorted(job.workers.values(), key=_num)
            out.append(
                ManagedJobState(
                    job=job.cfg.name,
                    given_up=tuple((w.number, w.note) for w in slots if w.given_up),
                    live=sum(1 for w in slots if w.state in LIVE or w.state == "backoff"),
                    finished=sum(1 for w in slots if w.held == "finished"),
                    slots=len(slots),
                )
            )
        return tuple(out)

    def status(self) -> dict[str, Any]:
        """JSON-able state for ``gpuwatchctl status``/``jobs``: per job, settings and workers."""
        now = self._clock()
        out = []
        for job in self._jobs.values():
            out.append(
                {
                    "job": job.cfg.name,
                    "command": list(job.cfg.command),
                    "parallelism": job.parallelism,
                    "workers_max": job.cfg.workers,
                    "min_workers": job.cfg.min_workers,
                    "gpus": "auto" if job.allowed_gpus is None else list(job.allowed_gpus),
                    "restart_budget": job.policy.budget,
                    "restarts_in_window": len(self._window(job, now)),
                    "workers": [w.to_dict() for w in self.workers(job.cfg.name)],
                }
            )
        return {"jobs": out}

    def _job(self, name: str) -> Job:
        job = self._jobs.get(name)
        if job is None:
            raise SupervisorError(f"no managed job {name!r}", code="not_found")
        return job

    def _info(self, job: Job, w: Worker) -> WorkerInfo:
        return WorkerInfo(
            job=job.cfg.name,
            worker=w.number,
            pid=w.pid,
            gpu_index=w.gpu,
            state=w.state,
            restarts=w.restarts,
            last_crash_kind=None if w.last_crash is None else w.last_crash.kind,
            started_at_s=w.started_at_s,
            placement_reason=w.placement_reason,
            adopted=w.adopted,
            exit_code=w.exit_code,
            next_start_at_s=w.next_start_at_s if w.state == "backoff" else None,
            trial_number=w.trial_number,
            last_crash_reason=None if w.last_crash is None else w.last_crash.reason,
            note=w.note,
            worker_id=w.worker_id,
            held=w.held,
            given_up=w.given_up,
        )

    @staticmethod
    def _active(job: Job) -> list[Worker]:
        """Slots that count toward the parallelism (not on their way out)."""
        return [w for w in job.workers.values() if not w.remove_after and w.state != "draining"]

    def _new_slot(self, job: Job) -> Worker:
        number = 0
        while number in job.workers:
            number += 1
        w = Worker(number=number)
        job.workers[number] = w
        return w

    def _find_pid(self, pid: int) -> tuple[Job, Worker] | None:
        candidate: int | None = pid
        for _ in range(_PARENT_HOPS):
            if candidate is None or candidate <= 1:
                return None
            for job in self._jobs.values():
                for w in job.workers.values():
                    if w.pid == candidate:
                        return job, w
            candidate = parent_pid(candidate)
        return None

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            try:
                self._poll_once()
            except Exception as exc:  # keep polling whatever one worker did
                self._log.exception("supervisor poll failed", error=f"{type(exc).__name__}: {exc}")

    def _poll_once(self) -> None:
        for job in self._jobs.values():
            for w in list(job.workers.values()):
                if w.pid is None or w.exiting:
                    continue
                if w.tail is not None:
                    w.tail.update()
                if w.files is not None:
                    for path in w.files.rotate_if_needed(w.tail):
                        self._log.info(
                            "worker output rotated",
                            job=job.cfg.name,
                            worker=w.number,
                            path=str(path),
                        )

    # -- worker slots: launch, watch, exit transitions, stop, drain --------------------

    def _window(self, job: Job, now: float) -> list[float]:
        if job.policy.budget_window_s <= 0:
            return job.restart_times_s
        return [t for t in job.restart_times_s if now - t < job.policy.budget_window_s]

    def _place(self, job: Job, w: Worker) -> Placement:
        cordoned = self._cordoned
        if w.pin_gpu is not None:
            gpu, w.pin_gpu = w.pin_gpu, None
            if gpu not in cordoned:
                return Placement(gpu, "requested by restart_worker")
            self._log.warning("worker.requested_gpu_cordoned", job=job.cfg.name, gpu=gpu)
        if job.place_next is not None:
            gpu, job.place_next = job.place_next, None
            if gpu not in cordoned:
                return Placement(gpu, "requested by place_next (idle GPU)")
            self._log.warning("worker.requested_gpu_cordoned", job=job.cfg.name, gpu=gpu)
        gpus = self._gpus
        ours: dict[int, int] = {}
        for other_job in self._jobs.values():
            for other in other_job.workers.values():
                if other is not w and other.gpu is not None and other.state in LIVE:
                    ours[other.gpu] = ours.get(other.gpu, 0) + 1
        return choose_gpu(gpus, ours, job.allowed_gpus, cordoned)

    async def _launch(self, job: Job, w: Worker) -> None:
        """Place and start worker ``w`` now; a failure to exec counts as a fast crash."""
        job.launching += 1
        try:
            await self._start_process(job, w)
        finally:
            job.launching -= 1

    async def _start_process(self, job: Job, w: Worker) -> None:
        name = job.cfg.name
        w.next_start_at_s = None
        w.task = None
        placement = self._place(job, w)
        w.gpu, w.placement_reason = placement.gpu, placement.reason
        self._log.info(
            "worker placed", job=name, worker=w.number, gpu=w.gpu, reason=placement.reason
        )
        if w.gpu is None and self._gpus_expected:
            self._log.warning(
                "worker has no GPU; CUDA_VISIBLE_DEVICES is empty",
                job=name,
                worker=w.number,
                reason=placement.reason,
            )
        files = OutputFiles(job.directory, w.number, max_bytes=self._output_max_bytes)
        tail = StderrTail(files.err)
        w.worker_id = f"{name}.{w.number}.{uuid.uuid4().hex}"
        unit: str | None = None
        try:
            env = launch.worker_env(job, w, socket_path=self._socket_path, environ=self._environ)
            if self._launcher == "systemd":
                unit = unit_name(name, w.number)
                pid = await asyncio.to_thread(
                    unit_launch.start,
                    unit,
                    list(job.cfg.command),
                    cwd=job.cfg.cwd or "/",
                    env=env,
                    uid=job.popen_user.get("user"),
                    gid=job.popen_user.get("group"),
                    properties=job.cfg.unit_properties,
                    env_file=job.directory / f"worker-{w.number}.env",
                    syslog_identifier=launch_identifier(w.worker_id),
                )
                shim = None
            else:
                exit_path = launch.exit_file(job, w.worker_id)
                spawned = launch.spawn(job, files, env, exit_path)
                shim = spawned.shim
                pid = await self._read_worker_pid(spawned, exit_path)
        except launch.SPAWN_ERRORS as exc:
            self._spawn_failed(job, w, exc)
            return
        stat = read_stat(pid) if pid > 0 else None
        w.pid, w.shim, w.unit, w.unit_result = pid, shim, unit, ""
        w.start_ticks = None if stat is None else stat.start_ticks
        w.oom = read_oom_counter(pid) if pid > 0 else None
        w.host_oom_kills = read_host_oom_kills()
        w.files, w.tail = files, tail
        w.to("running", "")
        w.adopted, w.exiting = False, False
        w.held, w.given_up = None, False
        w.stderr_offset, w.progressed = tail.offset, False
        w.intent, w.remove_after = None, False
        w.exit_code = None
        w.trial_number = None
        w.last_exception = None
        w.started_at_s = self._clock()
        w.started_mono = time.monotonic()
        w.done = asyncio.get_running_loop().create_future()
        self._log.info(
            "worker started",
            job=name,
            worker=w.number,
            pid=pid,
            unit=unit,
            gpu=w.gpu,
            worker_id=w.worker_id,
        )
        self._persist(job)
        w.task = asyncio.create_task(self._watch(job, w), name=f"gpuwatchd-{name}-{w.number}")

    @staticmethod
    async def _read_worker_pid(spawned: launch.Spawned, exit_path: Path) -> int:
        """The worker's pid from the launcher shim (:func:`.launch.read_worker_pid`, in a
        thread). Whatever ends the wait early (the launch task cancelled, by a stop or a
        shutdown) leaves no worker on a GPU unwatched: the pid is still read, then the
        worker's group and the shim are killed and the exit file removed, and the
        exception goes on. Raises :class:`OSError` when the worker did not start."""
        reader = asyncio.ensure_future(asyncio.to_thread(launch.read_worker_pid, spawned))
        try:
            return await asyncio.shield(reader)
        except BaseException as exc:
            if not isinstance(exc, OSError):
                while not reader.done():  # bounded by read_worker_pid's timeout
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait({reader})
                error = None if reader.cancelled() else reader.exception()
                if not isinstance(error, OSError):  # OSError: nothing started, or killed
                    pid = None if reader.cancelled() or error else reader.result()
                    launch.kill_launch(spawned, pid)  # None: the shim's children
            with contextlib.suppress(OSError):
                exit_path.unlink()
            raise

    def _spawn_failed(self, job: Job, w: Worker, exc: BaseException) -> None:
        detail = f"{type(exc).__name__}: {exc}"
        # exec failed: a missing program or cwd, a permission: the worker's environment.
        w.last_crash = CrashInfo("environment", f"cannot start: {detail}"[:300], evidence=detail)
        w.pid, w.exit_code = None, None
        w.started_mono = time.monotonic()
        self._log.error("worker start failed", job=job.cfg.name, worker=w.number, error=detail)
        delay = self._after_crash(job, w, uptime_s=0.0)
        self._persist(job)
        if delay is not None:
            w.task = asyncio.create_task(self._backoff_then_launch(job, w, delay))

    async def _watch(self, job: Job, w: Worker) -> None:
        """Wait for the worker's process to end, then handle it (cancel: stop watching)."""
        pid, shim, ticks = w.pid, w.shim, w.start_ticks
        if pid is None:
            return
        returncode = None
        if pid > 0:
            returncode = await launch.wait_exit(pid, shim, ticks, self._poll_interval_s)
        exit_path = None
        if w.unit is not None:
            err = None if w.files is None else w.files.err
            end = await self._finish_unit(job, w.number, w.unit, err, w.worker_id)
            returncode, w.unit_result = end.returncode, end.result
        elif w.worker_id is not None:
            exit_path = launch.exit_file(job, w.worker_id)
            if shim is None and exit_path.exists():  # adopted: the shim's record
                deadline = time.monotonic() + EXIT_FILE_WAIT_S
                returncode = await self._read_exit_file(exit_path, deadline)
            elif shim is None:
                exit_path = None  # launched by an older daemon, without the shim
        if w.pid == pid:
            await self._exited(job, w, returncode, shim=exit_path is not None)
        if exit_path is not None:  # read and handled (its crash in the ledger)
            with contextlib.suppress(OSError):
                exit_path.unlink()

    @staticmethod
    async def _read_exit_file(path: Path, deadline: float) -> int | None:
        """The return code in a launch's exit file, waiting until ``deadline``
        (``time.monotonic``; :data:`EXIT_FILE_WAIT_S` after the wait began) for the shim
        to write it; None: unknown (the shim died with the worker)."""
        while True:
            returncode = launch.read_exit_file(path)
            if returncode is not None or time.monotonic() >= deadline:
                return returncode
            await asyncio.sleep(0.05)

    async def _backoff_then_launch(self, job: Job, w: Worker, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if job.workers.get(w.number) is w and w.state == "backoff" and not self._stopping:
            await self._launch(job, w)

    def _after_crash(self, job: Job, w: Worker, *, uptime_s: float) -> float | None:
        """Decide what follows an unplanned death; returns the restart delay or None.

        A crash loop is deaths without progress, not short runs: a launch that made
        progress (:attr:`Worker.progressed`: its hook spoke, a trial finished) resets
        the count; so does a run of ``min_uptime`` of a job whose workers never spoke to
        the hook (then uptime is the only sign of progress there is).
        """
        policy, name = job.policy, job.cfg.name
        stalled = not w.progressed and (job.hooked or uptime_s < policy.min_uptime_s)
        w.stalled_streak = w.stalled_streak + 1 if stalled else 0
        if uptime_s >= policy.reset_after_s:
            w.streak = 0
        w.streak += 1
        crash = w.last_crash
        if crash is not None and crash.kind == "environment" and uptime_s < policy.min_uptime_s:
            # Restarting cannot mend a read-only file system or a missing module: stop now
            # (one crash, one finding) instead of burning the restart budget.
            w.given_up = True
            w.to("failed")
            w.note = (
                f"environment failure at start: {crash.evidence or crash.reason}; "
                f"fix it, then: gpuwatchctl job start {name}"
            )[:400]
            self._log.error("worker.environment_failed", job=name, worker=w.number, reason=w.note)
            return None
        if w.stalled_streak >= policy.crash_loop:
            w.given_up = True
            w.to("failed")
            w.note = (
                f"crash loop: died {w.stalled_streak} times in a row without progress (no "
                "trial finished, no word from its hook since its start); fix it, then: "
                f"gpuwatchctl job start {name}"
            )[:400]
            self._log.error("worker failed", job=name, worker=w.number, reason=w.note)
            return None
        if self._stopping:
            w.to("stopped", "crashed while gpuwatchd was stopping")
            return None
        if not self._auto_restart:
            w.to("stopped", "crashed; automatic restart is off")
            return None
        now = self._clock()
        recent = self._window(job, now)
        job.restart_times_s = list(recent)
        if len(recent) >= policy.budget:
            w.given_up = True
            w.to("stopped")
            window = f"{policy.budget_window_s:g} s" if policy.budget_window_s > 0 else "this run"
            w.note = f"restart budget exhausted: {len(recent)} restarts within {window}"
            self._log.error("restart budget exhausted", job=name, worker=w.number, reason=w.note)
            return None
        delay = policy.delay_s(w.streak)
        job.restart_times_s.append(now)
        w.restarts += 1
        w.to("backoff", "")
        w.next_start_at_s = now + delay
        self._log.info(
            "worker restart scheduled", job=name, worker=w.number, delay_s=delay, streak=w.streak
        )
        return delay

    async def _exited(
        self, job: Job, w: Worker, returncode: int | None, *, shim: bool = False
    ) -> None:
        """A worker process ended: run the exit transition (:mod:`.worker`) for it.

        ``returncode`` None: unknown. ``shim``: it ran under the launcher shim, whose exit
        file is the evidence; the hook's exit line is then never read (it cannot tell a
        ``raise SystemExit(3)`` from a clean end)."""
        w.exiting = True
        pid = w.pid if w.pid is not None else -1
        uptime = None if w.started_mono is None else time.monotonic() - w.started_mono
        if w.tail is not None:
            w.tail.update()
        tail_text = "" if w.tail is None else w.tail.text()
        if not w.adopted and w.pid is not None and w.pid > 0:
            # Leftovers of the worker's session (DataLoader workers) must not keep the GPU.
            launch.kill_session(w.pid)
        phase = phase_of(w.intent, w.remove_after)
        done = w.done
        w.intent, w.pid, w.start_ticks, w.exit_code = None, None, None, returncode
        w.shim = None
        try:
            # Inside the try: a cancel (stop) while waiting still settles the slot below.
            exit_line = (
                returncode is None
                and w.adopted
                and not shim
                and exit_line_of(tail_text, w.worker_id, pid)
            )
            event = event_of(
                returncode,
                exit_line=exit_line,
                shutting_down=self._stopping,
                oom_killed=w.unit_result == "oom-kill",
            )
            await self._run_exit_step(job, w, phase, event, pid, returncode, uptime, tail_text)
        finally:
            if w.pid is None:
                w.exiting = False
            if done is not None and not done.done():
                done.set_result(None)

    async def _run_exit_step(
        self,
        job: Job,
        w: Worker,
        phase: Phase,
        event: Event,
        pid: int,
        returncode: int | None,
        uptime: float | None,
        tail_text: str,
    ) -> None:
        """Carry out :func:`~gpuwatchd.jobs.worker.transition`'s step, in order."""
        name = job.cfg.name
        step = exit_transition(phase, event)
        intentional = is_intentional(phase)
        by_hook = event.name.startswith("EXITED_CLEAN_BY_HOOK")
        if step.new_state is not None:
            w.to(step.new_state)
        if step.note is not None:
            w.note = step.note
        if phase is Phase.RUNNING and event in _CLEAN_EVENTS:
            w.held = "finished"  # stays down across daemon restarts (workers.json)
        report: WorkerCrash | None = None
        delay: float | None = None
        for action in step.actions:
            if action is Action.LOG_EXITED:
                if step.note is None:
                    self._log.info("worker exited", job=name, worker=w.number, pid=pid, status=0)
                else:
                    self._log.info(
                        "worker exited",
                        job=name,
                        worker=w.number,
                        pid=pid,
                        status=None if by_hook else 0,
                        note=w.note,
                    )
            elif action is Action.LOG_CRASHED:
                report = self._crash_report(
                    job, w, phase, pid, returncode, uptime, tail_text, intentional
                )
                self._record(report)  # before PERSIST: workers.json forgets the pid
            elif action is Action.REMOVE_SLOT:
                job.workers.pop(w.number, None)
                self._log.info("worker left", job=name, worker=w.number, pid=pid)
            elif action is Action.APPLY_RESTART_POLICY:
                delay = self._after_crash(job, w, uptime_s=uptime or 0.0)
            elif action is Action.PERSIST:
                self._persist(job)
            elif action is Action.EMIT_CRASH and report is not None:
                self._crashes.append(report)
            elif action is Action.LAUNCH:
                await self._launch(job, w)
            elif action is Action.MARK_STOPPED:
                w.to("stopped")
            elif action is Action.SCHEDULE_BACKOFF and delay is not None:
                w.task = asyncio.create_task(self._backoff_then_launch(job, w, delay))

    def _crash_report(
        self,
        job: Job,
        w: Worker,
        phase: Phase,
        pid: int,
        returncode: int | None,
        uptime: float | None,
        tail_text: str,
        intentional: bool,
    ) -> WorkerCrash:
        """Classify the end and log it; the :class:`WorkerCrash` event."""
        crash = self._crash_info(w, intentional, returncode, tail_text)
        w.last_crash = crash
        self._log.warning(
            "worker stopped" if intentional else "worker crashed",
            job=job.cfg.name,
            worker=w.number,
            pid=pid,
            gpu=w.gpu,
            kind=crash.kind,
            reason=crash.reason,
            returncode=returncode,
            uptime_s=None if uptime is None else round(uptime, 3),
            evidence=crash.evidence,
        )
        return WorkerCrash(
            job=job.cfg.name,
            worker=w.number,
            pid=pid,
            gpu_index=w.gpu,
            crash_info=crash,
            trial_number=w.trial_number,
            stderr_tail=tail_text,
            timestamp_s=self._clock(),
            returncode=returncode,
            uptime_s=uptime,
            intentional=intentional,
            worker_id=w.worker_id,
        )

    def _crash_info(
        self, w: Worker, intentional: bool, returncode: int | None, tail: str
    ) -> CrashInfo:
        if intentional:
            sig, exit_code, status = signal_of(returncode)
            return CrashInfo("other", f"stopped by gpuwatchd ({status})", sig, exit_code)
        if w.unit_result == "oom-kill" and w.unit is not None:
            # systemd read the unit cgroup's memory.events oom_kill (cgroup v2): exact.
            return unit_launch.oom_kill_crash(w.unit, returncode)
        oom_kills: int | None = None
        if w.oom is not None:
            now_value = w.oom.reread()
            if now_value is not None:
                oom_kills = max(0, now_value - w.oom.value)
        return classify(returncode, tail, w.last_exception, oom_kills=oom_kills)

    def _record(self, report: WorkerCrash) -> None:
        """Write ``report`` into the crash ledger (if any), being handled from now
        (:meth:`~gpuwatchd.jobs.ledger.CrashLedger.record`)."""
        if self._ledger is not None:
            self._ledger.record(report)

    def _signal(self, w: Worker, sig: signal.Signals) -> bool:
        """Send ``sig`` to the worker's process group (its own session). False if gone."""
        try:
            return launch.signal_worker(w, sig)
        except PermissionError as exc:
            self._log.error("cannot signal worker", pid=w.pid, signal=sig.name, error=str(exc))
            return False

    async def _wait_done(self, w: Worker) -> None:
        done = w.done
        if done is not None and not done.done():
            await asyncio.shield(done)

    async def _terminate(self, job: Job, w: Worker, intent: Intent) -> None:
        """SIGTERM, wait up to the stop timeout, SIGKILL; returns when the exit is handled."""
        if w.state not in LIVE or w.pid is None:
            return
        w.intent = intent
        w.to("stopping")
        done = w.done
        self._log.info(
            "stopping worker", job=job.cfg.name, worker=w.number, pid=w.pid, intent=intent
        )
        self._signal(w, signal.SIGTERM)
        if done is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(done), job.policy.stop_timeout_s)
        except asyncio.TimeoutError:
            self._log.warning(
                "worker ignored SIGTERM; sending SIGKILL",
                job=job.cfg.name,
                worker=w.number,
                pid=w.pid,
                stop_timeout_s=job.policy.stop_timeout_s,
            )
            self._signal(w, signal.SIGKILL)
            await asyncio.shield(done)

    async def _drain(self, job: Job, w: Worker, *, remove_after: bool) -> None:
        """Ask the worker to finish its trial and exit; SIGTERM when it cannot be asked."""
        w.remove_after = w.remove_after or remove_after
        pid = w.pid
        accepted = False
        if self._drains is not None and self._drains.served and pid is not None:
            w.intent = "drain"
            w.to("draining")
            accepted = await self._drains.ask(job.cfg.name, pid)
        self._log.info(
            "worker drain requested",
            job=job.cfg.name,
            worker=w.number,
            pid=pid,
            accepted=accepted,
        )
        if not accepted and w.pid is not None and w.pid == pid:
            w.to("running")
            self._spawn_background(self._terminate(job, w, "kill"))

    def _spawn_background(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _settle_background(self) -> None:
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    @staticmethod
    def _cancel_task(w: Worker) -> None:
        if w.task is not None and not w.task.done() and w.state == "backoff":
            w.task.cancel()
        w.next_start_at_s = None

    def _persist(self, job: Job) -> None:
        """Write ``workers.json`` atomically (temp file + rename). Errors are logged."""
        try:
            workers_file.save(job, self._window(job, self._clock()))
        except OSError as exc:
            path = str(workers_file.state_path(job))
            self._log.error("cannot write worker state", path=path, error=str(exc))

    # -- adoption after a daemon restart --------------------

    async def _finish_unit(
        self, job: Job, worker: int, unit: str, err: Path | None, worker_id: str | None
    ) -> unit_launch.UnitEnd:
        """:func:`.unit_launch.finish` off the event loop (the launch's lines found by its
        ``worker_id``); the journal lines appended to the slot's stderr file ``err`` (crash
        evidence), the end logged ``worker.unit_ended``."""
        end = await asyncio.to_thread(
            unit_launch.finish, unit, identifier=launch_identifier(worker_id)
        )
        if err is not None:
            unit_launch.append_evidence(err, end.journal)
        self._log.info(
            "worker.unit_ended",
            job=job.cfg.name,
            worker=worker,
            unit=unit,
            result=end.result,
            returncode=end.returncode,
        )
        return end

    async def _settle_gone(
        self, job: Job, gone: list[GoneWorker], exit_file_deadline: float
    ) -> list[WorkerCrash]:
        """Reports for the workers that ended while no daemon watched.

        A worker unit's end is read from systemd (:func:`.unit_launch.finish`): status 0
        is a clean end, held finished, unless ``Result=oom-kill``; anything else a crash
        classified from the exit status, ``Result`` and its journal. Without a unit the
        status is the launcher shim's exit file's (waited for until
        ``exit_file_deadline``, ``time.monotonic``, shared by all jobs' launches): status 0
        is a clean end, anything else or nothing (the shim died with the worker) a crash.
        A launch of an older daemon, without the shim, is clean only with the hook's exit
        line in its stderr (:func:`gpuwatchd.control.protocol.exit_line_of`), else a crash
        (its trials are failed and retried, the slot relaunched)."""
        reports: list[WorkerCrash] = []
        for g in gone:
            if g.unit is not None:
                end = await self._finish_unit(
                    job, g.rec.worker, g.unit, g.tail.path, g.rec.worker_id
                )
                g.tail.update()
                if end.returncode == 0 and end.result != "oom-kill":
                    self._ended_clean_while_down(job, g.rec, note=UNIT_CLEAN_NOTE)
                else:
                    reports.append(self._gone_while_down(job, g, end))
                continue
            g.tail.update()
            worker_id = g.rec.worker_id
            exit_path = None if worker_id is None else launch.exit_file(job, worker_id)
            if exit_path is not None and exit_path.exists():  # launched under the shim
                returncode = await self._read_exit_file(exit_path, exit_file_deadline)
                if returncode == 0:
                    self._ended_clean_while_down(job, g.rec, note=SHIM_CLEAN_NOTE)
                else:  # a status, a signal, or none: the shim died with it
                    reports.append(self._gone_while_down(job, g, None, returncode=returncode))
                with contextlib.suppress(OSError):
                    exit_path.unlink()
            elif exit_line_of(g.tail.text(), g.rec.worker_id, g.rec.pid):
                self._ended_clean_while_down(job, g.rec)  # an older daemon's launch
            else:
                reports.append(self._gone_while_down(job, g, None))
        return reports

    async def _adopt(self, job: Job) -> list[GoneWorker]:
        """Adopt ``job``'s recorded live workers (and, with the systemd launcher, running
        worker units of its slots that ``workers.json`` misses); return the ones gone
        (for :meth:`_settle_gone`)."""
        path = workers_file.state_path(job)
        try:
            data = workers_file.load(path)
        except workers_file.UnreadableState as exc:
            self._log.warning("ignoring unreadable worker state", path=str(path), error=str(exc))
            data = {}
        except workers_file.OtherVersionState:
            self._log.warning("ignoring worker state of another version", path=str(path))
            data = {}
        saved = workers_file.parse(data)
        name = job.cfg.name
        if saved.parallelism is not None:
            job.parallelism = max(0, min(saved.parallelism, job.cfg.workers))
        if saved.restart_times_s is not None:
            job.restart_times_s = list(saved.restart_times_s)
        for entry in saved.bad_entries:
            self._log.warning("ignoring a bad worker entry", job=name, entry=entry)
        slots = sorted({rec.worker for rec in saved.workers} | set(range(job.cfg.workers)))
        units: dict[int, str] = {}
        shown: dict[str, dict[str, str]] = {}
        if self._launcher == "systemd":
            units = {n: unit_name(name, n) for n in slots}
            shown = await asyncio.to_thread(unit_launch.show_many, list(units.values()))
        gone: list[GoneWorker] = []
        for rec in saved.workers:
            if rec.worker in job.workers:
                continue
            unit = units.get(rec.worker)
            props = shown.get(unit, {}) if unit is not None else {}
            tail = self._tail(job, rec.worker, start_at=rec.stderr_offset)
            if not is_same_process(rec.pid, rec.start_ticks):
                if unit is not None and unit_launch.ended_pid(props) == rec.pid:
                    gone.append(GoneWorker(rec, tail, unit))  # systemd kept its status
                elif unit is not None and unit_launch.running_pid(props) is not None:
                    # The recorded launch ended and was handled; its restart runs, but the
                    # daemon died before workers.json named it.
                    self._from_unit(job, rec.worker, unit, props, gone, restarts=rec.restarts)
                else:
                    gone.append(GoneWorker(rec, tail))
                continue
            ours = unit is not None and unit_launch.running_pid(props) == rec.pid
            self._adopt_one(job, rec, tail, unit if ours else None)
        recorded = {rec.worker for rec in saved.workers}
        for n, unit in units.items():
            if n not in recorded and n not in job.workers:
                self._from_unit(job, n, unit, shown.get(unit, {}), gone, restarts=0)
        for held in saved.held:
            if held.worker in job.workers or held.worker >= job.cfg.workers:
                continue
            if held.config != job.fingerprint:
                self._log.info(
                    "worker.held_released",
                    job=name,
                    worker=held.worker,
                    reason=held.reason,
                )
                continue
            job.workers[held.worker] = Worker(
                number=held.worker, state="stopped", note=held.note, held=held.reason
            )
            self._log.info("worker.held", job=name, worker=held.worker, reason=held.reason)
        return gone

    def _from_unit(
        self,
        job: Job,
        worker: int,
        unit: str,
        props: Mapping[str, str],
        gone: list[GoneWorker],
        *,
        restarts: int,
    ) -> None:
        """Slot ``worker``'s unit has a launch ``workers.json`` does not name: adopt it
        when it runs, add it to ``gone`` when it ended unread; logged
        ``worker.unit_not_recorded``."""
        found = self._record_from_unit(worker, props, restarts=restarts)
        if found is None:
            return
        rec, running = found
        self._log.warning(
            "worker.unit_not_recorded",
            job=job.cfg.name,
            worker=worker,
            unit=unit,
            pid=rec.pid,
            running=running,
        )
        tail = self._tail(job, worker, start_at=None)
        if running:
            self._adopt_one(job, rec, tail, unit)
        else:
            gone.append(GoneWorker(rec, tail, unit))

    def _tail(self, job: Job, worker: int, *, start_at: int | None) -> StderrTail:
        """The stderr tail of slot ``worker``'s launch: from ``start_at`` (its recorded
        offset), else from the file's current end."""
        files = OutputFiles(job.directory, worker, max_bytes=self._output_max_bytes)
        if start_at is None:
            return StderrTail(files.err)
        return StderrTail(files.err, start_at_end=False, start_at=start_at)

    @staticmethod
    def _record_from_unit(
        worker: int, props: Mapping[str, str], *, restarts: int
    ) -> tuple[workers_file.RecordedWorker, bool] | None:
        """A record for slot ``worker`` made from its unit when ``workers.json`` does not
        name that launch (the daemon died between starting the unit and writing the
        file), and whether its main process runs; ``None`` when the unit neither runs
        nor ended unread. The worker id and GPU come from the main process's environment
        (``GPUWATCHD_WORKER_ID``, ``CUDA_VISIBLE_DEVICES``)."""
        pid = unit_launch.running_pid(props)
        running = pid is not None
        if pid is None:
            pid = unit_launch.ended_pid(props)
        if pid is None:
            return None
        stat = read_stat(pid) if running else None
        if stat is None:
            running = False  # ended just now, not reaped by systemd yet: finish() waits
        env = read_environ(pid, _UNIT_ENV) if running else {}
        visible = env.get("CUDA_VISIBLE_DEVICES", "")
        rec = workers_file.RecordedWorker(
            worker=worker,
            pid=pid,
            start_ticks=None if stat is None else stat.start_ticks,
            gpu=int(visible) if visible.isdigit() else None,
            started_at_s=None,
            restarts=restarts,
            trial_number=None,
            placement_reason="adopted from its unit",
            worker_id=env.get("GPUWATCHD_WORKER_ID"),
        )
        return rec, running

    def _adopt_one(
        self, job: Job, rec: workers_file.RecordedWorker, tail: StderrTail, unit: str | None
    ) -> None:
        """Watch the live process of ``rec`` as slot ``rec.worker`` (``unit``: the worker
        unit whose main process it is, else ``None``)."""
        name = job.cfg.name
        w = Worker(
            number=rec.worker,
            state="running",
            pid=rec.pid,
            start_ticks=rec.start_ticks,
            gpu=rec.gpu,
            placement_reason=rec.placement_reason,
            started_at_s=rec.started_at_s,
            restarts=rec.restarts,
            adopted=True,
            trial_number=rec.trial_number,
            worker_id=rec.worker_id,
            files=OutputFiles(job.directory, rec.worker, max_bytes=self._output_max_bytes),
            tail=tail,
            stderr_offset=rec.stderr_offset,
            oom=read_oom_counter(rec.pid),
            host_oom_kills=rec.host_oom_kills,
            unit=unit,
        )
        started_at = rec.started_at_s
        w.started_mono = time.monotonic() - (
            0.0 if started_at is None else max(0.0, self._clock() - started_at)
        )
        w.done = asyncio.get_running_loop().create_future()
        job.workers[rec.worker] = w
        w.task = asyncio.create_task(self._watch(job, w), name=f"gpuwatchd-{name}-{rec.worker}")
        self._log.info(
            "worker adopted", job=name, worker=rec.worker, pid=rec.pid, gpu=rec.gpu, unit=unit
        )

    def _ended_clean_while_down(
        self, job: Job, rec: workers_file.RecordedWorker, *, note: str = EXIT_LINE_NOTE
    ) -> None:
        """A recorded worker ended cleanly while no daemon watched: held as finished; no
        crash. ``note``: the evidence: its unit says status 0 (:data:`UNIT_CLEAN_NOTE`),
        its launcher shim's exit file does (:data:`SHIM_CLEAN_NOTE`), or (a launch without
        the shim) its stderr ends with the hook's exit line (:data:`EXIT_LINE_NOTE`)."""
        status_known = note != EXIT_LINE_NOTE
        job.workers[rec.worker] = Worker(
            number=rec.worker,
            state="stopped",
            note=note,
            held="finished",
            restarts=rec.restarts,
            gpu=rec.gpu,
            worker_id=rec.worker_id,
            trial_number=rec.trial_number,
        )
        self._log.info(
            "worker exited",
            job=job.cfg.name,
            worker=rec.worker,
            pid=rec.pid,
            status=0 if status_known else None,
            note=note,
        )

    def _gone_while_down(
        self,
        job: Job,
        g: GoneWorker,
        end: unit_launch.UnitEnd | None,
        *,
        returncode: int | None = None,
    ) -> WorkerCrash:
        """Log and report a worker that ended while no daemon watched it (``end``: how its
        unit ended, when systemd kept it; ``returncode``: its launcher shim's record)."""
        rec = g.rec
        if end is not None:
            returncode = end.returncode
        crash: CrashInfo
        if end is not None and end.result == "oom-kill" and g.unit is not None:
            crash = unit_launch.oom_kill_crash(g.unit, returncode)
        else:
            crash = classify(returncode, g.tail.text(), None, oom_kills=_oom_kills_since(rec))
        started_at = rec.started_at_s
        uptime = None if started_at is None else max(0.0, self._clock() - started_at)
        self._log.warning(
            "worker ended while gpuwatchd was down",
            job=job.cfg.name,
            worker=rec.worker,
            pid=rec.pid,
            kind=crash.kind,
            reason=crash.reason,
            returncode=returncode,
            unit_result=None if end is None else end.result,
        )
        return WorkerCrash(
            job=job.cfg.name,
            worker=rec.worker,
            pid=rec.pid,
            gpu_index=rec.gpu,
            crash_info=crash,
            trial_number=rec.trial_number,
            stderr_tail=g.tail.text(),
            timestamp_s=self._clock(),
            returncode=returncode,
            uptime_s=uptime,
            worker_id=rec.worker_id,
        )


def _num(w: Worker) -> int:
    return w.number


def _oom_kills_since(rec: workers_file.RecordedWorker) -> int | None:
    """How many processes the kernel's OOM killer killed on this host since ``rec``'s
    launch started (``/proc/vmstat``), None when either value is unread: a SIGKILL with
    none is no host OOM (a kill from outside, or with the daemon's control group)."""
    now = read_host_oom_kills()
    if now is None or rec.host_oom_kills is None:
        return None
    return max(0, now - rec.host_oom_kills)
