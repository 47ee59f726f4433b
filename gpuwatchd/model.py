"""Plain data shared by every layer: samples, snapshots, findings, decisions.

Specification: docs/modules.md#gpuwatchdmodel
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:  # pragma: no cover - typing only
    from gpuwatchd.xid import XidEvent

__all__ = [
    "NA",
    "CudaMemory",
    "Decision",
    "Finding",
    "GpuHealth",
    "GpuProcess",
    "GpuSample",
    "HostSample",
    "JobEvent",
    "JobInfo",
    "JobProcessSample",
    "JobReport",
    "Knob",
    "KnobValue",
    "ManagedJobState",
    "MaybeFloat",
    "MaybeInt",
    "MigDevice",
    "NaType",
    "SlurmJob",
    "Snapshot",
    "is_na",
    "names_gpu",
]


class NaType(enum.Enum):
    """Type of the :data:`NA` sentinel: a value that is not available."""

    NA = "N/A"

    def __repr__(self) -> str:
        return "NA"

    def __str__(self) -> str:
        return "N/A"

    def __bool__(self) -> bool:
        return False


NA: Final = NaType.NA
"""The value of a metric that is unsupported or was not sampled (nvidia-smi prints ``[N/A]``)."""

MaybeFloat = float | Literal[NaType.NA]
MaybeInt = int | Literal[NaType.NA]
KnobValue = int | float | bool


def is_na(value: object) -> bool:
    """Return True when ``value`` is the :data:`NA` sentinel."""
    return value is NA


def _pct(part: MaybeInt, whole: MaybeInt) -> MaybeFloat:
    if part is NA or whole is NA or whole <= 0:
        return NA
    return 100.0 * part / whole


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process with a CUDA context on a GPU (NVML ``nvmlDeviceGetComputeRunningProcesses``)."""

    pid: int
    used_gpu_memory_bytes: MaybeInt = NA
    sm_util_pct: MaybeFloat = NA
    """The process's share of the GPU's SM time over the last sampling period, percent
    (``nvmlDeviceGetProcessUtilization`` ``smUtil``); NA when NVML has no recent sample."""


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """A GPU's hardware-health counters at one instant; NA where the GPU does not report one.

    NVML fields (``nvmlDeviceGetFieldValues``; NVML API reference, "Field Value Enums") with
    dcgm-exporter's names: ``ecc_*_volatile_total`` are ``NVML_FI_DEV_ECC_SBE_VOL_TOTAL`` /
    ``..._DBE_VOL_TOTAL`` (``DCGM_FI_DEV_ECC_SBE_VOL_TOTAL``/``DBE``: single-/double-bit
    errors since the driver loaded); ``remapped_rows_*`` are ``NVML_FI_DEV_REMAPPED_COR`` /
    ``_UNC`` (``DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS``/``UNCORRECTABLE``);
    ``row_remap_pending`` / ``row_remap_failure`` are ``NVML_FI_DEV_REMAPPED_PENDING`` /
    ``_FAILURE`` as 0/1 (``DCGM_FI_DEV_ROW_REMAP_PENDING``/``FAILURE``: a pending remap needs
    a GPU reset, a failure needs service); ``clocks_event_reasons`` is the
    ``nvmlDeviceGetCurrentClocksEventReasons`` bit mask (``nvmlClocksEventReason*``;
    ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS``).
    """

    ecc_sbe_volatile_total: MaybeInt = NA
    ecc_dbe_volatile_total: MaybeInt = NA
    remapped_rows_correctable: MaybeInt = NA
    remapped_rows_uncorrectable: MaybeInt = NA
    row_remap_pending: MaybeInt = NA
    row_remap_failure: MaybeInt = NA
    clocks_event_reasons: MaybeInt = NA


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG instance of a GPU in MIG mode (``nvmlDeviceGetMigDeviceHandleByIndex``):
    memory is per instance; utilization is not reported per instance (NVML answers
    Not Supported), so there is none here."""

    uuid: str
    gpu_instance_id: MaybeInt = NA
    memory_used_bytes: MaybeInt = NA
    memory_total_bytes: MaybeInt = NA


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one instant.

    ``uuid`` (``GPU-…``) is the stable key; ``index`` is the NVML index shown to
    people. ``error`` is set (and metrics are NA) when NVML failed for this device
    this tick, e.g. ``"GPU is lost"``.
    """

    uuid: str
    index: int
    name: str
    timestamp_s: float
    utilization_gpu_pct: MaybeFloat = NA
    memory_used_bytes: MaybeInt = NA
    memory_total_bytes: MaybeInt = NA
    temperature_gpu_c: MaybeFloat = NA
    power_draw_w: MaybeFloat = NA
    processes: tuple[GpuProcess, ...] = ()
    error: str | None = None
    sm_active_pct: MaybeFloat = NA
    """Share of SMs busy over the sample period, percent (GPM ``NVML_GPM_METRIC_SM_UTIL``;
    ``DCGM_FI_PROF_SM_ACTIVE``). Unlike ``utilization.gpu`` (time any kernel ran) it is low
    for a GPU running tiny kernels: 36 % against 0.04 % on the H100 of
    tests/data/gpu/h100_nvml_probe.json."""
    sm_occupancy_pct: MaybeFloat = NA
    """Resident warps against the maximum, percent (``NVML_GPM_METRIC_SM_OCCUPANCY``;
    ``DCGM_FI_PROF_SM_OCCUPANCY``)."""
    tensor_active_pct: MaybeFloat = NA
    """Time tensor cores were busy, percent (``NVML_GPM_METRIC_ANY_TENSOR_UTIL``;
    ``DCGM_FI_PROF_PIPE_TENSOR_ACTIVE``)."""
    dram_active_pct: MaybeFloat = NA
    """Memory bandwidth used, percent (``NVML_GPM_METRIC_DRAM_BW_UTIL``;
    ``DCGM_FI_PROF_DRAM_ACTIVE``)."""
    gpm_unavailable: str | None = None
    """Why the four GPM fields above are NA (e.g. ``"GPM not supported (pre-Hopper)"``)."""
    health: GpuHealth = GpuHealth()
    mig_devices: tuple[MigDevice, ...] = ()
    stale: str | None = None
    """The NVML call that did not return within its deadline (e.g.
    ``"nvmlDeviceGetFieldValues"``): the values are the last ones read, or NA."""

    @property
    def memory_used_pct(self) -> MaybeFloat:
        """``memory.used`` as percent of ``memory.total``, or NA when either is unknown."""
        return _pct(self.memory_used_bytes, self.memory_total_bytes)


@dataclass(frozen=True, slots=True)
class JobProcessSample:
    """Host view of one attached job's process (psutil), sampled by pid only."""

    pid: int
    cpu_pct: float
    """CPU of the process and its children, percent of one core (as ``top``; may exceed 100)."""
    rss_bytes: int
    """Resident memory of the process and its children."""
    num_worker_children: int
    """Live child processes, i.e. DataLoader workers for a PyTorch job."""


@dataclass(frozen=True, slots=True)
class HostSample:
    """The host at one instant (psutil)."""

    timestamp_s: float
    cpu_pct: float
    """Host-wide CPU utilization, percent 0..100 of all logical CPUs."""
    cpu_count: int
    memory_used_bytes: int
    memory_total_bytes: int
    jobs: tuple[JobProcessSample, ...] = ()

    @property
    def memory_used_pct(self) -> float:
        """Used memory as percent of total."""
        return (
            100.0 * self.memory_used_bytes / self.memory_total_bytes
            if self.memory_total_bytes
            else 0.0
        )


@dataclass(frozen=True, slots=True)
class Knob:
    """A job knob as the hook declared it: its current value and inclusive bounds."""

    name: str
    value: KnobValue
    min: KnobValue | None = None
    max: KnobValue | None = None
    applied_at_s: float | None = None
    """When the job last applied a change of this knob (daemon clock), if ever."""
    source: str = "script"
    """Where the value came from: ``script`` (the job's code), ``policy <name>``,
    ``operator`` (``gpuwatchctl knob``) or ``job`` (the job changed it itself)."""

    def bounds_error(self, value: KnobValue) -> str | None:
        """Why ``value`` is outside ``[min, max]``, or None when it fits (booleans always do)."""
        if isinstance(value, bool):
            return None
        if (self.min is not None and value < self.min) or (
            self.max is not None and value > self.max
        ):
            return f"knob {self.name!r} value {value} is outside [{self.min}, {self.max}]"
        return None


@dataclass(frozen=True, slots=True)
class CudaMemory:
    """One CUDA device as the job's PyTorch sees it (``torch.cuda.memory_allocated`` etc.).

    ``device`` is the CUDA ordinal inside the job (after ``CUDA_VISIBLE_DEVICES``).
    """

    device: int
    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int


@dataclass(frozen=True, slots=True)
class JobReport:
    """The hook's aggregate over its last reporting period (a few per second at most)."""

    timestamp_s: float
    steps: int
    """Training steps completed since the job started."""
    epoch: int
    step_time_s: float
    """Mean wall time per step over the period, data wait included."""
    data_wait_s: float
    """Mean time per step spent waiting in the DataLoader's ``next()``."""
    data_wait_fraction: float
    """``data_wait_s / step_time_s`` over the period, 0..1."""
    samples_per_s: float
    cuda_memory: tuple[CudaMemory, ...] = ()
    """Per CUDA device of the job; empty on the CPU."""
    oom_events: int = 0
    """CUDA out-of-memory errors the hook caught since the job started."""


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """The Slurm job a process runs in (from its hook's ``hello``, which reads the task's
    environment, or from its cgroup path ``.../job_<id>/step_<n>/``).

    ``job_id``: ``SLURM_JOB_ID`` (an array task's own id). ``array_job_id`` and
    ``array_task_id``: ``SLURM_ARRAY_JOB_ID`` and ``SLURM_ARRAY_TASK_ID`` (None outside an
    array). ``user``: ``SLURM_JOB_USER``. ``partition``: ``SLURM_JOB_PARTITION``.
    ``step``: the job step from the cgroup path (``batch``, ``extern``, ``0``...; None
    from a hello). ``gpus``: the GPUs Slurm allocated to the job on this node, NVML indices
    (``"0"``) or UUIDs (``"GPU-…"``) as the environment named them
    (:func:`gpuwatchd.control.messages.slurm_gpus`; empty: none, or not known).
    """

    job_id: str
    array_job_id: str | None = None
    array_task_id: int | None = None
    user: str | None = None
    partition: str | None = None
    step: str | None = None
    gpus: tuple[str, ...] = ()

    def label(self) -> str:
        """``<array>_<task>`` for an array task (as ``squeue`` shows it), else the job id."""
        if self.array_job_id is not None and self.array_task_id is not None:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id


def names_gpu(entry: str, uuid: str | None, index: int | None) -> bool:
    """Whether ``entry`` of a ``CUDA_VISIBLE_DEVICES``-style list (a job's
    :attr:`JobInfo.cuda_devices`, a Slurm job's :attr:`SlurmJob.gpus`) names the GPU of NVML
    ``uuid`` and ``index``: its index (ASCII digits, compared as a number), its UUID, or a
    prefix of its UUID that starts with ``GPU-`` (CUDA takes a UUID's prefix; whether it
    names that GPU alone is the caller's question)."""
    if entry.isascii() and entry.isdigit():
        return index is not None and int(entry) == index
    return uuid is not None and (
        entry == uuid or (entry.startswith("GPU-") and uuid.startswith(entry))
    )


@dataclass(frozen=True, slots=True)
class CgroupIdentity:
    """Who runs a process, as its cgroup path says (:mod:`gpuwatchd.cgroup_identity`).

    ``systemd_unit``: the innermost service or scope (``slurmd.service``,
    ``run-r3f0c.scope`` of ``systemd-run --scope``, ``session-3.scope``). ``systemd_user``:
    the uid whose user manager (``user@<uid>.service``) holds that unit, None for a unit of
    the system manager. ``kubernetes_pod_uid``: the pod's uid with dashes (the kubelet's
    ``metadata.uid``), None outside Kubernetes.
    """

    systemd_unit: str | None = None
    systemd_user: int | None = None
    kubernetes_pod_uid: str | None = None


@dataclass(frozen=True, slots=True)
class JobInfo:
    """A job attached to the daemon through the hook (``hello`` with ``role: job``);
    ``slurm``: the Slurm job its hello named, None outside Slurm. ``uid``: the uid of the
    process on the other end of the hello's connection (``SO_PEERCRED``, the kernel's
    word, unlike anything the hello says); None where no connection made it. ``cgroup``:
    the process's systemd unit and Kubernetes pod from its cgroup path, read when it said
    hello; None where nobody read it or the path names neither."""

    name: str
    pid: int
    connected_at_s: float
    cuda_devices: tuple[str, ...] = ()
    knobs: Mapping[str, Knob] = field(default_factory=dict)
    study: str | None = None
    trial_number: int | None = None
    last_report: JobReport | None = None
    slurm: SlurmJob | None = None
    uid: int | None = None
    cgroup: CgroupIdentity | None = None


@dataclass(frozen=True, slots=True)
class ManagedJobState:
    """A managed job's worker slots as the supervisor holds them at one tick (the input of
    the ``worker_given_up`` and ``job_stalled`` detectors).

    ``given_up``: ``(slot number, note)`` of each slot the supervisor will not start
    again by itself (a crash loop or an environment failure: ``failed``; the restart
    budget spent), until an operator acts (``gpuwatchctl job start``). ``live``: slots
    whose process runs or will start again by itself (``running``, ``draining``,
    ``stopping``, ``backoff``). ``finished``: slots whose process exited with status 0
    (the study is over for them). ``slots``: all slots.
    """

    job: str
    given_up: tuple[tuple[int, str], ...] = ()
    live: int = 0
    finished: int = 0
    slots: int = 0


@dataclass(frozen=True, slots=True)
class JobEvent:
    """Something that happened to a job since the last tick, for the event detectors.

    ``kind``:

    * ``"crash"``: a worker process died; ``crash_kind`` is one of
      :data:`gpuwatchd.crash.CRASH_KINDS` (from the supervisor or the hook);
    * ``"oom"``: the hook caught a CUDA out-of-memory error and the job lives on;
    * ``"trial"``: an Optuna trial ended; ``trial_state`` is ``COMPLETE``, ``PRUNED``
      or ``FAIL`` (Optuna's ``TrialState`` names);
    * ``"detach"``: the hook's ``with attach(...)`` block ended without an exception;
      the process is about to exit cleanly (the daemon keeps it for the supervisor,
      which cannot read an adopted worker's exit status; not passed to detectors).

    ``slurm_job``: the Slurm array task (``<array>_<task>``) a ``crash`` is about: read
    from Slurm (:meth:`gpuwatchd.slurm_actions.SlurmActions.scan_crashes`), or named by
    the crashed hook's hello (unchecked until acted on); else None.
    """

    timestamp_s: float
    job: str
    kind: str
    pid: int | None = None
    crash_kind: str | None = None
    trial_number: int | None = None
    trial_state: str | None = None
    gpu_index: int | None = None
    message: str = ""
    slurm_job: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one tick sampled: the input of the windows and detectors."""

    timestamp_s: float
    gpus: tuple[GpuSample, ...]
    host: HostSample | None
    jobs: tuple[JobInfo, ...] = ()
    gpu_status: str = "nvml"
    """``"nvml"``, ``"host-only: <reason>"`` or ``"replay: <path>"``."""
    events: tuple[JobEvent, ...] = ()
    """Job events (crashes, OOMs, trial outcomes) since the previous snapshot."""
    managed: tuple[ManagedJobState, ...] = ()
    """The managed jobs' slots at this tick (empty without ``jobs:``)."""
    xids: tuple[XidEvent, ...] = ()
    """The Xid errors NVML reported since the previous snapshot (:mod:`gpuwatchd.xid`),
    in the order they came; empty without NVML and in replayed traces."""
    process_slurm: tuple[tuple[int, SlurmJob], ...] = ()
    """``(pid, Slurm job)`` of each GPU process that runs in one, hooked or not: its attached
    job's ``hello``, else its environment and cgroup path
    (:func:`gpuwatchd.jobs.procfs.read_slurm_job`), in pid order; empty off Slurm and in
    replayed traces. ``status`` and the metrics both show this one."""


@dataclass(frozen=True, slots=True)
class Finding:
    """A detector's verdict that a condition has held for its ``for:`` duration.

    ``subject`` is the scope key the finding is about: ``"gpu:<uuid>"``,
    ``"job:<name>"`` or ``"host"``.
    """

    detector: str
    subject: str
    timestamp_s: float
    since_s: float
    """When the condition started to hold without a break."""
    value: float
    """The observed value the threshold was compared with (e.g. the window's mean)."""
    threshold: float
    message: str
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    job: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """What the policy engine decided to do: one action of one policy for one target."""

    policy: str
    action: str
    """The action's name in the policy vocabulary: ``log``, ``set_knob``, …"""
    params: Mapping[str, object]
    timestamp_s: float
    findings: tuple[Finding, ...]
    job: str | None = None
    gpu_uuid: str | None = None
    dry_run: bool = False
    reason: str = ""
