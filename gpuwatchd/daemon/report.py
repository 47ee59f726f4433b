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
from gpuwatchd.model import JobInfo, Snapshot

__all__ = ["RECENT_XID_EVENTS", "job_dict", "plain", "status_dict"]

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


def job_dict(job: JobInfo, snapshot: Snapshot | None) -> dict[str, Any]:
    """An attached job for ``status``/``jobs``: its report plus the host's view of its pid."""
    out: dict[str, Any] = plain(job)
    host_job = None
    if snapshot is not None and snapshot.host is not None:
        host_job = next((p for p in snapshot.host.jobs if p.pid == job.pid), None)
    out["process"] = plain(host_job) if host_job is not None else None
    return out


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
) -> dict[str, Any]:
    """The whole ``status`` object (:mod:`gpuwatchd.daemon.ops.status` fits it in a reply)."""
    snap = ticker.last_snapshot
    host = snap.host if snap else None
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
        "gpus": [plain(g) | {"memory_used_pct": g.memory_used_pct} for g in snap.gpus]
        if snap
        else [],
        "host": None
        if host is None
        else {
            "cpu_pct": host.cpu_pct,
            "cpu_count": host.cpu_count,
            "memory_used_bytes": host.memory_used_bytes,
            "memory_total_bytes": host.memory_total_bytes,
            "memory_used_pct": host.memory_used_pct,
        },
        "jobs": [job_dict(job, snap) for job in jobs],
        "managed": managed,
        "policies": policies,
        "paused": paused,
        "dry_run": settings.dry_run,
        "findings": [plain(f) for f in ticker.active.values()],
        "decisions": [record.to_dict() for record in ticker.decisions],
        "xid_events": [e.to_dict() for e in ticker.xid_log.recent(RECENT_XID_EVENTS)],
        "xid_watch": ticker.xid_watch(),
        "journal": keeper.report(),
    }
