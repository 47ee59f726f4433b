"""The Prometheus collector: a :class:`~gpuwatchd.metrics.view.MetricsView` as ``gpuwatchd_*``
metric families.

Pure: no I/O. The collector is handed a callable returning the daemon's current view
(None when the daemon cannot give one now); docs/metrics.md lists the metric names and
labels, in base units, named as the Prometheus naming guide says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gpuwatchd.metrics.account import OTHER, TICK_DURATION_BUCKETS_S
from gpuwatchd.metrics.view import MetricsView
from gpuwatchd.model import GpuSample, KnobValue

__all__ = [
    "GPU_LABELS",
    "JOB_LABELS",
    "SLURM_JOB_IDS_MAX",
    "DaemonCollector",
    "ViewSource",
    "slurm_job_labels",
]

GPU_LABELS: Final = ("gpu", "UUID", "model_name", "Hostname")
"""Labels of per-GPU metrics (``gpu``: the NVML index): dcgm-exporter's, so that gpuwatchd's
series join DCGM's ``on(UUID)`` or ``on(Hostname, gpu)``, except that the model is
``model_name`` (promtool check metrics lints camelCase ``modelName``); the shipped scrape
job contrib/prometheus/scrape.yml renames it to dcgm-exporter's ``modelName`` on ingest."""

JOB_LABELS: Final = ("job_name", "pid", "slurm_job_id")
"""Labels of per-job metrics (``job`` is Prometheus's own target label; ``slurm_job_id``:
``SLURM_JOB_ID``, empty outside Slurm, see :data:`SLURM_JOB_IDS_MAX`)."""

SLURM_JOB_IDS_MAX: Final = 256
"""Distinct ``slurm_job_id`` values one scrape carries at most: the lowest job ids keep
theirs, the rest are :data:`~gpuwatchd.metrics.account.OTHER` and counted in
``gpuwatchd_slurm_job_ids_over_cap`` (a node runs a few jobs at once; a hello claims any id,
so a flood of made-up ids cannot grow the series without bound)."""

ViewSource = Callable[[], MetricsView | None]
"""Returns the daemon's current view, or None when it cannot be had now."""


_GPM_METRICS: Final = (
    ("sm_active", "Share of SMs busy", "SM_UTIL", "DCGM_FI_PROF_SM_ACTIVE"),
    ("sm_occupancy", "Resident warps against the maximum", "SM_OCCUPANCY",
     "DCGM_FI_PROF_SM_OCCUPANCY"),
    ("tensor_active", "Time tensor cores were busy", "ANY_TENSOR_UTIL",
     "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"),
    ("dram_active", "Memory bandwidth used", "DRAM_BW_UTIL", "DCGM_FI_PROF_DRAM_ACTIVE"),
)  # fmt: skip
"""``gpuwatchd_gpu_<name>_ratio`` from ``GpuSample.<name>_pct`` / 100: (name, what, NVML
GPM metric, dcgm-exporter field). dcgm-exporter exports these as ratios too."""

_HEALTH_METRICS: Final = (
    ("ecc_sbe_volatile_total", "Single-bit ECC errors since the driver loaded",
     "NVML_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"),
    ("ecc_dbe_volatile_total", "Double-bit ECC errors since the driver loaded",
     "NVML_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"),
    ("remapped_rows_correctable", "Rows remapped for correctable errors",
     "NVML_FI_DEV_REMAPPED_COR", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"),
    ("remapped_rows_uncorrectable", "Rows remapped for uncorrectable errors",
     "NVML_FI_DEV_REMAPPED_UNC", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"),
    ("row_remap_pending", "1 when a row remap waits for a GPU reset",
     "NVML_FI_DEV_REMAPPED_PENDING", "DCGM_FI_DEV_ROW_REMAP_PENDING"),
    ("row_remap_failure", "1 when a row remap failed (the GPU needs service)",
     "NVML_FI_DEV_REMAPPED_FAILURE", "DCGM_FI_DEV_ROW_REMAP_FAILURE"),
    ("clocks_event_reasons", "Clock event (throttle) reasons, nvmlClocksEventReason* bit mask",
     "nvmlDeviceGetCurrentClocksEventReasons", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"),
)  # fmt: skip
"""``gpuwatchd_gpu_<name>`` gauges from :class:`~gpuwatchd.model.GpuHealth`: (name, what,
NVML source, dcgm-exporter field)."""


def _num(value: object) -> float | None:
    """``value`` as a float when it is a number (not NA, not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def slurm_job_labels(view: MetricsView) -> tuple[dict[str, str], int]:
    """The ``slurm_job_id`` label value of each Slurm job id of ``view`` (its attached
    jobs and GPU processes): itself for the :data:`SLURM_JOB_IDS_MAX` lowest ids,
    :data:`~gpuwatchd.metrics.account.OTHER` for the rest; and how many ids got
    ``OTHER``."""
    ids = {job.slurm.job_id for job in view.jobs if job.slurm is not None}
    ids.update(view.process_slurm.values())
    ordered = sorted(ids, key=lambda i: (len(i), i))  # decimal: by length, then digits
    kept = {i: i for i in ordered[:SLURM_JOB_IDS_MAX]}
    kept.update((i, OTHER) for i in ordered[SLURM_JOB_IDS_MAX:])
    return kept, max(0, len(ordered) - SLURM_JOB_IDS_MAX)


def _knob(value: KnobValue) -> float:
    """A knob's value as a sample: numbers as they are, booleans as 1/0."""
    return float(value)


class DaemonCollector(Collector):
    """Yields the ``gpuwatchd_*`` families of ``source()`` at each scrape.

    ``hostname``: the ``Hostname`` label of GPU metrics (dcgm-exporter's). A ``source()``
    returning None (the event loop did not answer in time) yields ``gpuwatchd_up 0``
    only, so Prometheus keeps scraping and the series of the last good scrape go stale.
    """

    def __init__(self, source: ViewSource, hostname: str) -> None:
        self._source = source
        self._hostname = hostname

    def describe(self) -> list[Metric]:
        """Nothing up front: the registry must not call :meth:`collect` at registration."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The metric families of one scrape."""
        view = self._source()
        yield GaugeMetricFamily(
            "gpuwatchd_up",
            "1 when the daemon's event loop answered this scrape in time.",
            value=0.0 if view is None else 1.0,
        )
        if view is None:
            return
        slurm_ids, over_cap = slurm_job_labels(view)
        yield from self._daemon(view)
        yield from self._gpus(view, slurm_ids)
        yield from self._host(view)
        yield from self._jobs(view, slurm_ids)
        yield GaugeMetricFamily(
            "gpuwatchd_slurm_job_ids_over_cap",
            f"Slurm job ids of this scrape past the first {SLURM_JOB_IDS_MAX}, labelled "
            f"slurm_job_id={OTHER!r}.",
            value=over_cap,
        )
        yield from self._managed(view)
        yield from self._events(view)

    # -- the daemon itself ---------------------------------------------------------------

    def _daemon(self, view: MetricsView) -> Iterator[Metric]:
        info = InfoMetricFamily("gpuwatchd_build", "The gpuwatchd version running.")
        info.add_metric([], {"version": view.version})
        yield info
        yield GaugeMetricFamily(
            "gpuwatchd_start_time_seconds",
            "Unix time the daemon started.",
            value=view.started_at_s,
        )
        yield CounterMetricFamily(
            "gpuwatchd_ticks", "Ticks done since the daemon started.", value=view.ticks
        )
        yield CounterMetricFamily(
            "gpuwatchd_failed_ticks", "Ticks that raised an error.", value=view.failed_ticks
        )
        account = view.account
        tick = HistogramMetricFamily(
            "gpuwatchd_tick_duration_seconds",
            "Time one tick took: sample, detect, decide, journal, act.",
        )
        cumulative: list[tuple[str, float]] = []
        running = 0
        for le, count in zip(
            (*TICK_DURATION_BUCKETS_S, float("inf")), account.tick_buckets, strict=True
        ):
            running += count
            cumulative.append(("+Inf" if le == float("inf") else repr(le), running))
        tick.add_metric([], cumulative, sum_value=account.tick_sum_s)
        yield tick
        yield GaugeMetricFamily(
            "gpuwatchd_remediation_paused",
            "1 while remediation is paused (gpuwatchctl pause); detection goes on.",
            value=1.0 if view.paused else 0.0,
        )
        yield CounterMetricFamily(
            "gpuwatchd_journal_write_failures",
            "Journal writes that failed (disk full, read-only, I/O error).",
            value=view.journal_failed_writes,
        )

    # -- GPUs and host -------------------------------------------------------------------

    def _gpu_labels(self, gpu: GpuSample) -> list[str]:
        return [str(gpu.index), gpu.uuid, gpu.name, self._hostname]

    def _gpus(self, view: MetricsView, slurm_ids: Mapping[str, str]) -> Iterator[Metric]:
        labels = list(GPU_LABELS)
        util = GaugeMetricFamily(
            "gpuwatchd_gpu_utilization_ratio",
            "GPU utilization, NVML utilization.gpu as a ratio 0..1.",
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
            "1 when the GPU's last sample succeeded, 0 while NVML fails for it.",
            labels=labels,
        )
        ratios = {
            name: GaugeMetricFamily(
                f"gpuwatchd_gpu_{name}_ratio",
                f"{what}, ratio 0..1 (NVML GPM {metric}; dcgm-exporter {dcgm}).",
                labels=labels,
            )
            for name, what, metric, dcgm in _GPM_METRICS
        }
        health = {
            name: GaugeMetricFamily(
                f"gpuwatchd_gpu_{name}", f"{what} ({source}; dcgm-exporter {dcgm}).", labels=labels
            )
            for name, what, source, dcgm in _HEALTH_METRICS
        }
        stale = GaugeMetricFamily(
            "gpuwatchd_gpu_stale",
            "1 while an NVML call on the GPU is past its deadline (values are the last read).",
            labels=labels,
        )
        proc_sm = GaugeMetricFamily(
            "gpuwatchd_gpu_process_sm_active_ratio",
            "A process's share of the GPU's SM time, ratio 0..1 (NVML "
            "nvmlDeviceGetProcessUtilization smUtil).",
            labels=[*labels, "pid", "slurm_job_id"],
        )
        mig_used = GaugeMetricFamily(
            "gpuwatchd_gpu_mig_memory_used_bytes",
            "Memory used in a MIG instance (NVML nvmlDeviceGetMemoryInfo of the MIG device).",
            labels=[*labels, "mig_uuid", "gpu_instance_id"],
        )
        mig_total = GaugeMetricFamily(
            "gpuwatchd_gpu_mig_memory_total_bytes",
            "Memory of a MIG instance in all.",
            labels=[*labels, "mig_uuid", "gpu_instance_id"],
        )
        snap = view.snapshot
        by_index: dict[int, list[str]] = {}
        for gpu in snap.gpus if snap is not None else ():
            values = by_index[gpu.index] = self._gpu_labels(gpu)
            ok.add_metric(values, 0.0 if gpu.error else 1.0)
            pct = _num(gpu.utilization_gpu_pct)
            if pct is not None:
                util.add_metric(values, pct / 100.0)
            for family, value in (
                (used, gpu.memory_used_bytes),
                (total, gpu.memory_total_bytes),
                (power, gpu.power_draw_w),
                (temp, gpu.temperature_gpu_c),
            ):
                number = _num(value)
                if number is not None:
                    family.add_metric(values, number)
            stale.add_metric(values, 0.0 if gpu.stale is None else 1.0)
            for name, ratio in ratios.items():
                number = _num(getattr(gpu, f"{name}_pct"))
                if number is not None:
                    ratio.add_metric(values, number / 100.0)
            for name, family in health.items():
                number = _num(getattr(gpu.health, name))
                if number is not None:
                    family.add_metric(values, number)
            for proc in gpu.processes:
                number = _num(proc.sm_util_pct)
                if number is not None:
                    slurm = slurm_ids.get(view.process_slurm.get(proc.pid, ""), "")
                    proc_sm.add_metric([*values, str(proc.pid), slurm], number / 100.0)
            for mig in gpu.mig_devices:
                mig_labels = [*values, mig.uuid, str(mig.gpu_instance_id)]
                for family, value in ((mig_used, mig.memory_used_bytes),
                                      (mig_total, mig.memory_total_bytes)):  # fmt: skip
                    number = _num(value)
                    if number is not None:
                        family.add_metric(mig_labels, number)
        xid = CounterMetricFamily(
            "gpuwatchd_xid_errors",
            "NVIDIA Xid errors NVML reported since the daemon started, by GPU and Xid.",
            labels=[*labels, "xid"],
        )
        for (index, uuid, code), count in sorted(view.xid_totals.items()):
            values = by_index.get(index) or [str(index), uuid, "", self._hostname]
            xid.add_metric([*values, str(code)], count)
        yield from (util, used, total, power, temp, ok, xid, stale)
        yield from ratios.values()
        yield from health.values()
        yield from (proc_sm, mig_used, mig_total)

    def _host(self, view: MetricsView) -> Iterator[Metric]:
        host = view.snapshot.host if view.snapshot is not None else None
        if host is None:
            return
        yield GaugeMetricFamily(
            "gpuwatchd_host_cpu_utilization_ratio",
            "Host CPU busy share 0..1 over all logical CPUs.",
            value=host.cpu_pct / 100.0,
        )
        yield GaugeMetricFamily("gpuwatchd_host_cpus", "Logical CPUs.", value=host.cpu_count)
        yield GaugeMetricFamily(
            "gpuwatchd_host_memory_used_bytes", "Host memory in use.", value=host.memory_used_bytes
        )
        yield GaugeMetricFamily(
            "gpuwatchd_host_memory_total_bytes",
            "Host memory in all.",
            value=host.memory_total_bytes,
        )

    # -- jobs ----------------------------------------------------------------------------

    def _jobs(self, view: MetricsView, slurm_ids: Mapping[str, str]) -> Iterator[Metric]:
        labels = list(JOB_LABELS)
        step = GaugeMetricFamily(
            "gpuwatchd_job_step_time_seconds",
            "Mean training step time over the job's last report, data wait included.",
            labels=labels,
        )
        wait = GaugeMetricFamily(
            "gpuwatchd_job_data_wait_ratio",
            "Share of the step time the job waited for its DataLoader, 0..1.",
            labels=labels,
        )
        rate = GaugeMetricFamily(
            "gpuwatchd_job_samples_per_second",
            "Training samples per second over the job's last report.",
            labels=labels,
        )
        knob = GaugeMetricFamily(
            "gpuwatchd_job_knob_value",
            "Current value of each knob the job declared (num_workers, ...; booleans 1/0).",
            labels=[*labels, "knob"],
        )
        running: dict[tuple[str, str], int] = {}
        for job in view.jobs:
            slurm = "" if job.slurm is None else slurm_ids.get(job.slurm.job_id, OTHER)
            values = [job.name, str(job.pid), slurm]
            report = job.last_report
            if report is not None:
                step.add_metric(values, report.step_time_s)
                wait.add_metric(values, report.data_wait_fraction)
                rate.add_metric(values, report.samples_per_s)
            for name, spec in job.knobs.items():
                knob.add_metric([*values, name], _knob(spec.value))
            if job.study is not None and job.trial_number is not None:
                key = (job.name, job.study)
                running[key] = running.get(key, 0) + 1
        yield GaugeMetricFamily(
            "gpuwatchd_jobs_attached",
            "Jobs attached to the control socket now.",
            value=len(view.jobs),
        )
        yield from (step, wait, rate, knob)
        trials = GaugeMetricFamily(
            "gpuwatchd_study_trials_running",
            "Optuna trials the attached jobs run now, by job and study.",
            labels=["job_name", "study"],
        )
        for (name, study), n in sorted(running.items()):
            trials.add_metric([name, study], n)
        yield trials

    def _managed(self, view: MetricsView) -> Iterator[Metric]:
        label = ["job_name"]
        now = GaugeMetricFamily(
            "gpuwatchd_job_parallelism",
            "Workers the ladder runs a managed job with now.",
            labels=label,
        )
        low = GaugeMetricFamily(
            "gpuwatchd_job_parallelism_min",
            "The ladder's floor (min_workers).",
            labels=label,
        )
        high = GaugeMetricFamily(
            "gpuwatchd_job_parallelism_max", "The ladder's ceiling (workers).", labels=label
        )
        slots = GaugeMetricFamily(
            "gpuwatchd_job_workers",
            "A managed job's worker slots by supervisor state.",
            labels=["job_name", "state"],
        )
        restarts = CounterMetricFamily(
            "gpuwatchd_job_worker_restarts",
            "Starts of a managed job's workers after their first.",
            labels=label,
        )
        for job in view.managed:
            now.add_metric([job.job], job.parallelism)
            low.add_metric([job.job], job.min_workers)
            high.add_metric([job.job], job.max_workers)
            for state, n in sorted(job.workers.items()):
                slots.add_metric([job.job, state], n)
            restarts.add_metric([job.job], job.restarts)
        yield from (now, low, high, slots, restarts)

    # -- findings, decisions, crashes, trials --------------------------------------------

    def _events(self, view: MetricsView) -> Iterator[Metric]:
        findings = GaugeMetricFamily(
            "gpuwatchd_finding_active",
            "1 per finding open now, by detector and subject (gpu:UUID, job:NAME, host).",
            labels=["detector", "subject"],
        )
        for key in sorted({(f.detector, f.subject) for f in view.findings}):
            findings.add_metric(list(key), 1.0)
        yield findings
        account = view.account
        yield _counter(
            "gpuwatchd_decisions",
            "Policy decisions that reached an outcome (applied, failed, refused, logged, "
            "dry-run, ...) since the daemon started.",
            ("policy", "action", "outcome"),
            account.decisions,
        )
        yield _counter(
            "gpuwatchd_worker_crashes",
            "Job processes that crashed, by job and crash kind (cuda_assert, cuda_oom, "
            "host_oom, environment, optuna_error, other).",
            ("job_name", "kind"),
            account.crashes,
        )
        yield _counter(
            "gpuwatchd_study_trials",
            "Optuna trials that ended, by job, study and TrialState (COMPLETE, PRUNED, FAIL), "
            "as the hooks and the crash handling saw them.",
            ("job_name", "study", "state"),
            account.trials,
        )


def _counter(
    name: str, doc: str, labels: tuple[str, ...], counts: Mapping[tuple[str, ...], int]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    for values, count in sorted(counts.items()):
        family.add_metric(list(values), count)
    return family
