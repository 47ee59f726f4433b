"""Adoption after a daemon restart: recorded workers still alive are watched again,
the ones that ended while no daemon watched are reported as crashes unless their end is
known clean (a worker unit's status 0 as systemd kept it, or the hook's exit line in that
launch's stderr); nothing is presumed from the absence of evidence. With the systemd
launcher a running worker unit missing from ``workers.json`` is adopted too.
Specification: docs/supervisor-internals.md, docs/systemd.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpuwatchd.control.protocol import exit_line_of
from gpuwatchd.crash import CrashInfo, classify
from gpuwatchd.supervisor import state, unit_launch
from gpuwatchd.supervisor._output import OutputFiles, StderrTail
from gpuwatchd.supervisor._procfs import (
    is_same_process,
    read_environ,
    read_host_oom_kills,
    read_oom_counter,
    read_stat,
)
from gpuwatchd.supervisor.records import ManagedJob, WorkerCrash, WorkerSlot
from gpuwatchd.supervisor.transient_unit import launch_identifier, unit_name
from gpuwatchd.supervisor.worker import EXIT_LINE_NOTE

__all__ = ["GoneWorker", "WorkerAdopter"]

UNIT_CLEAN_NOTE: Final = "exited with status 0 while gpuwatchd was down (its unit says)"
_UNIT_ENV: Final = frozenset({"GPUWATCHD_WORKER_ID", "CUDA_VISIBLE_DEVICES"})


@dataclass(frozen=True, slots=True)
class GoneWorker:
    """A worker that ended while no daemon watched it: its record (from ``workers.json``,
    or made from its unit), its launch's stderr and, with the systemd launcher, its
    ended unit whose exit status and ``Result`` systemd kept (``None``: status unknown)."""

    rec: state.RecordedWorker
    tail: StderrTail
    unit: str | None = None


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

    async def _finish_unit(
        self, job: _Job, worker: int, unit: str, err: Path | None, worker_id: str | None
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

    async def _settle_gone(self, job: _Job, gone: list[GoneWorker]) -> list[WorkerCrash]:
        """Reports for the workers that ended while no daemon watched.

        A worker unit's end is read from systemd (:func:`.unit_launch.finish`): status 0
        is a clean end, held finished, unless ``Result=oom-kill``; anything else a crash
        classified from the exit status, ``Result`` and its journal. Without a unit the
        status is unknown: clean only with the hook's exit line in this launch's stderr
        (:func:`gpuwatchd.control.protocol.exit_line_of`), else a crash (its trials are
        failed and retried, the slot relaunched)."""
        reports: list[WorkerCrash] = []
        for g in gone:
            if g.unit is not None:
                end = await self._finish_unit(
                    job, g.rec.worker, g.unit, g.tail.path, g.rec.worker_id
                )
                g.tail.update()
                if end.returncode == 0 and end.result != "oom-kill":
                    self._ended_clean_while_down(job, g.rec, status_known=True)
                else:
                    reports.append(self._gone_while_down(job, g, end))
                continue
            g.tail.update()
            if exit_line_of(g.tail.text(), g.rec.worker_id):
                self._ended_clean_while_down(job, g.rec)
            else:
                reports.append(self._gone_while_down(job, g, None))
        return reports

    async def _adopt(self, job: _Job) -> list[GoneWorker]:
        """Adopt ``job``'s recorded live workers (and, with the systemd launcher, running
        worker units of its slots that ``workers.json`` misses); return the ones gone
        (for :meth:`_settle_gone`)."""
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
            job.workers[held.worker] = _Worker(
                number=held.worker, state="stopped", note=held.note, held=held.reason
            )
            self._log.info("worker.held", job=name, worker=held.worker, reason=held.reason)
        return gone

    def _from_unit(
        self,
        job: _Job,
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

    def _tail(self, job: _Job, worker: int, *, start_at: int | None) -> StderrTail:
        """The stderr tail of slot ``worker``'s launch: from ``start_at`` (its recorded
        offset), else from the file's current end."""
        files = OutputFiles(job.directory, worker, max_bytes=self._output_max_bytes)
        if start_at is None:
            return StderrTail(files.err)
        return StderrTail(files.err, start_at_end=False, start_at=start_at)

    @staticmethod
    def _record_from_unit(
        worker: int, props: Mapping[str, str], *, restarts: int
    ) -> tuple[state.RecordedWorker, bool] | None:
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
        rec = state.RecordedWorker(
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
        self, job: _Job, rec: state.RecordedWorker, tail: StderrTail, unit: str | None
    ) -> None:
        """Watch the live process of ``rec`` as slot ``rec.worker`` (``unit``: the worker
        unit whose main process it is, else ``None``)."""
        name = job.cfg.name
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
        self, job: _Job, rec: state.RecordedWorker, *, status_known: bool = False
    ) -> None:
        """A recorded worker ended cleanly while no daemon watched: held as finished; no
        crash. ``status_known``: its unit says status 0; else its launch's stderr ends
        with the hook's exit line (written from the process's exit path)."""
        note = UNIT_CLEAN_NOTE if status_known else EXIT_LINE_NOTE
        job.workers[rec.worker] = _Worker(
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
        self, job: _Job, g: GoneWorker, end: unit_launch.UnitEnd | None
    ) -> WorkerCrash:
        """Log and report a worker that ended while no daemon watched it (``end``: how its
        unit ended, when systemd kept it)."""
        rec = g.rec
        returncode = None if end is None else end.returncode
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


def _oom_kills_since(rec: state.RecordedWorker) -> int | None:
    """How many processes the kernel's OOM killer killed on this host since ``rec``'s
    launch started (``/proc/vmstat``), None when either value is unread: a SIGKILL with
    none is no host OOM (a kill from outside, or with the daemon's control group)."""
    now = read_host_oom_kills()
    if now is None or rec.host_oom_kills is None:
        return None
    return max(0, now - rec.host_oom_kills)
