"""Managed jobs: start and stop the supervisor, drain workers, keep the parallelism.

The parallelism a job runs at is the policy engine's ladder position (restored from the
journal); :class:`JobRunner` trims a job that holds more worker slots than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Mapping
from typing import Any, Final

from gpuwatchd.config import JobConfig
from gpuwatchd.control.protocol import Op
from gpuwatchd.control.server import ControlServer
from gpuwatchd.errors import ControlError, GpuwatchError, StudyError, SupervisorError
from gpuwatchd.jobs.actions import SupervisorActions
from gpuwatchd.jobs.drain import DrainRequests
from gpuwatchd.jobs.orphans import OrphanSweeper
from gpuwatchd.jobs.study import redact_url
from gpuwatchd.jobs.study_recovery import StudyRecovery, call_in_daemon_thread
from gpuwatchd.jobs.study_setup import ensure_study
from gpuwatchd.jobs.supervisor import Supervisor
from gpuwatchd.policy.engine import PolicyEngine

__all__ = [
    "DRAIN_ACK_TIMEOUT_S",
    "DRAIN_ON_STOP_S",
    "START_SWEEP_TIMEOUT_S",
    "STUDY_SETUP_TIMEOUT_S",
    "JobRunner",
]

DRAIN_ACK_TIMEOUT_S: Final = 6 * 3600.0
"""``lower_parallelism`` with ``mode: drain``: how long the worker's hook may take to
finish its trial and acknowledge (a long trial is not cut short)."""
DRAIN_ON_STOP_S: Final = 20.0
"""``on_daemon_stop: drain``: how long a worker may take to finish its trial before it is
stopped (SIGTERM, then SIGKILL after ``restart.stop_timeout``; the unit's TimeoutStopSec=
leaves room for both)."""
STUDY_SETUP_TIMEOUT_S: Final = 45.0
"""Seconds the start waits in all for the managed jobs' studies (created or loaded, all
at once) before it starts the workers anyway. A storage server that accepts the
connection and never answers holds ``psycopg2.connect`` (no ``connect_timeout``) and
redis-py (no ``socket_timeout``) for ever, and READY=1 with it, until systemd's
``TimeoutStartSec`` (90 s by default) kills the daemon. Half of that leaves room for the
rest of the start; a SQLite study loads in about 1 s, 10-14 s at load 13-16 on 2 cores
(issue 21)."""
START_SWEEP_TIMEOUT_S: Final = 15.0
"""Seconds the start waits for the orphan sweep before the workers start
(:meth:`JobRunner.start`): a storage that does not answer must not hold the start (and
READY=1, within systemd's ``TimeoutStartSec``, 90 s by default, with
:data:`STUDY_SETUP_TIMEOUT_S`); the workers then start and the sweep goes on at its
interval."""
_DRAIN_ATTACH_WAIT_S: Final = 15.0
"""A drain asked of a worker whose hook has not (re)attached yet waits this long for it
(hooks reconnect with backoff after a daemon restart) before the worker gets SIGTERM."""


class JobRunner:
    """The daemon's side of the managed jobs (``jobs:`` of the config).

    ``supervisor``/``managed`` are None without jobs (every method is then a no-op);
    ``server``: the control server (the hooks' ``drain``); ``drains``: the supervisor's
    drain requests, answered from :meth:`start` to :meth:`close`; ``engine``: the policy engine
    (ladder positions); ``sample_gpus``: a first GPU sample for placing workers before
    the first tick; ``orphans``: the :class:`~gpuwatchd.jobs.orphans.OrphanSweeper`
    (None without jobs), run from :meth:`reconcile` when due; ``logger``: structlog-style.
    """

    def __init__(
        self,
        *,
        supervisor: Supervisor | None,
        managed: SupervisorActions | None,
        study: StudyRecovery,
        jobs: Mapping[str, JobConfig],
        engine: PolicyEngine,
        server: ControlServer,
        drains: DrainRequests,
        logger: Any,
        orphans: OrphanSweeper | None = None,
    ) -> None:
        self.supervisor = supervisor
        self._orphans = orphans
        self._managed = managed
        self._study = study
        self._jobs = jobs
        self._engine = engine
        self._server = server
        self._drains = drains
        self._answering: asyncio.Task[None] | None = None
        self._log = logger
        self.stopping = False
        self._background: set[asyncio.Task[Any]] = set()
        self._reconciling: set[str] = set()

    async def drain_worker(self, job: str, pid: int) -> bool:
        """Answer one of the supervisor's drain requests (:class:`DrainRequests`): the
        hook's ``drain``, True once acknowledged.

        The hook acknowledges when it has applied the drain (its trial finished), so this
        waits up to :data:`DRAIN_ACK_TIMEOUT_S` (:data:`DRAIN_ON_STOP_S` while the daemon
        stops). A hook not attached yet is waited for (:data:`_DRAIN_ATTACH_WAIT_S`, not
        while stopping); False (the supervisor falls back to SIGTERM) when none answers.
        """
        server = self._server
        deadline = time.monotonic() + (0.0 if self.stopping else _DRAIN_ATTACH_WAIT_S)
        while not any(j.name == job and j.pid == pid for j in server.jobs()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.25)
        timeout = DRAIN_ON_STOP_S if self.stopping else DRAIN_ACK_TIMEOUT_S
        try:
            replies = await server.send_command(job, Op.DRAIN, {}, pid=pid, timeout_s=timeout)
        except ControlError as exc:
            self._log.warning("drain not sent", job=job, pid=pid, error=exc.message)
            return False
        except Exception as exc:  # the control server's problem, not a reason to hang
            self._log.error("drain failed", job=job, pid=pid, error=str(exc))
            return False
        return bool(replies) and all(r.ok for r in replies)

    async def control(self, job: str, action: str, *, by_uid: int) -> tuple[int, int]:
        """``gpuwatchctl job start|stop|restart JOB``; returns (stopped, started).

        Raises :class:`~gpuwatchd.errors.SupervisorError` (``not_found``: no such managed
        job, ``bad_request``: an unknown action).
        """
        if self.supervisor is None:
            raise SupervisorError(
                f"no managed job {job!r} (no jobs: in the config)", code="not_found"
            )
        self._log.warning("job.control_requested", job=job, action=action, by_uid=by_uid)
        if action == "stop":
            return await self.supervisor.stop_job(job), 0
        if action == "start":
            return 0, await self.supervisor.start_job(job)
        if action == "restart":
            return await self.supervisor.restart_job(job)
        raise SupervisorError(f"unknown job action {action!r} (start, stop or restart)")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def reconcile(self) -> None:
        """Trim a job running more worker slots than its parallelism, and start the orphan
        sweep when due (each tick).

        The supervisor counts a slot toward the parallelism until it leaves; after a daemon
        restart an adopted worker that was asked to drain is a normal slot again, so a job
        can briefly hold one slot too many. Idle slots go first, then the newest worker
        (drained). Not while a ladder action on the job is in flight.
        """
        supervisor = self.supervisor
        if supervisor is None or self.stopping:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # a tick outside the loop (benchmarks) does not manage workers
        if self._orphans is not None and self._orphans.due():
            self._spawn(self._sweep(self._orphans), "gpuwatchd-orphan-sweep")
        for name in self._jobs:
            if name in self._reconciling or (
                self._managed is not None and self._managed.busy(name)
            ):
                continue
            want = supervisor.parallelism(name)
            slots = [w for w in supervisor.workers(name) if w.state not in ("draining", "stopping")]
            if len(slots) <= want:
                continue
            self._log.warning(
                "more worker slots than the parallelism; trimming",
                job=name,
                slots=len(slots),
                parallelism=want,
            )
            self._reconciling.add(name)
            self._spawn(self._trim(name, want), f"gpuwatchd-trim-{name}")

    @staticmethod
    async def _sweep(orphans: OrphanSweeper) -> None:
        await orphans.sweep()

    async def _trim(self, job: str, want: int) -> None:
        assert self.supervisor is not None
        try:
            await self.supervisor.set_parallelism(job, want, "drain")
        except GpuwatchError as exc:
            self._log.error("trimming worker slots failed", job=job, error=str(exc))
        finally:
            self._reconciling.discard(job)

    async def restore(self) -> None:
        """Create or load the jobs' studies and adopt the workers a killed predecessor
        left running (:meth:`Supervisor.restore`); start no worker (no-op without jobs).
        The workers that died meanwhile are crash events in the supervisor's outbox: the
        daemon hands them to its crash handler, then calls :meth:`start`."""
        supervisor = self.supervisor
        if supervisor is None:
            return
        self._answering = asyncio.ensure_future(self._drains.serve(self.drain_worker))
        await asyncio.sleep(0)  # the answering loop runs before any worker is asked
        await self._ensure_studies()
        await supervisor.restore()

    async def start(self) -> None:
        """Start the managed jobs at their restored ladder positions (no-op without jobs).

        First the orphan sweep reconciles each exclusive study with the workers adopted
        (:meth:`OrphanSweeper.sweep_before_start`): a trial a dead worker left RUNNING is
        failed and its retry enqueued before a replacement starts, so the replacement
        asks the retry first (a replacement whose ``n_trials`` ran out first would leave
        it for nobody). The supervisor then starts the missing workers at the parallelism
        it recorded; when the journal's ladder position differs (a ladder decision
        journaled but not carried out before a kill), the journal's wins: its decision
        is the record of what the daemon decided. Called after :meth:`restore`. The sweep
        is waited for :data:`START_SWEEP_TIMEOUT_S` at most (``study.start_sweep_late``).
        """
        supervisor = self.supervisor
        if supervisor is None:
            return
        if self._orphans is not None:
            try:
                await asyncio.wait_for(
                    self._orphans.sweep_before_start(), START_SWEEP_TIMEOUT_S
                )
            except TimeoutError:
                self._log.warning("study.start_sweep_late", timeout_s=START_SWEEP_TIMEOUT_S)
        await supervisor.start()
        for job in self._jobs.values():
            # A crash whose trial was unknown may have left a RUNNING trial that the
            # killed predecessor meant to sweep: sweep once (heartbeat jobs only).
            if job.optuna is not None:
                self._study.request_sweep(job.name, job.optuna)
        for name in self._jobs:
            want = self._engine.parallelism(name)
            have = supervisor.parallelism(name)
            if want is not None and want != have:
                self._log.warning(
                    "parallelism restored from the journal",
                    job=name,
                    parallelism=want,
                    recorded=have,
                )
                self._reconciling.add(name)
                self._spawn(self._trim(name, want), f"gpuwatchd-restore-{name}")
        self._log.info(
            "managed jobs started",
            jobs={name: supervisor.parallelism(name) for name in self._jobs},
        )

    async def _ensure_studies(self) -> None:
        """Create or load every job's study before the workers start (they would race to
        create a fresh SQLite storage), one after the other (two jobs may share a storage)
        on a daemon thread (a hung storage call cannot be cancelled, and must not hold the
        daemon's exit); wait :data:`STUDY_SETUP_TIMEOUT_S` in all. A failure or a study
        not ready in time is logged ``study.setup_failed``; the workers start anyway and
        say the rest (their deaths are classified)."""
        jobs = [(job.name, job.optuna, job.user) for job in self._jobs.values() if job.optuna]
        outcomes: dict[str, str | StudyError] = {}

        async def one_after_another() -> None:
            for name, optuna, user in jobs:
                try:
                    outcomes[name] = await call_in_daemon_thread(
                        ensure_study, optuna, user, name="gpuwatchd-study-setup"
                    )
                except StudyError as exc:
                    outcomes[name] = exc

        # On time out the call under way is abandoned (its thread's answer is dropped).
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(one_after_another(), STUDY_SETUP_TIMEOUT_S)
        for name, optuna, _ in jobs:
            outcome = outcomes.get(name)
            if outcome is None:
                error = f"the storage did not answer within {STUDY_SETUP_TIMEOUT_S:g} s"
            elif isinstance(outcome, StudyError):
                error = str(outcome)
            else:
                self._log.info(
                    "study.ready",
                    job=name,
                    study=optuna.study,
                    storage=redact_url(optuna.storage),
                    outcome=outcome,
                )
                continue
            self._log.error("study.setup_failed", job=name, study=optuna.study, error=error)

    async def stop(self) -> None:
        """Stop supervising: each job's workers drain, stop or stay per ``on_daemon_stop``."""
        supervisor = self.supervisor
        if supervisor is None:
            return
        self.stopping = True
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        groups: dict[str, list[str]] = {"drain": [], "stop": [], "leave": []}
        for job in self._jobs.values():
            groups[job.on_daemon_stop].append(job.name)
        try:
            await asyncio.gather(
                *(
                    supervisor.stop(mode, jobs=names, drain_timeout_s=DRAIN_ON_STOP_S)
                    for mode, names in groups.items()
                    if names and mode != "leave"
                )
            )
            # The last call ends the supervision; "leave" keeps workers.json naming the
            # workers left running (the others have none left).
            await supervisor.stop("leave")
        except GpuwatchError as exc:
            self._log.error("stopping the managed jobs failed", error=str(exc))
        self._log.info("managed jobs stopped", modes={k: v for k, v in groups.items() if v})

    async def close(self) -> None:
        """Stop answering drain requests and close the study storages (after :meth:`stop`
        and the crash handling it caused)."""
        answering, self._answering = self._answering, None
        if answering is not None:
            answering.cancel()
            await asyncio.gather(answering, return_exceptions=True)
        await self._study.close()

    def report(self) -> list[dict[str, Any]]:
        """Managed jobs for ``status``/``jobs``: the supervisor's view plus the ladder."""
        if self.supervisor is None:
            return []
        out = []
        for entry in self.supervisor.status()["jobs"]:
            name = entry["job"]
            cfg = self._jobs.get(name)
            entry["ladder"] = self._engine.parallelism(name)
            entry["on_daemon_stop"] = cfg.on_daemon_stop if cfg is not None else None
            entry["study"] = (
                None
                if cfg is None or cfg.optuna is None
                else {"study": cfg.optuna.study, "max_retries": cfg.optuna.max_retries}
            )
            out.append(entry)
        return out
