"""What one scrape reads: the daemon's state at one instant, as immutable values.

The daemon takes a :class:`MetricsView` on its event loop (references to its frozen
snapshot and findings, copies of its counts: microseconds), and the collector turns it
into metric families in the scrape's thread. Pure data, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatchd.metrics.account import AccountCopy
from gpuwatchd.model import Finding, JobInfo, Snapshot

__all__ = ["ManagedJobView", "MetricsView"]


@dataclass(frozen=True, slots=True)
class ManagedJobView:
    """A managed job (``jobs:`` of the config): its ladder and its worker slots.

    ``parallelism``: the ladder's position (workers the policies want now), between
    ``min_workers`` and ``max_workers`` (the job's ``workers:``). ``workers``: slots per
    supervisor state (``running``, ``backoff``, ...). ``restarts``: starts after the
    first, summed over the slots.
    """

    job: str
    parallelism: int
    min_workers: int
    max_workers: int
    workers: Mapping[str, int]
    restarts: int
    study: str | None = None


@dataclass(frozen=True, slots=True)
class MetricsView:
    """The daemon's state for one scrape (docs/metrics.md lists what each field becomes).

    ``snapshot``: the last tick's (GPUs, host, attached jobs with their last reports);
    None before the first tick. ``jobs``: the attached jobs now. ``findings``: the open
    findings. ``xid_totals``: (GPU index, GPU UUID, Xid) -> Xid errors since the start.
    ``journal_failed_writes``: journal writes that failed since the start.
    ``process_slurm``: GPU process pid -> the Slurm job id it runs in (the snapshot's
    :attr:`~gpuwatchd.model.Snapshot.process_slurm`, which ``status`` shows: attached
    jobs' hellos, else its environment and cgroup path), for pids with one.
    """

    version: str
    started_at_s: float
    ticks: int
    failed_ticks: int
    paused: bool
    snapshot: Snapshot | None
    jobs: tuple[JobInfo, ...]
    findings: tuple[Finding, ...]
    managed: tuple[ManagedJobView, ...]
    journal_failed_writes: int
    xid_totals: Mapping[tuple[int, str, int], int]
    account: AccountCopy
    process_slurm: Mapping[int, str] = field(default_factory=dict)
