"""``<state_dir>/jobs/<job>/workers.json``: the live workers of a job, for a later daemon.

A daemon restarted after a crash adopts the recorded workers still running (same pid and
start time). Format and reasons: docs/supervisor-internals.md, "workers.json".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpuwatchd.config import JobConfig
from gpuwatchd.jobs.job import Job
from gpuwatchd.jobs.worker import LIVE, Worker
from gpuwatchd.statefile import write_json_atomic

__all__ = [
    "STATE_FILE",
    "STATE_VERSION",
    "HeldSlot",
    "OtherVersionState",
    "RecordedWorker",
    "SavedJob",
    "UnreadableState",
    "UnusableState",
    "fingerprint",
    "load",
    "parse",
    "save",
    "state_path",
    "to_json",
]

STATE_FILE: Final = "workers.json"
"""Per-job file under ``<state_dir>/jobs/<job>/`` naming the live workers."""

STATE_VERSION: Final = 1
"""The ``version`` written; a file with another version is ignored (logged)."""


@dataclass(frozen=True, slots=True)
class RecordedWorker:
    """One live worker as ``workers.json`` names it.

    ``start_ticks``: ``/proc/<pid>/stat`` field 22 (clock ticks since boot), ``None`` if
    unread. ``started_at_s``: on the supervisor's clock (seconds).
    """

    worker: int
    pid: int
    start_ticks: int | None
    gpu: int | None
    started_at_s: float | None
    restarts: int
    trial_number: int | None
    placement_reason: str
    worker_id: str | None
    stderr_offset: int | None = None
    progressed: bool = False
    host_oom_kills: int | None = None
    """``/proc/vmstat``'s ``oom_kill`` when the launch started (``None``: unread): a
    launch found dead at the next start is a host OOM only if the counter rose since."""


@dataclass(frozen=True, slots=True)
class HeldSlot:
    """A slot that stays down across daemon restarts, as ``workers.json`` names it.

    ``reason``: ``"finished"`` (its process exited with status 0) or ``"stopped by an
    operator"``; ``note``: the slot's note then; ``config``: the job configuration's
    :func:`fingerprint` when it was recorded (another one: the slot starts again).
    """

    worker: int
    reason: str
    note: str
    config: str


def fingerprint(cfg: JobConfig) -> str:
    """A digest (hex SHA-256, 16 characters) of everything in ``cfg`` a worker runs with.

    Two configurations with the same digest start the same workers; ``workers:`` and
    ``restart:`` are left out (they say how many and how often, not what runs).
    """
    fields = dataclasses.asdict(cfg)
    fields.pop("workers", None)
    fields.pop("min_workers", None)
    fields.pop("restart", None)
    if not fields.get("unit_properties"):
        fields.pop("unit_properties", None)  # the same digest as before the setting existed
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class SavedJob:
    """What :func:`parse` took from a ``workers.json`` (empty when absent or unusable).

    ``parallelism``: as recorded (not yet clamped to the config), ``None`` when absent.
    ``bad_entries``: the ``repr`` of each worker entry that could not be read.
    """

    parallelism: int | None = None
    restart_times_s: tuple[float, ...] | None = None
    workers: tuple[RecordedWorker, ...] = ()
    bad_entries: tuple[str, ...] = ()
    held: tuple[HeldSlot, ...] = ()


def state_path(job: Job) -> Path:
    """``<job directory>/workers.json``."""
    return job.directory / STATE_FILE


def to_json(job: Job, restart_times_s: Iterable[float]) -> dict[str, Any]:
    """The JSON document for ``job``: its live workers (a pid and a live state) in slot order."""
    live = [
        {
            "worker": w.number,
            "pid": w.pid,
            "start_ticks": w.start_ticks,
            "gpu": w.gpu,
            "started_at_s": w.started_at_s,
            "restarts": w.restarts,
            "trial_number": w.trial_number,
            "placement_reason": w.placement_reason,
            "worker_id": w.worker_id,
            "stderr_offset": w.stderr_offset,
            "progressed": w.progressed,
            "host_oom_kills": w.host_oom_kills,
        }
        for w in sorted(job.workers.values(), key=_number)
        if w.pid is not None and w.state in LIVE
    ]
    held = [
        {"worker": w.number, "reason": w.held, "note": w.note, "config": job.fingerprint}
        for w in sorted(job.workers.values(), key=_number)
        if w.held is not None and w.state not in LIVE and w.pid is None
    ]
    return {
        "version": STATE_VERSION,
        "job": job.cfg.name,
        "parallelism": job.parallelism,
        "restart_times_s": list(restart_times_s),
        "workers": live,
        "held": held,
    }


def save(job: Job, restart_times_s: Iterable[float]) -> None:
    """Write ``job``'s ``workers.json`` atomically. Raises :class:`OSError`."""
    write_json_atomic(state_path(job), to_json(job, restart_times_s))


class UnusableState(Exception):
    """``workers.json`` exists but cannot be used (the message says why)."""


class UnreadableState(UnusableState):
    """``workers.json`` cannot be read or is not JSON."""


class OtherVersionState(UnusableState):
    """``workers.json`` is not a version-:data:`STATE_VERSION` document."""


def load(path: Path) -> dict[str, Any]:
    """The document in ``path`` (``{}`` when absent).

    Raises :class:`UnreadableState` or :class:`OtherVersionState` (both
    :class:`UnusableState`).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise UnreadableState(str(exc)) from None
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise OtherVersionState(f"not version {STATE_VERSION}")
    return data


def parse(data: dict[str, Any]) -> SavedJob:
    """Pure: the :class:`SavedJob` in a loaded document (wrong types are skipped)."""
    parallelism = data.get("parallelism")
    if not isinstance(parallelism, int) or isinstance(parallelism, bool):
        parallelism = None
    times = data.get("restart_times_s", [])
    restart_times = (
        tuple(float(t) for t in times if isinstance(t, (int, float)))
        if isinstance(times, list)
        else None
    )
    workers: list[RecordedWorker] = []
    bad: list[str] = []
    entries = data.get("workers", [])
    for entry in entries if isinstance(entries, list) else []:
        try:
            number, pid = int(entry["worker"]), int(entry["pid"])
            ticks = entry.get("start_ticks")
            ticks = int(ticks) if ticks is not None else None
            gpu = entry.get("gpu")
            gpu = int(gpu) if gpu is not None else None
        except (KeyError, TypeError, ValueError):
            bad.append(repr(entry))
            continue
        trial = entry.get("trial_number")
        worker_id = entry.get("worker_id")
        started_at = entry.get("started_at_s")
        restarts = entry.get("restarts", 0)
        offset = entry.get("stderr_offset")
        progressed = entry.get("progressed")
        oom_kills = entry.get("host_oom_kills")
        workers.append(
            RecordedWorker(
                worker=number,
                pid=pid,
                start_ticks=ticks,
                gpu=gpu,
                started_at_s=float(started_at) if isinstance(started_at, (int, float)) else None,
                restarts=restarts if isinstance(restarts, int) else 0,
                trial_number=trial if isinstance(trial, int) else None,
                placement_reason=str(entry.get("placement_reason", "")),
                worker_id=worker_id if isinstance(worker_id, str) else None,
                stderr_offset=offset
                if isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0
                else None,
                progressed=progressed is True,
                host_oom_kills=oom_kills
                if isinstance(oom_kills, int) and not isinstance(oom_kills, bool) and oom_kills >= 0
                else None,
            )
        )
    held: list[HeldSlot] = []
    entries = data.get("held", [])
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            bad.append(repr(entry))
            continue
        held_number, reason = entry.get("worker"), entry.get("reason")
        note, config = entry.get("note", ""), entry.get("config", "")
        if (
            isinstance(held_number, bool)
            or not isinstance(held_number, int)
            or held_number < 0
            or not isinstance(reason, str)
            or not isinstance(note, str)
            or not isinstance(config, str)
        ):
            bad.append(repr(entry))
            continue
        held.append(HeldSlot(held_number, reason[:200], note[:300], config[:64]))
    return SavedJob(parallelism, restart_times, tuple(workers), tuple(bad), tuple(held))


def _number(w: Worker) -> int:
    return w.number
