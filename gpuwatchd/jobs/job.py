"""A managed job as the supervisor holds it: its settings, its workers, its restart history.

The :class:`Job` owns its :class:`~gpuwatchd.jobs.worker.Worker` s (by slot number); the
supervisor (:mod:`gpuwatchd.jobs.supervisor`) changes it on its event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatchd.config import JobConfig
from gpuwatchd.jobs.worker import Worker
from gpuwatchd.restart import RestartPolicy

__all__ = ["Job"]


@dataclass(slots=True)
class Job:
    """One managed job: its settings, its slots and its restart history."""

    cfg: JobConfig
    policy: RestartPolicy
    directory: Path
    allowed_gpus: tuple[int, ...] | None
    popen_user: dict[str, Any]
    user_env: dict[str, str]
    parallelism: int
    workers: dict[int, Worker] = field(default_factory=dict)
    restart_times_s: list[float] = field(default_factory=list)
    place_next: int | None = None
    launching: int = 0
    """Slots of this job being started now (a process may run before its pid is known)."""
    hooked: bool = False
    """Whether a worker of this job spoke to the daemon through the hook in this daemon's
    run (then a launch without progress is stalled, however long it ran)."""
    fingerprint: str = ""
    """The job configuration's digest (:func:`gpuwatchd.jobs.workers_file.fingerprint`):
    held slots recorded under another configuration are started again."""
