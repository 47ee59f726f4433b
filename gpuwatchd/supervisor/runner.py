"""Worker slots' lifecycle: launch, watch, exit transitions, stop, drain, adoption.

:class:`WorkerRunner` is the base of :class:`~gpuwatchd.supervisor.Supervisor`: it holds
what happens to one slot's process (the job-level operations are the supervisor's). What
follows an exit is the table in :mod:`gpuwatchd.supervisor.worker`.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

from gpuwatchd.control.protocol import exit_line_of
from gpuwatchd.crash import CrashInfo, classify, signal_of
from gpuwatchd.model import GpuSample
from gpuwatchd.supervisor import launch, state, unit_launch
from gpuwatchd.supervisor._output import OutputFiles, StderrTail
from gpuwatchd.supervisor._placement import Placement, choose_gpu
from gpuwatchd.supervisor._procfs import read_host_oom_kills, read_oom_counter, read_stat
from gpuwatchd.supervisor.adoption import WorkerAdopter
from gpuwatchd.supervisor.records import (
    LIVE,
    DrainWorker,
    ManagedJob,
    OnCrash,
    WorkerCrash,
    WorkerSlot,
)
from gpuwatchd.supervisor.transient_unit import launch_identifier, unit_name
from gpuwatchd.supervisor.worker import (
    Action,
    Event,
    Intent,
    Phase,
    event_of,
    is_intentional,
    phase_of,
)
from gpuwatchd.supervisor.worker import transition as exit_transition

__all__ = ["CALLBACK_TIMEOUT_S", "WorkerRunner"]

CALLBACK_TIMEOUT_S: Final = 60.0
"""How long ``on_crash`` may take before the supervisor goes on."""

_CALLBACK_TIMEOUT_S = CALLBACK_TIMEOUT_S
_CLEAN_EVENTS: Final = frozenset(
    {
        Event.EXITED_CLEAN,
        Event.EXITED_CLEAN_SHUTDOWN,
        Event.EXITED_CLEAN_BY_HOOK,
        Event.EXITED_CLEAN_BY_HOOK_SHUTDOWN,
    }
)
_Job = ManagedJob
_Worker = WorkerSlot
_LIVE = LIVE


class WorkerRunner(WorkerAdopter):
    """The per-slot machinery of the supervisor; its attributes are set by the subclass."""

    _clock: Callable[[], float]
    _log: Any
    _inventory: Callable[[], Sequence[GpuSample]]
    _gpus_expected: bool
    _on_crash: OnCrash | None
    _record_crash: Callable[[WorkerCrash], None] | None
    _drain_worker: DrainWorker | None
    _auto_restart: bool
    _poll_interval_s: float
    _output_max_bytes: int
    _environ: Mapping[str, str] | None
    _launcher: str
    _socket_path: str
    _jobs: dict[str, ManagedJob]
    _stopping: bool
    _background: set[asyncio.Task[Any]]

    def _window(self, job: _Job, now: float) -> list[float]:
        if job.policy.budget_window_s <= 0:
            return job.restart_times_s
        return [t for t in job.restart_times_s if now - t < job.policy.budget_window_s]

    def _place(self, job: _Job, w: _Worker) -> Placement:
        if w.pin_gpu is not None:
            gpu, w.pin_gpu = w.pin_gpu, None
            return Placement(gpu, "requested by restart_worker")
        if job.place_next is not None:
            gpu, job.place_next = job.place_next, None
            return Placement(gpu, "requested by place_next (idle GPU)")
        try:
            gpus = tuple(self._inventory())
        except Exception as exc:  # the inventory is the daemon's; never let it stop a start
            self._log.error("gpu inventory failed", error=f"{type(exc).__name__}: {exc}")
            gpus = ()
        ours: dict[int, int] = {}
        for other_job in self._jobs.values():
            for other in other_job.workers.values():
                if other is not w and other.gpu is not None and other.state in _LIVE:
                    ours[other.gpu] = ours.get(other.gpu, 0) + 1
        return choose_gpu(gpus, ours, job.allowed_gpus)

    async def _launch(self, job: _Job, w: _Worker) -> None:
        """Place and start worker ``w`` now; a failure to exec counts as a fast crash."""
        job.launching += 1
        try:
            await self._start_process(job, w)
        finally:
            job.launching -= 1

    async def _start_process(self, job: _Job, w: _Worker) -> None:
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
                proc = None
            else:
                proc = launch.spawn(job, files, env)
                pid = proc.pid
        except launch.SPAWN_ERRORS as exc:
            self._spawn_failed(job, w, exc)
            return
        stat = read_stat(pid) if pid > 0 else None
        w.pid, w.popen, w.unit, w.unit_result = pid, proc, unit, ""
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

    def _spawn_failed(self, job: _Job, w: _Worker, exc: BaseException) -> None:
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

    async def _watch(self, job: _Job, w: _Worker) -> None:
        """Wait for the worker's process to end, then handle it (cancel: stop watching)."""
        pid, popen, ticks = w.pid, w.popen, w.start_ticks
        if pid is None:
            return
        returncode = None
        if pid > 0:
            returncode = await launch.wait_exit(pid, popen, ticks, self._poll_interval_s)
        if w.unit is not None:
            err = None if w.files is None else w.files.err
            end = await self._finish_unit(job, w.number, w.unit, err, w.worker_id)
            returncode, w.unit_result = end.returncode, end.result
        if w.pid == pid:
            await self._exited(job, w, returncode)

    async def _backoff_then_launch(self, job: _Job, w: _Worker, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if job.workers.get(w.number) is w and w.state == "backoff" and not self._stopping:
            await self._launch(job, w)

    def _after_crash(self, job: _Job, w: _Worker, *, uptime_s: float) -> float | None:
        """Decide what follows an unplanned death; returns the restart delay or None.

        A crash loop is deaths without progress, not short runs: a launch that made
        progress (:attr:`WorkerSlot.progressed`: its hook spoke, a trial finished) resets
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

    async def _exited(self, job: _Job, w: _Worker, returncode: int | None) -> None:
        """A worker process ended: run the exit transition (:mod:`.worker`) for it."""
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
        w.popen = None
        try:
            # Inside the try: a cancel (stop) while waiting still settles the slot below.
            exit_line = returncode is None and w.adopted and exit_line_of(tail_text, w.worker_id)
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
        job: _Job,
        w: _Worker,
        phase: Phase,
        event: Event,
        pid: int,
        returncode: int | None,
        uptime: float | None,
        tail_text: str,
    ) -> None:
        """Carry out :func:`~gpuwatchd.supervisor.worker.transition`'s step, in order."""
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
            elif action is Action.NOTIFY_CRASH and report is not None:
                await self._notify_crash(report)
            elif action is Action.LAUNCH:
                await self._launch(job, w)
            elif action is Action.MARK_STOPPED:
                w.to("stopped")
            elif action is Action.SCHEDULE_BACKOFF and delay is not None:
                w.task = asyncio.create_task(self._backoff_then_launch(job, w, delay))

    def _crash_report(
        self,
        job: _Job,
        w: _Worker,
        phase: Phase,
        pid: int,
        returncode: int | None,
        uptime: float | None,
        tail_text: str,
        intentional: bool,
    ) -> WorkerCrash:
        """Classify the end, record and log it; the :class:`WorkerCrash` for ``on_crash``."""
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
        self, w: _Worker, intentional: bool, returncode: int | None, tail: str
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
        """``record_crash(report)``, if set; its exceptions are logged."""
        if self._record_crash is None:
            return
        try:
            self._record_crash(report)
        except Exception as exc:  # a broken callback must not stop the supervision
            self._log.error(
                "supervisor.record_crash_failed",
                job=report.job,
                worker=report.worker,
                error=f"{type(exc).__name__}: {exc}",
            )

    async def _notify_crash(self, report: WorkerCrash) -> None:
        if self._on_crash is None:
            return
        try:
            result = self._on_crash(report)
            if inspect.isawaitable(result):
                await asyncio.wait_for(result, _CALLBACK_TIMEOUT_S)
        except Exception as exc:  # a broken callback must not stop the supervision
            self._log.error(
                "on_crash callback failed",
                job=report.job,
                worker=report.worker,
                error=f"{type(exc).__name__}: {exc}",
            )

    def _signal(self, w: _Worker, sig: signal.Signals) -> bool:
        """Send ``sig`` to the worker's process group (its own session). False if gone."""
        try:
            return launch.signal_worker(w, sig)
        except PermissionError as exc:
            self._log.error("cannot signal worker", pid=w.pid, signal=sig.name, error=str(exc))
            return False

    async def _wait_done(self, w: _Worker) -> None:
        done = w.done
        if done is not None and not done.done():
            await asyncio.shield(done)

    async def _terminate(self, job: _Job, w: _Worker, intent: Intent) -> None:
        """SIGTERM, wait up to the stop timeout, SIGKILL; returns when the exit is handled."""
        if w.state not in _LIVE or w.pid is None:
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

    async def _drain(self, job: _Job, w: _Worker, *, remove_after: bool) -> None:
        """Ask the worker to finish its trial and exit; SIGTERM when it cannot be asked."""
        w.remove_after = w.remove_after or remove_after
        pid = w.pid
        accepted = False
        if self._drain_worker is not None and pid is not None:
            w.intent = "drain"
            w.to("draining")
            try:
                accepted = bool(await self._drain_worker(job.cfg.name, pid))
            except Exception as exc:  # the control server's problem, not a reason to hang
                self._log.error("drain failed", job=job.cfg.name, pid=pid, error=str(exc))
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
    def _cancel_task(w: _Worker) -> None:
        if w.task is not None and not w.task.done() and w.state == "backoff":
            w.task.cancel()
        w.next_start_at_s = None

    def _persist(self, job: _Job) -> None:
        """Write ``workers.json`` atomically (temp file + rename). Errors are logged."""
        try:
            state.save(job, self._window(job, self._clock()))
        except OSError as exc:
            path = str(state.state_path(job))
            self._log.error("cannot write worker state", path=path, error=str(exc))
