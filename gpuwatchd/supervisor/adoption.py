"""Adoption after a daemon restart: recorded workers still alive are watched again,
the ones that ended while no daemon watched are reported (or held finished when their
hook had detached cleanly). Specification: docs/supervisor-internals.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from gpuwatchd.crash import classify
from gpuwatchd.supervisor import state, unit_launch
from gpuwatchd.supervisor._output import OutputFiles, StderrTail
from gpuwatchd.supervisor._procfs import is_same_process, read_oom_counter
from gpuwatchd.supervisor.records import ManagedJob, WorkerCrash, WorkerSlot
from gpuwatchd.supervisor.transient_unit import unit_name
from gpuwatchd.supervisor.worker import PRESUMED_CLEAN_NOTE

__all__ = ["WorkerAdopter"]

_Job = ManagedJob
_Worker = WorkerSlot


class WorkerAdopter:
    """What a (re)started supervisor does with ``workers.json``; base of
    :class:`~gpuwatchd.supervisor.runner.WorkerRunner`, which sets the attributes."""

    _clock: Callable[[], float]
    _log: Any
    _output_max_bytes: int
    _launcher: str

    def _watch(self, job: _Job, w: _Worker) -> Coroutine[Any, Any, None]:
        """Watch ``w`` until it exits (the runner's)."""
        raise NotImplementedError

    async def _ask_exit_hint(
        self, job: str, pid: int, worker_id: str | None, *, quiet: bool
    ) -> bool:
        """The supervisor's ``exit_hint`` (the runner's)."""
        raise NotImplementedError

    async def _settle_gone(
        self, job: _Job, gone: list[tuple[state.RecordedWorker, StderrTail]]
    ) -> list[WorkerCrash]:
        """Reports for the recorded workers that ended while no daemon watched, but for
        those ``exit_hint`` takes as clean (no crash in this launch's stderr and the study
        says their last trial finished: their ``detach`` reached no daemon)."""
        reports: list[WorkerCrash] = []
        for rec, tail in gone:
            crash = classify(None, tail.text(), None)
            quiet = crash.kind == "other" and not crash.evidence
            if await self._ask_exit_hint(job.cfg.name, rec.pid, rec.worker_id, quiet=quiet):
                self._ended_clean_while_down(job, rec)
            else:
                reports.append(self._gone_while_down(job, rec, tail))
        return reports

    def _adopt(self, job: _Job) -> list[tuple[state.RecordedWorker, StderrTail]]:
        """Adopt ``job``'s recorded live workers; return the ones gone without a clean
        ``detach`` on record, with their launch's stderr (for :meth:`_settle_gone`)."""
        path = state.state_path(job)
        try:
            data = state.load(path)
        except state.UnreadableState as exc:
            self._log.warning("ignoring unreadable worker state", path=str(path), error=str(exc))
            data = {}
        except state.OtherVersionState:
            self._log.warning("ignoring worker state of another version", path=str(path))
            data = {}
        saved = state.parse(data)
        name = job.cfg.name
        if saved.parallelism is not None:
            job.parallelism = max(0, min(saved.parallelism, job.cfg.workers))
        if saved.restart_times_s is not None:
            job.restart_times_s = list(saved.restart_times_s)
        for entry in saved.bad_entries:
            self._log.warning("ignoring a bad worker entry", job=name, entry=entry)
        gone: list[tuple[state.RecordedWorker, StderrTail]] = []
        for rec in saved.workers:
            if rec.worker in job.workers:
                continue
            files = OutputFiles(job.directory, rec.worker, max_bytes=self._output_max_bytes)
            tail = StderrTail(files.err, start_at_end=False, start_at=rec.stderr_offset)
            if not is_same_process(rec.pid, rec.start_ticks):
                if rec.detached_at_s is not None:
                    self._ended_clean_while_down(job, rec)
                else:
                    gone.append((rec, tail))
                continue
            w = _Worker(
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
                files=files,
                tail=tail,
                stderr_offset=rec.stderr_offset,
                detached_at_s=rec.detached_at_s,
                oom=read_oom_counter(rec.pid),
                unit=self._unit_of(name, rec),
            )
            started_at = rec.started_at_s
            w.started_mono = time.monotonic() - (
                0.0 if started_at is None else max(0.0, self._clock() - started_at)
            )
            w.done = asyncio.get_running_loop().create_future()
            job.workers[rec.worker] = w
            w.task = asyncio.create_task(self._watch(job, w), name=f"gpuwatchd-{name}-{rec.worker}")
            self._log.info(
                "worker adopted",
                job=name,
                worker=rec.worker,
                pid=rec.pid,
                gpu=rec.gpu,
                unit=w.unit,
            )
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
            job.workers[held.worker] = _Worker(
                number=held.worker, state="stopped", note=held.note, held=held.reason
            )
            self._log.info("worker.held", job=name, worker=held.worker, reason=held.reason)
        return gone

    def _unit_of(self, job: str, rec: state.RecordedWorker) -> str | None:
        """The worker unit ``gpuwatchd-<job>-<slot>.service`` when systemd names ``rec``'s
        process as its main pid (systemd launcher), else ``None``: a process the earlier
        daemon started itself is watched by pid alone."""
        if self._launcher != "systemd":
            return None
        unit = unit_name(job, rec.worker)
        return unit if unit_launch.main_pid(unit) == rec.pid else None

    def _ended_clean_while_down(self, job: _Job, rec: state.RecordedWorker) -> None:
        """A recorded worker whose hook had detached cleanly ended while no daemon
        watched: a clean exit (status presumed 0), held as finished; no crash."""
        job.workers[rec.worker] = _Worker(
            number=rec.worker,
            state="stopped",
            note=PRESUMED_CLEAN_NOTE,
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
            status=None,
            note=PRESUMED_CLEAN_NOTE,
        )

    def _gone_while_down(
        self, job: _Job, rec: state.RecordedWorker, tail: StderrTail
    ) -> WorkerCrash:
        """Log and report a recorded worker that ended while no daemon watched it."""
        crash = classify(None, tail.text(), None)
        started_at = rec.started_at_s
        uptime = None if started_at is None else max(0.0, self._clock() - started_at)
        self._log.warning(
            "worker ended while gpuwatchd was down",
            job=job.cfg.name,
            worker=rec.worker,
            pid=rec.pid,
            kind=crash.kind,
            reason=crash.reason,
        )
        return WorkerCrash(
            job=job.cfg.name,
            worker=rec.worker,
            pid=rec.pid,
            gpu_index=rec.gpu,
            crash_info=crash,
            trial_number=rec.trial_number,
            stderr_tail=tail.text(),
            timestamp_s=self._clock(),
            returncode=None,
            uptime_s=uptime,
            worker_id=rec.worker_id,
        )
