"""Host sampling through psutil (the only module of gpuwatchd that imports ``psutil``).

Specification: docs/modules.md#gpuwatchdsamplinghost
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from gpuwatchd.model import HostSample, JobProcessSample

__all__ = ["CHILDREN_REFRESH_S", "HostSampler"]

CHILDREN_REFRESH_S: Final = 5.0
"""Seconds between two rediscoveries of one job's children (see module docstring)."""


@dataclass(slots=True)
class _Job:
    process: Any
    children: dict[int, Any] = field(default_factory=dict)
    direct_children: set[int] = field(default_factory=set)
    children_at_s: float | None = None


class HostSampler:
    """Sample the host and the processes of attached jobs (a :class:`~gpuwatchd.model.HostSample`).

    Construction primes ``psutil.cpu_percent`` so the first :meth:`sample` already
    reports CPU since construction. ``children_refresh_s`` is how often a job's
    children are rediscovered (default :data:`CHILDREN_REFRESH_S`).
    """

    def __init__(self, *, children_refresh_s: float = CHILDREN_REFRESH_S) -> None:
        import psutil

        self._psutil: Any = psutil
        self._gone: tuple[type[BaseException], ...] = (
            psutil.NoSuchProcess,
            psutil.AccessDenied,
            psutil.ZombieProcess,
        )
        self._children_refresh_s = children_refresh_s
        self._cpu_count: int = psutil.cpu_count(logical=True) or 1
        self._jobs: dict[int, _Job] = {}
        psutil.cpu_percent(None)

    @property
    def cpu_count(self) -> int:
        """Logical CPUs of the host (``os.cpu_count()`` as psutil reports it)."""
        return self._cpu_count

    def sample(self, now_s: float, job_pids: Iterable[int] = ()) -> HostSample:
        """Return the host at ``now_s`` with one :class:`JobProcessSample` per live job pid.

        ``cpu_pct`` of the host is percent of all logical CPUs (0..100); a job's
        ``cpu_pct`` is percent of one core summed over the process and its
        descendants (as ``top``; 0.0 on the first sample of a pid). Memory used is
        ``total - available`` (``psutil.virtual_memory``), in bytes. Pids that do not
        exist (any more) are left out; nothing is raised for them.
        """
        psutil = self._psutil
        cpu_pct = float(psutil.cpu_percent(None))
        memory = psutil.virtual_memory()
        wanted = list(dict.fromkeys(job_pids))
        for pid in list(self._jobs):
            if pid not in wanted:
                del self._jobs[pid]
        jobs = []
        for pid in wanted:
            job_sample = self._sample_job(pid, now_s)
            if job_sample is None:
                self._jobs.pop(pid, None)
            else:
                jobs.append(job_sample)
        return HostSample(
            timestamp_s=now_s,
            cpu_pct=cpu_pct,
            cpu_count=self._cpu_count,
            memory_used_bytes=int(memory.total - memory.available),
            memory_total_bytes=int(memory.total),
            jobs=tuple(jobs),
        )

    def _sample_job(self, pid: int, now_s: float) -> JobProcessSample | None:
        job = self._jobs.get(pid)
        try:
            if job is None:
                job = self._jobs[pid] = _Job(self._psutil.Process(pid))
            measured = self._measure(job.process)
        except self._gone:
            return None
        if measured is None:
            return None
        cpu_pct, rss_bytes = measured
        if job.children_at_s is None or now_s - job.children_at_s >= self._children_refresh_s:
            self._refresh_children(job, now_s)
        live_workers = 0
        for child_pid, child in list(job.children.items()):
            try:
                child_measured = self._measure(child)
            except self._gone:
                child_measured = None
            if child_measured is None:
                del job.children[child_pid]
                job.direct_children.discard(child_pid)
                # Workers usually go in a batch when the loader is rebuilt (a new epoch,
                # a knob change): look for their successors on the next tick.
                job.children_at_s = None
                continue
            cpu_pct += child_measured[0]
            rss_bytes += child_measured[1]
            if child_pid in job.direct_children:
                live_workers += 1
        return JobProcessSample(
            pid=pid, cpu_pct=cpu_pct, rss_bytes=rss_bytes, num_worker_children=live_workers
        )

    def _measure(self, process: Any) -> tuple[float, int] | None:
        """``(cpu_pct, rss_bytes)`` of one process, None for a zombie; raises psutil errors.

        ``cpu_percent(None)`` is CPU since the previous call on the same object;
        psutil returns 0.0 on the first call, which primes it. ``oneshot()`` makes
        status and CPU times one read of ``/proc/<pid>/stat``.
        """
        with process.oneshot():
            if process.status() == self._psutil.STATUS_ZOMBIE:
                return None
            return float(process.cpu_percent(None)), int(process.memory_info().rss)

    def _refresh_children(self, job: _Job, now_s: float) -> None:
        """Rediscover ``job``'s descendants (rate-limited; see the module docstring)."""
        job.children_at_s = now_s
        parent_pid = job.process.pid
        direct_pids = _proc_children(parent_pid)
        if direct_pids is None:  # no /proc/<pid>/task/<tid>/children: psutil's full scan
            try:
                found = job.process.children(recursive=True)
                direct_pids = {c.pid for c in found if c.ppid() == parent_pid}
            except self._gone:
                return
            pids = [c.pid for c in found]
        else:
            pids, stack = [], list(direct_pids)
            while stack:
                pid = stack.pop()
                pids.append(pid)
                stack.extend(_proc_children(pid) or ())
        children: dict[int, Any] = {}
        for pid in pids:
            try:
                child = self._psutil.Process(pid)
            except self._gone:
                continue
            cached = job.children.get(pid)
            # Same pid and start time: keep the object that holds the previous CPU reading.
            children[pid] = cached if cached is not None and cached == child else child
        job.children = children
        job.direct_children = direct_pids & children.keys()


def _proc_children(pid: int) -> set[int] | None:
    """Direct children of ``pid`` from ``/proc/<pid>/task/*/children`` (proc(5)).

    Each thread lists the children it forked, so all threads are read. Returns None
    where the kernel has no such file (then the caller falls back to psutil), and an
    empty set for a process that is gone.
    """
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return set()
    found: set[int] = set()
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as handle:
                found.update(int(child) for child in handle.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended between listdir and open
            return None
        except OSError:
            continue
    return found
