"""Time-based ring buffers of recent metric samples, one per (subject, metric) (pure).

Specification: docs/modules.md#gpuwatchdwindows
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from typing import Final, Literal

from gpuwatchd.model import (
    NA,
    GpuSample,
    HostSample,
    JobEvent,
    JobInfo,
    ManagedJobState,
    MaybeFloat,
    SlurmJob,
    Snapshot,
)
from gpuwatchd.xid import XidEvent

__all__ = [
    "DEFAULT_JOB_REPORT_STALE_S",
    "DEFAULT_MAX_SAMPLES",
    "GPU_METRICS",
    "HOST_METRICS",
    "JOB_METRICS",
    "ByMetric",
    "MetricKey",
    "Scope",
    "Window",
    "Windows",
]

Scope = Literal["gpu", "host", "job"]
MetricKey = tuple[Scope, str]
"""``(scope, metric)``, e.g. ``("gpu", "utilization_gpu_pct")`` or ``("host", "cpu_pct")``."""

DEFAULT_MAX_SAMPLES: Final = 4096
"""Samples kept per window at most: an hour of 1 s ticks, 6.8 min of a 100 ms trace."""
DEFAULT_JOB_REPORT_STALE_S: Final = 30.0
"""A job report unchanged for this long (snapshot time) stops counting as a sample."""

_NAN: Final = math.nan


def _na_or_float(value: object) -> float | None:
    if value is NA or value is None:
        return None
    return float(value)  # type: ignore[arg-type]


def _gpu_util(g: GpuSample) -> float | None:
    return None if g.utilization_gpu_pct is NA else float(g.utilization_gpu_pct)


def _gpu_mem_pct(g: GpuSample) -> float | None:
    # GpuSample.memory_used_pct, inlined: this runs for every GPU on every tick
    used, total = g.memory_used_bytes, g.memory_total_bytes
    if used is NA or total is NA or total <= 0:
        return None
    return 100.0 * used / total


def _gpu_mem_bytes(g: GpuSample) -> float | None:
    return None if g.memory_used_bytes is NA else float(g.memory_used_bytes)


def _gpu_processes(g: GpuSample) -> float | None:
    return None if g.error is not None else float(len(g.processes))


def _host_cpu(h: HostSample) -> float | None:
    return float(h.cpu_pct)


def _host_mem_pct(h: HostSample) -> float | None:
    return h.memory_used_pct if h.memory_total_bytes > 0 else None


def _gpu_sm_active(g: GpuSample) -> float | None:
    return None if g.sm_active_pct is NA else float(g.sm_active_pct)


def _gpu_busy_auto(g: GpuSample) -> float | None:
    """``sm_active_pct`` where the GPU reports it (GPM), else ``utilization.gpu``."""
    if g.sm_active_pct is not NA:
        return float(g.sm_active_pct)
    return None if g.utilization_gpu_pct is NA else float(g.utilization_gpu_pct)


GPU_METRICS: Final[Mapping[str, Callable[[GpuSample], float | None]]] = {
    "utilization_gpu_pct": _gpu_util,
    "sm_active_pct": _gpu_sm_active,
    "busy_auto_pct": _gpu_busy_auto,
    "memory_used_pct": _gpu_mem_pct,
    "memory_used_bytes": _gpu_mem_bytes,
    "compute_processes": _gpu_processes,
}
"""GPU metrics a window can hold, each with its extractor (None = NA = gap)."""

HOST_METRICS: Final[Mapping[str, Callable[[HostSample], float | None]]] = {
    "cpu_pct": _host_cpu,
    "memory_used_pct": _host_mem_pct,
}
"""Host metrics a window can hold, each with its extractor."""

JOB_METRICS: Final[tuple[str, ...]] = ("data_wait_fraction", "samples_per_s")
"""Job metrics a window can hold: fields of :class:`~gpuwatchd.model.JobReport`."""


class Window:
    """Samples ``(t, value)`` of one metric of one subject over the last ``horizon_s`` seconds.

    ``value`` None is a gap (NA). Times must not decrease; an older time clears the
    window first. ``last_t``/``last_value`` are the newest sample (None when empty).
    At most ``max_samples`` samples are kept (the oldest go first).
    """

    __slots__ = (
        "_base_n",
        "_base_sum",
        "_cum_n",
        "_cum_sum",
        "_head",
        "_n",
        "_sum",
        "_t",
        "_v",
        "horizon_s",
        "last_t",
        "last_value",
        "max_samples",
    )

    def __init__(self, horizon_s: float, max_samples: int = DEFAULT_MAX_SAMPLES) -> None:
        if horizon_s < 0:
            raise ValueError(f"horizon_s must be >= 0, got {horizon_s}")
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.horizon_s = float(horizon_s)
        self.max_samples = int(max_samples)
        self.clear()

    def clear(self) -> None:
        """Forget every sample."""
        self._t = array("d")
        self._v = array("d")  # NaN marks a gap
        self._cum_sum = array("d")  # running sum of valid values up to and including i
        self._cum_n = array("d")  # running count of valid values up to and including i
        self._head = 0  # index of the oldest retained sample
        self._base_sum = 0.0  # running sums just before index 0 (after a compaction)
        self._base_n = 0.0
        self._sum = 0.0
        self._n = 0.0
        self.last_t: float | None = None
        self.last_value: float | None = None

    def append(self, t: float, value: float | None) -> None:
        """Add the sample ``value`` (None = gap) at time ``t`` seconds; evict old samples."""
        times = self._t
        if self.last_t is not None and t < self.last_t:
            self.clear()
            times = self._t
        times.append(t)
        if value is None:
            self._v.append(_NAN)
        else:
            self._v.append(value)
            self._sum += value
            self._n += 1.0
        self._cum_sum.append(self._sum)
        self._cum_n.append(self._n)
        self.last_t = t
        self.last_value = value
        head = self._head
        limit = t - self.horizon_s
        while times[head] < limit:  # stops at the newest sample at the latest (t >= limit)
            head += 1
        size = len(times)
        if size - head > self.max_samples:
            head = size - self.max_samples
        if head != self._head:
            self._head = head
            if head >= 256 and 2 * head >= size:
                self._compact()

    def _compact(self) -> None:
        # Drop the evicted prefix and rebase the running sums on it, so their magnitude
        # (and the rounding error of mean_since) stays that of one window, however long
        # the daemon runs. O(n), done when half the buffer is evicted: O(1) amortised.
        head = self._head
        base_sum = self._cum_sum[head - 1]
        base_n = self._cum_n[head - 1]
        del self._t[:head]
        del self._v[:head]
        self._cum_sum = array("d", [c - base_sum for c in self._cum_sum[head:]])
        self._cum_n = array("d", [c - base_n for c in self._cum_n[head:]])
        self._sum -= base_sum
        self._n -= base_n
        self._base_sum = self._base_n = 0.0
        self._head = 0

    def __len__(self) -> int:
        return len(self._t) - self._head

    @property
    def first_t(self) -> float | None:
        """Time of the oldest retained sample, or None when empty."""
        return self._t[self._head] if len(self._t) > self._head else None

    def samples(self) -> list[tuple[float, MaybeFloat]]:
        """Return the retained samples oldest first as ``(t, value)``; a gap's value is NA."""
        out: list[tuple[float, MaybeFloat]] = []
        for i in range(self._head, len(self._t)):
            v = self._v[i]
            out.append((self._t[i], NA if math.isnan(v) else v))
        return out

    def _prefix(self, i: int) -> tuple[float, float]:
        if i > 0:
            return self._cum_sum[i - 1], self._cum_n[i - 1]
        return self._base_sum, self._base_n

    def mean_since(self, t0: float) -> float | None:
        """Mean of the valid samples with time >= ``t0``; None when there is none. O(log n)."""
        size = len(self._t)
        i = bisect_left(self._t, t0, self._head, size)
        if i >= size:
            return None
        before_sum, before_n = self._prefix(i)
        n = self._cum_n[-1] - before_n
        if n <= 0:
            return None
        return (self._cum_sum[-1] - before_sum) / n

    def count_since(self, t0: float) -> tuple[int, int]:
        """Return ``(samples, gaps)`` with time >= ``t0``. O(log n)."""
        size = len(self._t)
        i = bisect_left(self._t, t0, self._head, size)
        if i >= size:
            return 0, 0
        valid = int(self._cum_n[-1] - self._prefix(i)[1])
        return size - i, (size - i) - valid


ByMetric = dict[str, Window]
"""The windows of one subject, by metric name."""


class Windows:
    """All windows of the subjects in the latest snapshot.

    ``needs`` maps each :data:`MetricKey` to keep to its horizon in seconds (the
    longest ``for:`` of the detectors that read it). After :meth:`observe`, ``now`` is
    the snapshot's time and the subjects of that snapshot are listed, each with its
    windows by metric (so readers need no further lookup):

    * ``gpus``: ``(subject, by_metric, uuid, index)`` per GPU;
    * ``jobs``: ``(subject, by_metric, name)`` per attached job;
    * ``hosts``: ``(("host", by_metric),)`` when the snapshot had a host sample, else ``()``;
    * ``events``: the snapshot's :class:`~gpuwatchd.model.JobEvent` objects, in order;
    * ``samples``: the snapshot's :class:`~gpuwatchd.model.GpuSample` objects as they are;
    * ``attached``: the snapshot's attached jobs (:class:`~gpuwatchd.model.JobInfo`) as
      they are, and ``process_slurm`` the Slurm job of each GPU process;
    * ``xids``: the snapshot's Xid errors.

    Raises ValueError for an unknown metric.
    """

    def __init__(
        self,
        needs: Mapping[MetricKey, float] | None = None,
        *,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        job_report_stale_s: float = DEFAULT_JOB_REPORT_STALE_S,
    ) -> None:
        self.max_samples = max_samples
        self.job_report_stale_s = job_report_stale_s
        self._w: dict[str, ByMetric] = {}
        self._gpu_subject: dict[str, str] = {}
        self._report_seen: dict[str, tuple[float, float]] = {}  # job -> (report ts, first seen)
        self.now: float | None = None
        self.gpus: tuple[tuple[str, ByMetric, str, int], ...] = ()
        self.jobs: tuple[tuple[str, ByMetric, str], ...] = ()
        self.hosts: tuple[tuple[str, ByMetric], ...] = ()
        self.events: tuple[JobEvent, ...] = ()
        self.managed: tuple[ManagedJobState, ...] = ()
        self.samples: tuple[GpuSample, ...] = ()
        """The snapshot's GPU samples as they are (the fault detectors read their health)."""
        self.xids: tuple[XidEvent, ...] = ()
        """The snapshot's Xid errors (:attr:`~gpuwatchd.model.Snapshot.xids`)."""
        self.attached: tuple[JobInfo, ...] = ()
        """The snapshot's attached jobs as they are (``allocated_but_idle`` reads their
        Slurm allocation)."""
        self.process_slurm: tuple[tuple[int, SlurmJob], ...] = ()
        """The snapshot's :attr:`~gpuwatchd.model.Snapshot.process_slurm`."""
        self._gpu_needs: tuple[tuple[str, Callable[[GpuSample], float | None], float], ...] = ()
        self._host_needs: tuple[tuple[str, Callable[[HostSample], float | None], float], ...] = ()
        self._job_needs: tuple[tuple[str, float], ...] = ()
        self.configure(needs or {})

    def configure(self, needs: Mapping[MetricKey, float]) -> None:
        """Set which metrics to keep and their horizons; keeps the history of kept metrics."""
        gpu, host, job = [], [], []
        for (scope, metric), horizon_s in sorted(needs.items()):
            if scope == "gpu" and metric in GPU_METRICS:
                gpu.append((metric, GPU_METRICS[metric], float(horizon_s)))
            elif scope == "host" and metric in HOST_METRICS:
                host.append((metric, HOST_METRICS[metric], float(horizon_s)))
            elif scope == "job" and metric in JOB_METRICS:
                job.append((metric, float(horizon_s)))
            else:
                raise ValueError(f"unknown metric {metric!r} for scope {scope!r}")
        self._gpu_needs, self._host_needs, self._job_needs = tuple(gpu), tuple(host), tuple(job)
        keep = {
            "gpu": {m: h for m, _, h in gpu},
            "host": {m: h for m, _, h in host},
            "job": dict(job),
        }
        for subject, by_metric in self._w.items():
            wanted = keep[_scope_of(subject)]
            for metric in [m for m in by_metric if m not in wanted]:
                del by_metric[metric]
            for metric, window in by_metric.items():
                window.horizon_s = wanted[metric]

    @property
    def needs(self) -> dict[MetricKey, float]:
        """The metrics kept and their horizons in seconds."""
        out: dict[MetricKey, float] = {}
        for m, _, h in self._gpu_needs:
            out["gpu", m] = h
        for m, _, h in self._host_needs:
            out["host", m] = h
        for m, h in self._job_needs:
            out["job", m] = h
        return out

    @property
    def host(self) -> bool:
        """Whether the latest snapshot had a host sample (and host metrics are kept)."""
        return bool(self.hosts)

    def clear(self) -> None:
        """Forget every sample and subject (the clock stepped back, or a reset)."""
        self._w.clear()
        self._report_seen.clear()
        self.now = None
        self.gpus, self.jobs, self.hosts = (), (), ()
        self.events = ()
        self.managed = ()
        self.samples = ()
        self.xids = ()
        self.attached = ()
        self.process_slurm = ()

    def get(self, subject: str, metric: str) -> Window | None:
        """Return the window of ``metric`` of ``subject``, or None if not kept."""
        by_metric = self._w.get(subject)
        return None if by_metric is None else by_metric.get(metric)

    def subjects(self) -> tuple[str, ...]:
        """The subjects of the latest snapshot that have windows."""
        return tuple(self._w)

    def _windows_of(self, subject: str, metrics: Iterable[tuple[str, float]]) -> ByMetric:
        by_metric = self._w.get(subject)
        if by_metric is None:
            by_metric = self._w[subject] = {}
        for metric, horizon_s in metrics:
            if metric not in by_metric:
                by_metric[metric] = Window(horizon_s, self.max_samples)
        return by_metric

    def observe(self, snapshot: Snapshot) -> None:
        """Append one sample per kept metric of every subject in ``snapshot``.

        Time is ``snapshot.timestamp_s``. NA values and stale job reports become gaps;
        subjects absent from ``snapshot`` are dropped; :attr:`events` becomes the
        snapshot's events.
        """
        now = snapshot.timestamp_s
        if self.now is not None and now < self.now:
            self.clear()
        self.now = now
        self.events = snapshot.events
        self.managed = snapshot.managed
        self.samples = snapshot.gpus
        self.xids = snapshot.xids
        self.attached = snapshot.jobs
        self.process_slurm = snapshot.process_slurm
        w = self._w
        count = 0
        gpus: list[tuple[str, ByMetric, str, int]] = []
        gpu_needs = self._gpu_needs
        if gpu_needs:
            names = self._gpu_subject
            for g in snapshot.gpus:
                subject = names.get(g.uuid)
                if subject is None:
                    if len(names) > 1024:
                        names.clear()
                    subject = names[g.uuid] = "gpu:" + g.uuid
                by_metric = w.get(subject)
                if by_metric is None or len(by_metric) != len(gpu_needs):
                    by_metric = self._windows_of(subject, ((m, h) for m, _, h in gpu_needs))
                for metric, extract, _ in gpu_needs:
                    by_metric[metric].append(now, extract(g))
                gpus.append((subject, by_metric, g.uuid, g.index))
            count += len(gpus)
        self.gpus = tuple(gpus)
        host = snapshot.host
        if self._host_needs and host is not None:
            by_metric = self._windows_of("host", ((m, h) for m, _, h in self._host_needs))
            for metric, extract_host, _ in self._host_needs:
                by_metric[metric].append(now, extract_host(host))
            self.hosts = (("host", by_metric),)
            count += 1
        else:
            self.hosts = ()
        jobs: list[tuple[str, ByMetric, str]] = []
        if self._job_needs:
            for job in snapshot.jobs:
                subject = "job:" + job.name
                by_metric = self._windows_of(subject, self._job_needs)
                report = self._fresh_report(job, now)
                for metric, _ in self._job_needs:
                    value = None if report is None else _na_or_float(getattr(report, metric))
                    by_metric[metric].append(now, value)
                jobs.append((subject, by_metric, job.name))
            count += len(jobs)
        self.jobs = tuple(jobs)
        if len(w) != count:
            self._drop_absent(now)

    def _drop_absent(self, now: float) -> None:
        for subject in list(self._w):
            by_metric = self._w[subject]
            if not by_metric or next(iter(by_metric.values())).last_t != now:
                del self._w[subject]
        for name in [n for n in self._report_seen if "job:" + n not in self._w]:
            del self._report_seen[name]

    def _fresh_report(self, job: JobInfo, now: float) -> object | None:
        report = job.last_report
        if report is None:
            return None
        seen = self._report_seen.get(job.name)
        if seen is None or seen[0] != report.timestamp_s:
            self._report_seen[job.name] = (report.timestamp_s, now)
            return report
        if now - seen[1] > self.job_report_stale_s:
            return None
        return report


def _scope_of(subject: str) -> Scope:
    if subject.startswith("gpu:"):
        return "gpu"
    if subject.startswith("job:"):
        return "job"
    return "host"
