"""Detectors: conditions over the metric windows and job events that turn into Findings (pure).

``DETECTORS`` is the registry by name; the classes live in ``params`` (parameter
specs), ``base`` (base classes), ``gpu``, ``host``, ``job``, ``managed``, ``faults``
(hardware faults) and ``allocation`` (Slurm's allocation against use).
Specification: docs/modules.md#gpuwatchddetectors
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from gpuwatchd.crash import CRASH_KINDS
from gpuwatchd.detectors.allocation import AllocatedButIdle
from gpuwatchd.detectors.base import Detector, EventDetector, EventFinding, ThresholdDetector
from gpuwatchd.detectors.faults import (
    EccDbe,
    GpuLost,
    GpuRecovered,
    GpuThrottled,
    RowRemap,
    Xid,
)
from gpuwatchd.detectors.gpu import IdleGpu, LowUtilization, VramAbove
from gpuwatchd.detectors.host import HostCpuAbove, HostCpuBelow, HostMemoryAbove
from gpuwatchd.detectors.job import (
    CRASH_DEDUP_S,
    DataStarved,
    JobCrashed,
    TrialsSucceededInRow,
)
from gpuwatchd.detectors.managed import JobStalled, WorkerGivenUp
from gpuwatchd.detectors.params import ExclusiveGroup, Fail, ParamSpec, parse_params

__all__ = [
    "CRASH_DEDUP_S",
    "CRASH_KINDS",
    "DETECTORS",
    "AllocatedButIdle",
    "DataStarved",
    "Detector",
    "EccDbe",
    "EventDetector",
    "EventFinding",
    "ExclusiveGroup",
    "Fail",
    "GpuLost",
    "GpuRecovered",
    "GpuThrottled",
    "HostCpuAbove",
    "HostCpuBelow",
    "HostMemoryAbove",
    "IdleGpu",
    "JobCrashed",
    "JobStalled",
    "LowUtilization",
    "ParamSpec",
    "RowRemap",
    "ThresholdDetector",
    "TrialsSucceededInRow",
    "VramAbove",
    "WorkerGivenUp",
    "Xid",
    "parse_params",
]

DETECTORS: Final[Mapping[str, type[Detector]]] = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            VramAbove,
            LowUtilization,
            IdleGpu,
            AllocatedButIdle,
            HostCpuAbove,
            HostCpuBelow,
            HostMemoryAbove,
            DataStarved,
            JobCrashed,
            TrialsSucceededInRow,
            WorkerGivenUp,
            JobStalled,
            Xid,
            EccDbe,
            RowRemap,
            GpuLost,
            GpuThrottled,
            GpuRecovered,
        )
    }
)
"""Every detector a policy's ``when:`` may name, by name."""
