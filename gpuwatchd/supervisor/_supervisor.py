"""The supervisor: runs each managed job as N worker processes and keeps them running.

One :class:`Supervisor` per daemon, on the daemon's asyncio loop. Launching lives in
:mod:`~gpuwatchd.supervisor.launch`, ``workers.json`` in :mod:`~gpuwatchd.supervisor.state`,
what follows a worker's exit in the table of :mod:`~gpuwatchd.supervisor.worker`.
Behaviour in full: docs/supervisor-internals.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from gpuwatchd.config import JobConfig
from gpuwatchd.errors import SupervisorError
from gpuwatchd.logs import get_logger
from gpuwatchd.model import GpuSample, JobInfo, ManagedJobState
from gpuwatchd.restart import RestartPolicy
from gpuwatchd.supervisor import launch, state, unit_launch
from gpuwatchd.supervisor._output import DEFAULT_OUTPUT_MAX_BYTES
from gpuwatchd.supervisor._procfs import parent_pid, read_stat, started_wall_s
from gpuwatchd.supervisor.records import (
    LIVE,
    WORKER_STATES,
    DrainWorker,
    ManagedJob,
    OnCrash,
    TrialHolder,
    WorkerCrash,
    WorkerInfo,
    WorkerSlot,
    WorkerState,
)
from gpuwatchd.supervisor.runner import WorkerRunner
from gpuwatchd.supervisor.state import STATE_FILE

OPERATOR_STOP: Final = "stopped by an operator"
"""The ``held`` reason and note of slots stopped by ``gpuwatchctl job stop``."""

__all__ = [
    "STATE_FILE",
    "WORKER_STATES",
    "Supervisor",
    "TrialHolder",
    "WorkerCrash",
    "WorkerInfo",
    "WorkerState",
]

_PARENT_HOPS: Final = 8
"""How far up the process tree a hook's pid is looked for among our workers."""

_Job = ManagedJob
_Worker = WorkerSlot
_LIVE = LIVE


def _check_name(name: str) -> None:
    if not name or name.startswith(".") or "/" in name or "\0" in name:
        raise SupervisorError(f"job name {name!r} cannot name a directory (no '/', no leading '.')")


class Supervisor(WorkerRunner):
    """Runs managed jobs' workers (behaviour: docs/supervisor-internals.md).

    ``jobs``: the config's :class:`~gpuwatchd.config.JobConfig` entries. ``state_dir``:
    the daemon's state directory (``<state_dir>/jobs/<job>/`` is created). ``socket_path``:
    given to workers as ``GPUWATCHD_SOCKET``. ``clock``: seconds (``time.time``) for the
    timestamps shown and the budget window (process uptimes use :func:`time.monotonic`).
    ``logger``: a structlog-style logger (``info(event, **kw)``). ``gpu_inventory``: the
    latest GPU samples (the daemon's last snapshot; ``()`` without NVML). ``on_crash``:
    called with a :class:`WorkerCrash` for every worker that ended without a clean exit;
    it may return an awaitable, which is awaited (at most 60 s) before the worker's restart
    is scheduled; its exceptions are logged. ``record_crash``: called with the same
    :class:`WorkerCrash` before ``workers.json`` stops naming the dead process (the
    daemon's crash ledger), so a daemon killed in between still finds the death at its
    next start; it must not block; its exceptions are logged. ``drain_worker(job, pid)``:
    asks the worker's hook to finish its trial and exit (the daemon wires the control
    server's ``drain``); returns whether the hook accepted; without it, drains fall back to SIGTERM.
    An *adopted* worker's exit status cannot be read: its end is clean only with the
    hook's exit line in that launch's stderr, else a crash (docs/managed-jobs.md, "How a
    worker's end is known").
    ``auto_restart=False`` leaves crashed workers ``stopped`` for a policy to restart.
    ``poll_interval_s``: how often stderr tails, output caps and adopted workers are
    checked. ``environ``: the base environment of workers (default ``os.environ`` at
    start time, without systemd's ``NOTIFY_SOCKET``/``WATCHDOG_*``). ``gpus_expected``:
    False when the daemon watches no GPUs (``--devices none``): a worker placed without
    a GPU is then normal, not warned about. ``launcher``: ``subprocess`` (children of the
    daemon), ``systemd`` (each worker a transient unit, :mod:`.unit_launch`) or ``auto``
    (systemd when the daemon is itself a unit; :func:`.unit_launch.resolve`).

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
        gpu_inventory: Callable[[], Sequence[GpuSample]] = tuple,
        on_crash: OnCrash | None = None,
        record_crash: Callable[[WorkerCrash], None] | None = None,
        drain_worker: DrainWorker | None = None,
        auto_restart: bool = True,
        poll_interval_s: float = 1.0,
        output_max_bytes: int = DEFAULT_OUTPUT_MAX_BYTES,
        environ: Mapping[str, str] | None = None,
        gpus_expected: bool = True,
        launcher: str = "subprocess",
    ) -> None:
        self._clock = clock
        self._gpus_expected = gpus_expected
        self._log = logger if logger is not None else get_logger("gpuwatchd.supervisor")
        self._launcher = unit_launch.chosen(launcher, environ, self._log if jobs else None)
        self._inventory = gpu_inventory
        self._on_crash = on_crash
        self._record_crash = record_crash
        self._drain_worker = drain_worker
        self._auto_restart = auto_restart
        self._poll_interval_s = poll_interval_s
        self._output_max_bytes = output_max_bytes
        self._environ = environ
        self._socket_path = str(socket_path)
        self._jobs_dir = Path(state_dir) / "jobs"
        self._jobs: dict[str, _Job] = {}
        for cfg in jobs:
            _check_name(cfg.name)
            if cfg.name in self._jobs:
                raise SupervisorError(f"job {cfg.name!r} is configured twice")
            if not cfg.command:
                raise SupervisorError(f"job {cfg.name!r} has an empty command")
            policy = RestartPolicy.from_mapping(cfg.restart, job=cfg.name)
            unit_launch.check_job(cfg.name, cfg.unit_properties)  # with either launcher
            popen_user, user_env = launch.user_settings(cfg)
            self._jobs[cfg.name] = _Job(
                cfg=cfg,
                policy=policy,
                directory=self._jobs_dir / cfg.name,
                allowed_gpus=None if isinstance(cfg.gpus, str) else tuple(cfg.gpus),
                popen_user=popen_user,
                user_env=user_env,
                parallelism=cfg.workers,
                fingerprint=state.fingerprint(cfg),
            )
        self._started = False
        self._stopping = False
        self._poller: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ public API

    @property
    def job_names(self) -> tuple[str, ...]:
        """The managed jobs' names, in config order."""
        return tuple(self._jobs)

    async def start(self) -> None:
        """Adopt the still-running workers of an earlier daemon, then start the rest.

        For each job, ``workers.json`` is read: a recorded worker whose pid is alive with
        the recorded start time is adopted; one that is gone is reported through
        ``on_crash`` (classified from its stderr file; ``returncode`` unknown). The
        recorded parallelism (the ladder's last value) is restored, else the config's
        ``workers``; then workers are started until the job has that many. Raises
        :class:`SupervisorError` if called twice or the state directory is unusable.
        """
        if self._started:
            raise SupervisorError("the supervisor is already started", code="conflict")
        for job in self._jobs.values():
            try:
                job.directory.mkdir(parents=True, exist_ok=True, mode=0o750)
            except OSError as exc:
                raise SupervisorError(
                    f"job {job.cfg.name!r}: cannot create {job.directory}: {exc.strerror}"
                ) from None
        self._started = True
        self._stopping = False
        if os.geteuid() == 0:
            for job in self._jobs.values():
                if job.cfg.user is None:
                    self._log.warning(
                        "workers run as root: set 'user:' for this job",
                        job=job.cfg.name,
                    )
        reports: list[WorkerCrash] = []
        for job in self._jobs.values():
            job.workers.clear()  # records of an earlier run of this object are stale
            gone = await self._settle_gone(job, await self._adopt(job))
            for report in gone:
                self._record(report)  # before workers.json forgets the dead pid
            reports += gone
            self._persist(job)
        for report in reports:
            await self._notify_crash(report)
        for job in self._jobs.values():
            missing = job.parallelism - len(self._active(job))
            for _ in range(max(0, missing)):
                await self._launch(job, self._new_slot(job))
        self._poller = asyncio.create_task(self._poll_loop(), name="gpuwatchd-supervisor-poll")

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
        to finish its trial and exit (``drain_worker``); a worker that cannot be asked, or
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
                    if w.task is not None and w.state in _LIVE:
                        w.task.cancel()  # stop waiting; the process goes on
                self._persist(job)
                self._log.info(
                    "workers left running",
                    job=job.cfg.name,
                    pids=[w.pid for w in job.workers.values() if w.pid is not None],
                )
                job.workers.clear()  # workers.json names them for the next start
            if selected is None:
                self._started = False
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
        still = [(job, w) for job in targets for w in job.workers.values() if w.state in _LIVE]
        await asyncio.gather(*(self._terminate(job, w, "kill") for job, w in still))
        for job in targets:
            for w in job.workers.values():
                if w.state in _LIVE or w.state == "backoff":
                    w.to("stopped")
            self._persist(job)
        if selected is None:
            await self._settle_background()
            self._started = False

    async def set_parallelism(self, job: str, n: int, mode: str = "drain") -> None:
        """Run ``n`` workers of ``job`` (0 ≤ n ≤ the config's ``workers``).

        Raising starts workers on the lowest free slot numbers. Lowering takes away first
        slots that run nothing (``failed``, ``stopped``, ``backoff``), then the newest
        running workers (latest start): with ``mode="drain"`` each is asked through
        ``drain_worker`` to finish its trial and exit (SIGTERM if it cannot be asked);
        with ``mode="now"`` it gets SIGTERM at once (SIGKILL after the stop timeout) and
        ``on_crash`` reports it with ``intentional=True`` so its trial can be failed and
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
                elif mode == "drain":
                    await self._drain(target, w, remove_after=True)
                else:
                    w.remove_after = True
                    self._spawn_background(self._terminate(target, w, "kill"))
        self._persist(target)

    async def restart_worker(self, job: str, worker: int, gpu: int | None = None) -> None:
        """Restart one worker now, optionally on NVML GPU ``gpu``.

        A running worker is stopped (SIGTERM, SIGKILL after the stop timeout; ``on_crash``
        with ``intentional=True``) and started again at once, in the background; a worker
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
        running = sum(1 for w in target.workers.values() if w.state in _LIVE)
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
            if w.state in _LIVE or w.exiting or w.remove_after:
                continue
            if len([x for x in self._active(target) if x.state in _LIVE]) >= target.parallelism:
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
                    live=sum(1 for w in slots if w.state in _LIVE or w.state == "backoff"),
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

    # ------------------------------------------------------------------ internals

    def _job(self, name: str) -> _Job:
        job = self._jobs.get(name)
        if job is None:
            raise SupervisorError(f"no managed job {name!r}", code="not_found")
        return job

    def _info(self, job: _Job, w: _Worker) -> WorkerInfo:
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
    def _active(job: _Job) -> list[_Worker]:
        """Slots that count toward the parallelism (not on their way out)."""
        return [w for w in job.workers.values() if not w.remove_after and w.state != "draining"]

    def _new_slot(self, job: _Job) -> _Worker:
        number = 0
        while number in job.workers:
            number += 1
        w = _Worker(number=number)
        job.workers[number] = w
        return w

    def _find_pid(self, pid: int) -> tuple[_Job, _Worker] | None:
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


def _num(w: _Worker) -> int:
    return w.number
