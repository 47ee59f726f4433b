"""``allocated_but_idle``: a GPU Slurm allocated to a job that the job leaves idle (pure).

Specification: docs/modules.md#gpuwatchddetectors; the finding: docs/slurm.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

from gpuwatchd.control.messages import MAX_CUDA_DEVICES
from gpuwatchd.detectors.base import EPS_S, Detector
from gpuwatchd.detectors.params import for_param, percent_param
from gpuwatchd.model import Finding, SlurmJob, names_gpu
from gpuwatchd.windows import MetricKey, Scope, Windows

__all__ = ["SLURM_JOBS_MAX", "AllocatedButIdle"]

SLURM_JOBS_MAX: Final = 1024
"""Slurm jobs judged per tick at most (the first by job id; a node runs far fewer): bounds
the work of one evaluation whatever the attached jobs claim."""

_METRIC: Final = "utilization_gpu_pct"
_NAMES_SHOWN: Final = 4
"""Attached job names a message lists at most (a job of many ranks: the rest counted)."""


class _Allocation:
    """One Slurm job's processes at one tick: its identity, their pids, the names of those
    attached through the hook, and the GPUs their environment said Slurm allocated (the
    union, at most :data:`~gpuwatchd.control.messages.MAX_CUDA_DEVICES`)."""

    def __init__(self, slurm: SlurmJob) -> None:
        self.slurm = slurm
        self.pids: set[int] = set()
        self.names: set[str] = set()
        self.gpus: dict[str, None] = {}

    def add(self, pid: int, slurm: SlurmJob, name: str | None = None) -> None:
        self.pids.add(pid)
        if name is not None:
            self.names.add(name)
        for gpu in slurm.gpus:
            if len(self.gpus) >= MAX_CUDA_DEVICES:
                break
            self.gpus[gpu] = None


class AllocatedButIdle(Detector):
    """A GPU that Slurm allocated to a job on this node which the job does not use: the
    worker-to-GPU assignment bug of ``idle_gpu``, on a cluster, named after the Slurm job.

    The allocation comes from the Slurm job of each attached job's hello and of each GPU
    process (``Windows.process_slurm``: its environment, hook or not): ``gpus``, the task's
    ``SLURM_JOB_GPUS``, ``SLURM_STEP_GPUS``, ``GPU_DEVICE_ORDINAL`` or
    ``CUDA_VISIBLE_DEVICES`` (:func:`gpuwatchd.control.messages.slurm_gpus`). The processes
    of one Slurm job (its ranks) are judged together, their GPUs united. An entry is an
    NVML index or a GPU UUID (or a prefix of one, as CUDA accepts); an entry no GPU of the
    snapshot has is left out. A job is judged only while NVML lists one of its processes
    on a GPU of its allocation (``nvmlDeviceGetComputeRunningProcesses``; in a container
    without the host's PID namespace it lists none) and on no GPU outside it (then its
    entries are not the node's NVML indices: numbered from 0 inside a job whose devices
    Slurm's cgroup confines, when only ``CUDA_VISIBLE_DEVICES`` was there).

    GPU *g* of a judged job *J* matches at a tick while none of *J*'s known pids (its
    attached processes and GPU processes) is among *g*'s compute processes and *g*'s
    ``utilization.gpu`` is at or below ``percent`` (so a process of *J* that NVML does not
    list, which keeps *g* busy, never makes it match). It must hold for ``for:`` (window
    semantics of docs/modules.md: an NA sample breaks the streak). Subject
    ``gpu:<uuid>``; ``job``: the attached job's name (the first by name when *J* has
    several; None when none of *J*'s processes has the hook); the message names the Slurm
    job (``<array>_<task>`` for an array task), its user and the GPU. Default: at or below
    10 % for 5 min.
    """

    name = "allocated_but_idle"
    scope: ClassVar[Scope] = "gpu"
    description = (
        "a GPU Slurm allocated to a job on this node that the job leaves idle (no process "
        "of the job, low utilization.gpu)"
    )
    params = (
        percent_param(10, "idle: utilization.gpu at or below this (0..100)"),
        for_param("5m"),
    )

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.threshold: float = float(params["percent"])
        self._start: dict[tuple[str, str], float] = {}

    def needs(self) -> dict[MetricKey, float]:
        """``{("gpu", "utilization_gpu_pct"): for_s}``."""
        return {("gpu", _METRIC): self.for_s}

    def reset(self) -> None:
        """Forget every streak."""
        self._start = {}

    def streaks(self) -> dict[str, float]:
        """``<slurm job id>@gpu:<uuid>`` whose condition holds now -> streak start."""
        return {f"{job}@{subject}": t for (job, subject), t in self._start.items()}

    @staticmethod
    def _allocations(windows: Windows) -> list[_Allocation]:
        by_id: dict[str, _Allocation] = {}
        found: _Allocation | None
        for job in windows.attached:
            if job.slurm is not None:
                found = by_id.setdefault(job.slurm.job_id, _Allocation(job.slurm))
                found.add(job.pid, job.slurm, job.name)
        for pid, slurm in windows.process_slurm:
            found = by_id.get(slurm.job_id)
            if found is None and slurm.gpus:
                found = by_id[slurm.job_id] = _Allocation(slurm)
            if found is not None:
                found.add(pid, slurm)
        ordered = sorted((a for a in by_id.values() if a.gpus), key=lambda a: int(a.slurm.job_id))
        return ordered[:SLURM_JOBS_MAX]

    def evaluate(self, windows: Windows) -> list[Finding]:
        """Update the streak of each (Slurm job, allocated GPU); a finding per pair that
        held for ``for:``."""
        now = windows.now
        if now is None:
            return []
        allocations = self._allocations(windows)
        if not allocations:
            self._start = {}
            return []
        named: dict[str, tuple[Any, ...] | None] = {}  # an allocation's GPU -> its entry
        pids_on = {g.uuid: {p.pid for p in g.processes} for g in windows.samples}
        old = self._start
        new: dict[tuple[str, str], float] = {}
        out: list[Finding] = []
        for allocation in allocations:
            entries = {}
            for gpu in allocation.gpus:
                if gpu not in named:  # resolved once per tick: jobs share their GPUs' names
                    named[gpu] = self._gpu(gpu, windows.gpus)
                entry = named[gpu]
                if entry is not None:
                    entries[entry[2]] = entry
            used = {uuid for uuid, pids in pids_on.items() if pids & allocation.pids}
            if not used or used - entries.keys():
                # NVML lists none of its processes (it may list none at all: a container
                # without the host's PID namespace), or lists one outside its allocation
                # (the entries are not NVML's indices): nothing to judge it by
                continue
            for uuid, entry in entries.items():
                subject, by_metric, _, _ = entry
                window = by_metric.get(_METRIC)
                if window is None or window.last_t != now or window.last_value is None:
                    continue
                if window.last_value > self.threshold or uuid in used:
                    continue
                key = (allocation.slurm.job_id, subject)
                start = new[key] = old.get(key, now)
                if now - start >= self.for_s - EPS_S:
                    mean = window.mean_since(now - self.for_s)
                    value = window.last_value if mean is None else mean
                    out.append(self._finding(entry, allocation, now, start, value))
        self._start = new
        return out

    @staticmethod
    def _gpu(gpu: str, entries: Sequence[tuple[Any, ...]]) -> tuple[Any, ...] | None:
        """The GPU entry (of ``Windows.gpus``) an allocation's ``gpu`` names
        (:func:`~gpuwatchd.model.names_gpu`: an NVML index, a UUID or a UUID's prefix), if
        it names one GPU only; None when none (or several) does."""
        matches = [entry for entry in entries if names_gpu(gpu, entry[2], entry[3])]
        return matches[0] if len(matches) == 1 else None

    def _finding(
        self,
        entry: tuple[Any, ...],
        allocation: _Allocation,
        now: float,
        since: float,
        mean: float,
    ) -> Finding:
        subject, _, uuid, index = entry
        slurm = allocation.slurm
        names = sorted(allocation.names)
        user = f", user {slurm.user}" if slurm.user else ""
        shown = ", ".join(names[:_NAMES_SHOWN])
        if len(names) > _NAMES_SHOWN:
            shown += f" and {len(names) - _NAMES_SHOWN} more"
        attached = f" (attached as {shown})" if names else " (no process with the hook)"
        message = (
            f"GPU {index} allocated by Slurm to job {slurm.label()}{user}{attached} has no "
            f"process of that job and utilization.gpu {mean:.1f} % <= {self.threshold:g} %"
            f"{self._for_text}"
        )
        job = names[0] if names else None
        return Finding(
            self.name, subject, now, since, mean, self.threshold, message, uuid, index, job
        )
