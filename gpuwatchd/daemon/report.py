"""The JSON objects ``status`` and ``jobs`` reply with, built from the daemon's parts."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, Final

from gpuwatchd import __version__
from gpuwatchd.config import Settings
from gpuwatchd.daemon.restore import JournalKeeper
from gpuwatchd.daemon.tick import Ticker
from gpuwatchd.jobs.procfs import PerPid, read_cgroup_identity
from gpuwatchd.model import CgroupIdentity, JobInfo, Snapshot
from gpuwatchd.policy.holds import KnobHold

__all__ = [
    "GPU_DICTS",
    "JOB_DICTS",
    "RECENT_XID_EVENTS",
    "GpuDicts",
    "JobDicts",
    "gpus_and_host",
    "job_key",
    "plain",
    "status_dict",
]

RECENT_XID_EVENTS: Final = 20
"""``status``: the last Xid events shown (the daemon keeps :data:`gpuwatchd.xid.XID_LOG_SIZE`)."""


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_LEAVES: Final = frozenset({str, int, float, bool, type(None)})


def plain(value: Any) -> Any:
    """``value`` with dataclasses turned into dicts and tuples into lists, recursively, as
    :func:`dataclasses.asdict` does for JSON but without its deep copies (the model's
    dataclasses are frozen and their leaves immutable): ``status`` with 64 jobs spent
    nearly all its time in ``asdict``."""
    cls = type(value)
    if cls in _LEAVES:
        return value
    names = _FIELD_NAMES.get(cls)
    if names is None and hasattr(cls, "__dataclass_fields__"):
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(value))
    if names is not None:
        out = {}
        for name in names:
            item = getattr(value, name)
            out[name] = item if type(item) in _LEAVES else plain(item)
        return out
    if cls is tuple or cls is list:
        return [item if type(item) in _LEAVES else plain(item) for item in value]
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    return value


def job_key(job: JobInfo) -> tuple[Any, ...]:
    """What a job's entry in ``status``/``jobs`` is made of, but its process: equal keys,
    equal entries (its report is frozen: a new report is a new object)."""
    return (
        job.pid,
        job.connected_at_s,
        job.cuda_devices,
        job.study,
        job.trial_number,
        job.last_report,
        tuple(job.knobs.items()),
        job.slurm,
        job.cgroup,
    )


def gpus_and_host(snapshot: Snapshot | None) -> dict[str, Any]:
    """``status``'s ``gpus`` (each GPU process with its Slurm job: :class:`GpuDicts`) and
    ``host`` from the tick's ``snapshot`` (None: no tick yet)."""
    host = snapshot.host if snapshot else None
    return {
        "gpus": GPU_DICTS(snapshot) if snapshot else [],
        "host": None
        if host is None
        else {
            "cpu_pct": host.cpu_pct,
            "cpu_count": host.cpu_count,
            "memory_used_bytes": host.memory_used_bytes,
            "memory_total_bytes": host.memory_total_bytes,
            "memory_used_pct": host.memory_used_pct,
        },
    }


def _cgroup_of(pid: int) -> dict[str, Any] | None:
    """Who runs process ``pid`` by its cgroup path, as ``status`` shows it (its
    ``cgroup``: ``systemd_unit``, ``systemd_user`` and ``kubernetes_pod_uid``,
    :func:`gpuwatchd.jobs.procfs.read_cgroup_identity`); None when the path names neither."""
    identity = read_cgroup_identity(pid)
    return None if identity == CgroupIdentity() else plain(identity)


class JobDicts:
    """The attached jobs for ``status``/``jobs`` (each its report plus the host's view of
    its pid, ``process``), reusing each job's converted part while
    it is unchanged: ``status`` is asked for up to 100 times a second, a job reports 4
    times a second at most, and converting 64 jobs on every request was most of a
    ``status``'s time (bench/control.py)."""

    def __init__(self) -> None:
        self._plain: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def __call__(self, jobs: Sequence[JobInfo], snapshot: Snapshot | None) -> list[dict[str, Any]]:
        """One dict per job of ``jobs`` (a fresh top level: ``process`` is this call's)."""
        processes: dict[int, Any] = {}
        if snapshot is not None and snapshot.host is not None:
            for process in snapshot.host.jobs:
                processes.setdefault(process.pid, process)
        cache = self._plain
        kept: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        out = []
        for job in jobs:
            key = job_key(job)
            hit = cache.get(job.name)
            if hit is None or hit[0] != key:
                hit = (key, plain(job))
            kept[job.name] = hit
            seen = processes.get(job.pid)
            entry = dict(hit[1])
            entry["process"] = plain(seen) if seen is not None else None
            out.append(entry)
        self._plain = kept
        return out


JOB_DICTS: Final = JobDicts()
"""The daemon's :class:`JobDicts` (one daemon per process)."""


class GpuDicts:
    """The GPUs for ``status``, each GPU process with who runs it: ``slurm`` (its Slurm job,
    its attached job's hello or else read by the tick, as the metrics label it:
    :attr:`~gpuwatchd.model.Snapshot.process_slurm`; or null) and
    ``cgroup`` (:func:`_cgroup_of`, read once while the pid is on a GPU:
    :class:`~gpuwatchd.jobs.procfs.PerPid`)."""

    def __init__(self) -> None:
        self._cgroups = PerPid(_cgroup_of)

    def __call__(self, snapshot: Snapshot) -> list[dict[str, Any]]:
        """One dict per GPU of ``snapshot``, ``memory_used_pct`` added, each of
        ``processes`` attributed."""
        slurm = dict(snapshot.process_slurm)
        cgroups = self._cgroups(p.pid for gpu in snapshot.gpus for p in gpu.processes)
        out = []
        for gpu in snapshot.gpus:
            entry = plain(gpu) | {"memory_used_pct": gpu.memory_used_pct}
            for process in entry.get("processes") or []:
                found = slurm.get(process["pid"])
                process["slurm"] = None if found is None else plain(found)
                cgroup = cgroups.get(process["pid"])
                process["cgroup"] = None if cgroup is None else dict(cgroup)
            out.append(entry)
        return out


GPU_DICTS: Final = GpuDicts()
"""The daemon's :class:`GpuDicts` (one daemon per process)."""


def status_dict(
    *,
    settings: Settings,
    ticker: Ticker,
    keeper: JournalKeeper,
    jobs: Sequence[JobInfo],
    managed: list[dict[str, Any]],
    policies: dict[str, Any],
    paused: bool,
    started_at_s: float,
    started_monotonic_s: float,
    cordons: list[dict[str, Any]] | None = None,
    holds: Sequence[KnobHold] = (),
) -> dict[str, Any]:
    """The whole ``status`` object (:mod:`gpuwatchd.daemon.ops.status` fits it in a reply).

    ``cordons``: the cordoned GPUs (:meth:`gpuwatchd.cordon.Cordons.report`); ``holds``:
    the operator's overrides in force (job, knob, value, by_uid, until_s)."""
    snap = ticker.last_snapshot
    stats = ticker.stats
    return {
        "version": __version__,
        "pid": os.getpid(),
        "started_at_s": started_at_s,
        "uptime_s": time.monotonic() - started_monotonic_s,
        "interval_s": settings.interval_s,
        "ticks": stats.ticks,
        "failed_ticks": stats.failed_ticks,
        "last_tick_duration_s": stats.last_tick_duration_s,
        "last_tick_at_s": stats.last_tick_at_s,
        "gpu_status": snap.gpu_status if snap else ticker.gpu_status,
        **gpus_and_host(snap),
        "jobs": JOB_DICTS(jobs, snap),
        "managed": managed,
        "policies": policies,
        "paused": paused,
        "cordons": cordons or [],
        "holds": [held.to_dict() for held in holds],
        "dry_run": settings.dry_run,
        "findings": [plain(f) for f in ticker.active.values()],
        "decisions": [record.to_dict() for record in ticker.decisions],
        "xid_events": [e.to_dict() for e in ticker.xid_log.recent(RECENT_XID_EVENTS)],
        "xid_watch": ticker.xid_watch(),
        "journal": keeper.report(),
    }
