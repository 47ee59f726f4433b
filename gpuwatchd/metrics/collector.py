"""The Prometheus collector: the daemon's ``status`` object as ``gpuwatchd_*`` metric families.

Pure: no I/O. The collector is handed a callable returning the current ``status`` dict
(the shape ``gpuwatchctl --json status`` prints, docs/daemon-status.md) and the
:class:`DaemonCounters` the daemon feeds; the metric names and labels are listed in
docs/metrics.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

__all__ = [
    "GPU_LABELS",
    "TICK_DURATION_BUCKETS_S",
    "DaemonCounters",
    "StatusCollector",
    "StatusSource",
]

GPU_LABELS: Final = ("gpu", "uuid", "model_name", "hostname")
"""Labels of per-GPU metrics: dcgm-exporter's ``gpu``, ``UUID``, ``modelName``, ``Hostname``
in the snake_case ``promtool check metrics`` asks for (docs/metrics.md has the relabeling
that gives DCGM's spelling)."""

StatusSource = Callable[[], Mapping[str, Any] | None]
"""Returns the daemon's current ``status`` dict, or None when it cannot be had now."""

TICK_DURATION_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Upper bounds (seconds) of the tick duration histogram; a tick is ~0.5 ms with 8 GPUs."""

_FINAL_OUTCOMES: Final = frozenset(
    {"applied", "failed", "refused", "logged", "dry-run", "skipped", "superseded", "expired"}
)


class DaemonCounters:
    """Counts the ``status`` object cannot give: tick durations, decisions, worker crashes.

    Fed on the event loop (:meth:`observe_tick`, :meth:`worker_crashed`,
    :meth:`count_decisions`), read by the scrape thread; one lock guards both.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets = [0] * (len(TICK_DURATION_BUCKETS_S) + 1)
        self._tick_sum_s = 0.0
        self._decisions: dict[tuple[str, str, str], int] = {}
        self._counted: set[int] = set()
        self._crashes: dict[tuple[str, str], int] = {}

    def observe_tick(self, duration_s: float) -> None:
        """Add one tick of ``duration_s`` seconds to the histogram."""
        with self._lock:
            index = next(
                (i for i, le in enumerate(TICK_DURATION_BUCKETS_S) if duration_s <= le),
                len(TICK_DURATION_BUCKETS_S),
            )
            self._buckets[index] += 1
            self._tick_sum_s += duration_s

    def worker_crashed(self, job: str, kind: str) -> None:
        """Count one managed worker's crash of ``kind`` (crash.py's kinds) in ``job``."""
        with self._lock:
            self._crashes[(job, kind)] = self._crashes.get((job, kind), 0) + 1

    def count_decisions(self, decisions: Iterable[Mapping[str, Any]]) -> None:
        """Count the decisions (``status["decisions"]`` items) that reached an outcome.

        Each decision id is counted once; ids no longer in ``decisions`` are forgotten
        (the daemon keeps the most recent ones, so a burst larger than that between two
        scrapes is undercounted; the journal holds every decision).
        """
        with self._lock:
            seen: set[int] = set()
            for d in decisions:
                ident = d.get("id")
                if not isinstance(ident, int):
                    continue
                seen.add(ident)
                outcome = str(d.get("outcome"))
                if ident in self._counted or outcome not in _FINAL_OUTCOMES:
                    continue
                key = (str(d.get("policy")), str(d.get("action")), outcome)
                self._decisions[key] = self._decisions.get(key, 0) + 1
                self._counted.add(ident)
            self._counted &= seen

    def families(self) -> list[Metric]:
        """The counters as metric families (a consistent copy)."""
        with self._lock:
            buckets = list(self._buckets)
            total_s = self._tick_sum_s
            decisions = dict(self._decisions)
            crashes = dict(self._crashes)
        cumulative: list[tuple[str, float]] = []
        running = 0
        for le, count in zip((*TICK_DURATION_BUCKETS_S, float("inf")), buckets, strict=True):
            running += count
            cumulative.append(("+Inf" if le == float("inf") else repr(le), running))
        tick = HistogramMetricFamily(
            "gpuwatchd_tick_duration_seconds",
            "Time one tick took: sample, detect, decide, journal, act.",
        )
        tick.add_metric([], cumulative, sum_value=total_s)
        dec = CounterMetricFamily(
            "gpuwatchd_decisions",
            "Policy decisions that reached an outcome.",
            labels=["policy", "action", "outcome"],
        )
        for (policy, action, outcome), count in sorted(decisions.items()):
            dec.add_metric([policy, action, outcome], count)
        crash = CounterMetricFamily(
            "gpuwatchd_worker_crashes",
            "Managed worker crashes by job and crash kind.",
            labels=["job_name", "kind"],
        )
        for (job, kind), count in sorted(crashes.items()):
            crash.add_metric([job, kind], count)
        return [tick, dec, crash]


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class StatusCollector(Collector):
    """Yields the ``gpuwatchd_*`` families from ``source()`` and ``counters`` at each scrape.

    Per-job metrics label the job ``job_name`` (``job`` is Prometheus's target label).
    ``hostname``: the ``hostname`` label of GPU metrics (dcgm-exporter's ``Hostname``).
    A ``source()`` returning None yields only ``gpuwatchd_up 0`` and the counters.
    """

    def __init__(self, source: StatusSource, counters: DaemonCounters, hostname: str) -> None:
        self._source = source
        self._counters = counters
        self._hostname = hostname

    def describe(self) -> list[Metric]:
        """Nothing up front: the registry must not call :meth:`collect` at registration."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The metric families of one scrape."""
        status = self._source()
        up = GaugeMetricFamily("gpuwatchd_up", "1 when the daemon answered this scrape.")
        up.add_metric([], 0.0 if status is None else 1.0)
        yield up
        if status is not None:
            self._counters.count_decisions(status.get("decisions") or ())
            yield from self._daemon(status)
            yield from self._gpus(status)
            yield from self._host(status)
            yield from self._jobs(status)
            yield from self._managed(status)
            yield from self._findings(status)
        yield from self._counters.families()

    def _daemon(self, status: Mapping[str, Any]) -> Iterator[Metric]:
        for name, key, doc in (
            ("gpuwatchd_ticks_total", "ticks", "Ticks done since the daemon started."),
            ("gpuwatchd_failed_ticks_total", "failed_ticks", "Ticks that raised an error."),
        ):
            value = _num(status.get(key))
            if value is not None:
                family = CounterMetricFamily(name[: -len("_total")], doc)
                family.add_metric([], value)
                yield family
        start = _num(status.get("started_at_s"))
        if start is not None:
            yield GaugeMetricFamily(
                "gpuwatchd_start_time_seconds", "Unix time the daemon started.", value=start
            )
        yield GaugeMetricFamily(
            "gpuwatchd_remediation_paused",
            "1 while remediation is paused (gpuwatchctl pause).",
            value=1.0 if status.get("paused") else 0.0,
        )
        journal = status.get("journal") or {}
        failed = CounterMetricFamily(
            "gpuwatchd_journal_write_failures", "Journal writes that failed (disk full, I/O)."
        )
        failed.add_metric([], _num(journal.get("failed_writes")) or 0.0)
        yield failed
        xid = CounterMetricFamily(
            "gpuwatchd_xid_errors", "NVIDIA Xid errors seen in the kernel log.", labels=["xid"]
        )
        counts: dict[str, int] = {}
        for event in status.get("xid_events") or ():
            if isinstance(event, Mapping):
                code = str(event.get("xid", "unknown"))
                counts[code] = counts.get(code, 0) + 1
        for code, count in sorted(counts.items()):
            xid.add_metric([code], count)
        yield xid

    def _gpus(self, status: Mapping[str, Any]) -> Iterator[Metric]:
        labels = list(GPU_LABELS)
        util = GaugeMetricFamily(
            "gpuwatchd_gpu_utilization_ratio",
            "GPU utilization (NVML utilization.gpu) 0..1.",
            labels=labels,
        )
        used = GaugeMetricFamily(
            "gpuwatchd_gpu_memory_used_bytes", "GPU memory used (NVML memory.used).", labels=labels
        )
        total = GaugeMetricFamily(
            "gpuwatchd_gpu_memory_total_bytes",
            "GPU memory in all (NVML memory.total).",
            labels=labels,
        )
        power = GaugeMetricFamily(
            "gpuwatchd_gpu_power_draw_watts", "GPU power draw (NVML power.draw).", labels=labels
        )
        temp = GaugeMetricFamily(
            "gpuwatchd_gpu_temperature_celsius",
            "GPU temperature (NVML temperature.gpu).",
            labels=labels,
        )
        ok = GaugeMetricFamily(
            "gpuwatchd_gpu_sampled",
            "1 when the GPU's last sample succeeded, 0 when it failed.",
            labels=labels,
        )
        for gpu in status.get("gpus") or ():
            values = [
                str(gpu.get("index")),
                str(gpu.get("uuid")),
                str(gpu.get("name")),
                self._hostname,
            ]
            ok.add_metric(values, 0.0 if gpu.get("error") else 1.0)
            pct = _num(gpu.get("utilization_gpu_pct"))
            if pct is not None:
                util.add_metric(values, pct / 100.0)
            for family, key in (
                (used, "memory_used_bytes"),
                (total, "memory_total_bytes"),
                (power, "power_draw_w"),
                (temp, "temperature_gpu_c"),
            ):
                value = _num(gpu.get(key))
                if value is not None:
                    family.add_metric(values, value)
        yield from (util, used, total, power, temp, ok)

    def _host(self, status: Mapping[str, Any]) -> Iterator[Metric]:
        host = status.get("host")
        if not isinstance(host, Mapping):
            return
        cpu = _num(host.get("cpu_pct"))
        if cpu is not None:
            yield GaugeMetricFamily(
                "gpuwatchd_host_cpu_utilization_ratio",
                "Host CPU busy share 0..1 (all cores).",
                value=cpu / 100.0,
            )
        for name, key, doc in (
            ("gpuwatchd_host_cpus", "cpu_count", "Logical CPUs of the host."),
            ("gpuwatchd_host_memory_used_bytes", "memory_used_bytes", "Host memory in use."),
            ("gpuwatchd_host_memory_total_bytes", "memory_total_bytes", "Host memory in all."),
        ):
            value = _num(host.get(key))
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)

    def _jobs(self, status: Mapping[str, Any]) -> Iterator[Metric]:
        labels = ["job_name", "pid"]
        step = GaugeMetricFamily(
            "gpuwatchd_job_step_time_seconds",
            "Mean training step time the job reported.",
            labels=labels,
        )
        wait = GaugeMetricFamily(
            "gpuwatchd_job_data_wait_ratio",
            "Share of the step time the job waited for its DataLoader, 0..1.",
            labels=labels,
        )
        rate = GaugeMetricFamily(
            "gpuwatchd_job_samples_per_second",
            "Samples per second the job reported.",
            labels=labels,
        )
        knob = GaugeMetricFamily(
            "gpuwatchd_job_knob_value",
            "Current value of a knob the job declared (num_workers, prefetch_factor, ...).",
            labels=[*labels, "knob"],
        )
        attached = GaugeMetricFamily(
            "gpuwatchd_jobs_attached", "Jobs attached to the control socket now.", value=0.0
        )
        count = 0
        for job in status.get("jobs") or ():
            if not isinstance(job, Mapping):
                continue
            count += 1
            values = [str(job.get("name") or job.get("job")), str(job.get("pid"))]
            report = job.get("last_report") or job.get("report") or job
            if isinstance(report, Mapping):
                for family, keys in (
                    (step, ("step_time_s", "step_s")),
                    (wait, ("data_wait_fraction", "data_wait_ratio")),
                    (rate, ("samples_per_s", "samples_per_second")),
                ):
                    value = next(
                        (_num(report.get(k)) for k in keys if _num(report.get(k)) is not None), None
                    )
                    if value is not None:
                        family.add_metric(values, value)
            for name, value in _knob_values(job.get("knobs")):
                knob.add_metric([*values, name], value)
        attached.samples.clear()
        attached.add_metric([], float(count))
        yield from (attached, step, wait, rate, knob)

    def _managed(self, status: Mapping[str, Any]) -> Iterator[Metric]:
        parallelism = GaugeMetricFamily(
            "gpuwatchd_job_parallelism",
            "Workers a managed job should run now (the ladder).",
            labels=["job_name"],
        )
        workers = GaugeMetricFamily(
            "gpuwatchd_job_workers", "Managed worker slots by state.", labels=["job_name", "state"]
        )
        restarts = CounterMetricFamily(
            "gpuwatchd_job_worker_restarts",
            "Restarts of a managed job's workers.",
            labels=["job_name"],
        )
        for job in status.get("managed") or ():
            if not isinstance(job, Mapping):
                continue
            name = str(job.get("job"))
            value = _num(job.get("parallelism"))
            if value is not None:
                parallelism.add_metric([name], value)
            states: dict[str, int] = {}
            total_restarts = 0.0
            for w in job.get("workers") or ():
                if isinstance(w, Mapping):
                    state = str(w.get("state"))
                    states[state] = states.get(state, 0) + 1
                    total_restarts += _num(w.get("restarts")) or 0.0
            for state, n in sorted(states.items()):
                workers.add_metric([name, state], float(n))
            restarts.add_metric([name], total_restarts)
        yield from (parallelism, workers, restarts)

    def _findings(self, status: Mapping[str, Any]) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "gpuwatchd_finding_active",
            "1 per finding open now, by detector and subject (gpu:UUID, job:NAME, host).",
            labels=["detector", "subject"],
        )
        seen: set[tuple[str, str]] = set()
        for f in status.get("findings") or ():
            if isinstance(f, Mapping):
                key = (str(f.get("detector")), str(f.get("subject")))
                if key not in seen:
                    seen.add(key)
                    family.add_metric(list(key), 1.0)
        yield family


def _knob_values(knobs: Any) -> Iterator[tuple[str, float]]:
    """(name, value) of a job's knobs: ``{"name": value}`` or ``{"name": {"value": v, ...}}``."""
    if isinstance(knobs, Mapping):
        items: Iterable[tuple[Any, Any]] = knobs.items()
    elif isinstance(knobs, list):
        items = ((k.get("name"), k) for k in knobs if isinstance(k, Mapping))
    else:
        return
    for name, spec in items:
        value = spec.get("value") if isinstance(spec, Mapping) else spec
        number = _num(value)
        if number is not None:
            yield str(name), number
