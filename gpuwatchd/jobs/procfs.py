"""Linux /proc and cgroup reads for the supervisor: process identity and OOM-kill counters.

A pid alone does not name a process for long: the kernel reuses pids. A process is named
here by ``(pid, start time)``, the start time being field 22 (``starttime``, clock ticks
after boot) of ``/proc/<pid>/stat`` (proc(5)). Two processes with the same pid never have
the same start time within one boot.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Generic, TypeVar

from gpuwatchd.cgroup_identity import cgroup_identity, cgroup_paths
from gpuwatchd.control.messages import SLURM_ENV, parse_slurm, slurm_identity
from gpuwatchd.errors import ProtocolError
from gpuwatchd.model import CgroupIdentity, SlurmJob

_T = TypeVar("_T")

__all__ = [
    "SLURM_CGROUP_PATTERN",
    "OomCounter",
    "PerPid",
    "PidSlurmJobs",
    "ProcStat",
    "child_pids",
    "group_alive",
    "is_same_process",
    "parent_pid",
    "read_cgroup_identity",
    "read_environ",
    "read_oom_counter",
    "read_slurm_job",
    "read_stat",
    "slurm_job_of_cgroup",
]

PROC: Final = Path("/proc")
SLURM_CGROUP_PATTERN: Final = re.compile(
    r"/job_([1-9][0-9]{0,9})/step_([A-Za-z0-9_]{1,32})(?:/|$)"
)
"""Where slurmd puts a step's processes: ``.../job_<id>/step_<n>/...`` (cgroup v1
``/slurm/uid_<uid>/job_<id>/step_batch/task_0``; v2
``/system.slice/slurmstepd.scope/job_<id>/step_0/user/task_0``; cgroup.conf(5))."""
CGROUP_ROOT: Final = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the supervisor uses (proc(5) numbering)."""

    pid: int
    state: str
    """Field 3: ``R``, ``S``, ``D``, ``Z`` (zombie), ``T``, ..."""
    ppid: int
    """Field 4."""
    pgrp: int
    """Field 5: the process group id."""
    start_ticks: int
    """Field 22: start time in clock ticks after boot."""


def read_stat(pid: int, proc: Path = PROC) -> ProcStat | None:
    """Parse ``/proc/<pid>/stat``; ``None`` when the process does not exist (or is unreadable).

    Field 2 (``comm``) is in parentheses and may itself hold spaces and parentheses, so the
    fields are counted from the *last* ``)`` (as proc(5) advises).
    """
    try:
        raw = (proc / str(pid) / "stat").read_bytes().decode("ascii", "replace")
    except OSError:
        return None
    close = raw.rfind(")")
    if close < 0:
        return None
    fields = raw[close + 2 :].split()
    # fields[0] is field 3 (state); field N is fields[N - 3].
    try:
        return ProcStat(
            pid=pid,
            state=fields[0],
            ppid=int(fields[1]),
            pgrp=int(fields[2]),
            start_ticks=int(fields[19]),
        )
    except (IndexError, ValueError):
        return None


def read_environ(pid: int, names: frozenset[str], proc: Path = PROC) -> dict[str, str]:
    """The variables ``names`` of process ``pid``'s initial environment
    (``/proc/<pid>/environ``, NUL-separated ``KEY=VALUE``; proc(5)); empty when unreadable.
    At most 1 MiB is read (the kernel's ARG_MAX-bound environment is smaller)."""
    try:
        with open(proc / str(pid) / "environ", "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return {}
    found: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        name = key.decode("ascii", "replace")
        if sep and name in names:
            found[name] = value.decode("utf-8", "replace")
    return found


def slurm_job_of_cgroup(text: str) -> SlurmJob | None:
    """The Slurm job and step in ``/proc/<pid>/cgroup``'s ``text`` (its lines
    ``<id>:<controllers>:<path>``, :func:`gpuwatchd.cgroup_identity.cgroup_paths`; the
    first path matching :data:`SLURM_CGROUP_PATTERN`), None when no line names one.
    Parsing only."""
    for _, path in cgroup_paths(text):
        found = SLURM_CGROUP_PATTERN.search(path)
        if found:
            return SlurmJob(job_id=found.group(1), step=found.group(2))
    return None


def _read_cgroup(pid: int, proc: Path) -> str | None:
    """``/proc/<pid>/cgroup``'s text, its first 64 KiB; None when unreadable."""
    try:
        with open(proc / str(pid) / "cgroup", encoding="utf-8", errors="replace") as f:
            return f.read(1 << 16)
    except OSError:
        return None


def read_cgroup_identity(pid: int, proc: Path = PROC) -> CgroupIdentity:
    """The systemd unit and Kubernetes pod process ``pid`` runs in, from its cgroup path
    (:func:`gpuwatchd.cgroup_identity.cgroup_identity`); all None when unreadable."""
    text = _read_cgroup(pid, proc)
    return CgroupIdentity() if text is None else cgroup_identity(text)


def read_slurm_job(pid: int, proc: Path = PROC) -> SlurmJob | None:
    """The Slurm job process ``pid`` runs in, for a process without the hook: from its
    environment (:func:`gpuwatchd.control.messages.slurm_identity`: array task, user,
    partition) when readable, with the step from its cgroup path
    (:func:`slurm_job_of_cgroup`); None outside Slurm or when unreadable."""
    text = _read_cgroup(pid, proc)
    from_cgroup = None if text is None else slurm_job_of_cgroup(text)
    given = slurm_identity(read_environ(pid, SLURM_ENV, proc))
    if given is None:
        return from_cgroup
    try:
        job = parse_slurm(given)
    except ProtocolError:  # slurm_identity checked every field; kept for safety
        return from_cgroup
    if job is None or from_cgroup is None or from_cgroup.job_id != job.job_id:
        return job or from_cgroup
    return dataclasses.replace(job, step=from_cgroup.step)


class PerPid(Generic[_T]):
    """``read(pid)`` of each pid asked for, read once per pid and kept while it is asked
    for at every call (a GPU process's Slurm job each tick, its cgroup each ``status``):
    a pid left out of one call is forgotten, and read again if it comes back."""

    def __init__(self, read: Callable[[int], _T]) -> None:
        self._read = read
        self._known: dict[int, _T] = {}

    def __call__(self, pids: Iterable[int]) -> dict[int, _T]:
        """``{pid: read(pid)}`` for each of ``pids`` (a new dict each call)."""
        kept: dict[int, _T] = {}
        for pid in pids:
            if pid not in kept:
                known = self._known
                kept[pid] = known[pid] if pid in known else self._read(pid)
        self._known = kept
        return dict(kept)


class PidSlurmJobs:
    """The Slurm job of each pid asked for (:func:`read_slurm_job`), read once per pid and
    kept while it is asked for at every call (:class:`PerPid`): a GPU process's job, each
    tick."""

    def __init__(self, proc: Path = PROC) -> None:
        self._jobs: PerPid[SlurmJob | None] = PerPid(lambda pid: read_slurm_job(pid, proc))

    def __call__(self, pids: Iterable[int]) -> tuple[tuple[int, SlurmJob], ...]:
        """``(pid, its Slurm job)`` for each of ``pids`` that runs in one, in pid order;
        pids not asked for since the last call are forgotten."""
        found = self._jobs(pids)
        return tuple((pid, job) for pid, job in sorted(found.items()) if job is not None)


def started_wall_s(start_ticks: int, proc: Path = PROC) -> float | None:
    """The wall-clock time (POSIX seconds) a process with ``start_ticks`` (field 22) started:
    now minus the time since then, from ``/proc/uptime`` (centiseconds, proc(5)) and
    ``SC_CLK_TCK``; precise to a clock tick (10 ms). ``None`` when unreadable."""
    import time

    try:
        uptime_s = float((proc / "uptime").read_text(encoding="ascii").split()[0])
        hertz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    since_boot_s = start_ticks / hertz
    if since_boot_s > uptime_s:
        return None  # a virtualised /proc/uptime (LXCFS): the two clocks do not compare
    return time.time() - (uptime_s - since_boot_s)


def is_same_process(pid: int, start_ticks: int | None, proc: Path = PROC) -> bool:
    """True when ``pid`` is alive, not a zombie, and (if given) started at ``start_ticks``."""
    stat = read_stat(pid, proc)
    if stat is None or stat.state in ("Z", "X", "x"):
        return False
    return start_ticks is None or stat.start_ticks == start_ticks


def parent_pid(pid: int, proc: Path = PROC) -> int | None:
    """The parent pid of ``pid`` (field 4), or ``None`` when it is gone."""
    stat = read_stat(pid, proc)
    return None if stat is None else stat.ppid


def child_pids(pid: int, proc: Path = PROC) -> list[int]:
    """The children of ``pid``: ``/proc/<pid>/task/<tid>/children`` of each of its threads
    (Linux >= 3.5, proc(5)); empty when it is gone or the files are unreadable."""
    found: list[int] = []
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            text = (task / "children").read_text(encoding="ascii")
        except OSError:
            continue
        found += [int(word) for word in text.split() if word.isdigit()]
    return found


@dataclass(frozen=True, slots=True)
class OomCounter:
    """Where an ``oom_kill`` counter was read and its value at that time."""

    path: str
    key: str
    value: int

    def reread(self) -> int | None:
        """Read the same counter again; ``None`` if it became unreadable."""
        return _read_key(Path(self.path), self.key)


def _read_key(path: Path, key: str) -> int | None:
    """The integer after ``key`` in a ``key value`` per line file (memory.events, vmstat)."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            try:
                return int(parts[1])
            except ValueError:
                return None
    return None


def _cgroup_candidates(pid: int, proc: Path, cgroot: Path) -> list[Path]:
    """``memory.events`` (v2) / ``memory.oom_control`` (v1) files of ``pid``'s cgroup."""
    text = _read_cgroup(pid, proc)
    if text is None:
        return []
    found: list[Path] = []
    for controllers, path in cgroup_paths(text):
        rel = path.lstrip("/")
        if controllers == "":  # cgroup v2 unified hierarchy
            for base in (cgroot, cgroot / "unified"):
                found.append(base / rel / "memory.events")
        elif "memory" in controllers.split(","):
            found.append(cgroot / "memory" / rel / "memory.oom_control")
    return found


def read_oom_counter(
    pid: int | None = None, *, proc: Path = PROC, cgroot: Path = CGROUP_ROOT
) -> OomCounter | None:
    """Find and read an ``oom_kill`` counter that covers ``pid``; ``None`` if none is readable.

    In order: the cgroup of ``pid`` (v2 ``memory.events``, which counts "processes belonging
    to this cgroup killed by any kind of OOM killer", or v1 ``memory.oom_control``, whose
    ``oom_kill`` field exists since Linux 4.13), then ``/proc/vmstat``'s system-wide
    ``oom_kill`` (Linux >= 4.13). Inside a container the cgroup path from
    ``/proc/<pid>/cgroup`` may not exist under ``/sys/fs/cgroup``; the next candidate is
    then tried.
    """
    candidates: list[tuple[Path, str]] = []
    if pid is not None:
        candidates += [(p, "oom_kill") for p in _cgroup_candidates(pid, proc, cgroot)]
    candidates.append((proc / "vmstat", "oom_kill"))
    for path, key in candidates:
        value = _read_key(path, key)
        if value is not None:
            return OomCounter(str(path), key, value)
    return None


def read_host_oom_kills(proc: Path = PROC) -> int | None:
    """``/proc/vmstat``'s system-wide ``oom_kill`` (Linux >= 4.13, proc(5)); None unread."""
    return _read_key(proc / "vmstat", "oom_kill")


def group_alive(pgid: int) -> bool:
    """Whether any process is in process group ``pgid`` (signal 0 to the group)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
