"""The fake GPU model: ``FakeDevice`` playing scripted series, and pynvml's return structs.

Specification: docs/modules.md#gpuwatchdtestingnvml
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Final

from gpuwatchd.model import GpuHealth
from gpuwatchd.testing.nvml.codes import (
    NO_INSTANCE,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    NVMLError,
)

DEFAULT_NAME: Final = "NVIDIA H100 80GB HBM3"
DEFAULT_MEMORY_TOTAL_BYTES: Final = 80 * 2**30
SERIES_FIELDS: Final = ("utilization.gpu", "memory.used", "temperature.gpu", "power.draw")
"""Series a :class:`FakeDevice` plays, in nvidia-smi names and base units (%, bytes, °C, W)."""
GPM_SERIES: Final = ("sm_active_pct", "sm_occupancy_pct", "tensor_active_pct", "dram_active_pct")
"""GPM metrics a device plays, in percent, named as :class:`~gpuwatchd.model.GpuSample`'s
fields (``nvmlGpmMetricsGet`` answers the value of the later sample)."""
HEALTH_SERIES: Final = tuple(f.name for f in fields(GpuHealth))
"""Health counters a device plays, named as :class:`~gpuwatchd.model.GpuHealth`'s fields
(the first six through ``nvmlDeviceGetFieldValues``, the last as
``nvmlDeviceGetCurrentClocksEventReasons``' bit mask)."""
ALL_SERIES: Final = (*SERIES_FIELDS, *GPM_SERIES, *HEALTH_SERIES)
_UNSUPPORTABLE: Final = (
    *ALL_SERIES,
    "processes",
    "events",
    "gpm",
    "process_utilization",
    "mig",
)
_DEFAULTS: Final[Mapping[str, float]] = {
    "utilization.gpu": 0.0,
    "memory.used": 0.0,
    "temperature.gpu": 30.0,
    "power.draw": 70.0,
    **{name: 0.0 for name in (*GPM_SERIES, *HEALTH_SERIES)},
}
TIMESTAMP_BASE_US: Final = 1_795_800_000_000_000
"""The fake's CPU clock in µs at sample 0 (process utilization samples and field values
are stamped ``TIMESTAMP_BASE_US + sample_number * 1e6``: one sample per second)."""


@dataclass(frozen=True, slots=True)
class FakeUtilization:
    """``nvmlUtilization_t``: percent of time a kernel (``gpu``) / memory copy ran."""

    gpu: int
    memory: int = 0


@dataclass(frozen=True, slots=True)
class FakeMemory:
    """``nvmlMemory_t`` in bytes (``nvmlDeviceGetMemoryInfo(handle)``): pynvml's
    ``c_nvmlMemory_t`` has these three fields only, in this order."""

    total: int
    free: int
    used: int


@dataclass(frozen=True, slots=True)
class FakeMemoryV2:
    """``nvmlMemory_v2_t`` in bytes (``nvmlDeviceGetMemoryInfo(handle,
    version=nvmlMemory_v2)``): pynvml's ``c_nvmlMemory_v2_t``, fields in its order."""

    version: int
    total: int
    reserved: int
    free: int
    used: int


@dataclass(frozen=True, slots=True)
class FakeProcessInfo:
    """``nvmlProcessInfo_t``: ``usedGpuMemory`` bytes, or None where NVML cannot tell."""

    pid: int
    usedGpuMemory: int | None  # pynvml's attribute names
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class FakeEventData:
    """``c_nvmlEventData_t``: ``device`` is the handle (here the :class:`FakeDevice`),
    ``eventType`` the ``nvmlEventType*`` mask, ``eventData`` the Xid number for an Xid."""

    device: Any  # pynvml's attribute names
    eventType: int
    eventData: int
    gpuInstanceId: int = NO_INSTANCE
    computeInstanceId: int = NO_INSTANCE


@dataclass(slots=True)
class FakeValue:
    """``c_nvmlValue_t`` (a union in pynvml): the same number in every member."""

    dVal: float = 0.0
    uiVal: int = 0
    ulVal: int = 0
    ullVal: int = 0
    sllVal: int = 0
    siVal: int = 0
    usVal: int = 0


@dataclass(slots=True)
class FakeFieldValue:
    """``c_nvmlFieldValue_t``: one answer of ``nvmlDeviceGetFieldValues``; ``nvmlReturn``
    is the field's own return code (``NVML_SUCCESS`` or e.g. ``NOT_SUPPORTED``),
    ``valueType`` an ``NVML_VALUE_TYPE_*`` (3: unsigned long long, as the H100 answers
    the ECC and remap counters)."""

    fieldId: int
    scopeId: int = 0
    timestamp: int = 0
    latencyUsec: int = 0
    valueType: int = 0
    nvmlReturn: int = 0
    value: FakeValue = field(default_factory=FakeValue)


@dataclass(frozen=True, slots=True)
class FakeProcessUtilizationSample:
    """``c_nvmlProcessUtilizationSample_t``: a process's use over one driver sampling
    period, percent; ``timeStamp`` in µs (the CPU clock)."""

    pid: int
    timeStamp: int
    smUtil: int
    memUtil: int = 0
    encUtil: int = 0
    decUtil: int = 0


@dataclass(frozen=True, slots=True)
class FakeGpmSupport:
    """``c_nvmlGpmSupport_t`` (``nvmlGpmQueryDeviceSupport``)."""

    version: int
    isSupportedDevice: int


@dataclass(slots=True)
class FakeMetricInfo:
    """``c_metricInfo_t``: names and unit of a GPM metric (NULL pointers: None)."""

    shortName: bytes | None = None
    longName: bytes | None = None
    unit: bytes | None = None


@dataclass(slots=True)
class FakeGpmMetric:
    """``c_nvmlGpmMetric_t``: the caller sets ``metricId``; ``nvmlGpmMetricsGet`` fills
    ``nvmlReturn`` and ``value`` (percent for the utilization metrics)."""

    metricId: int = 0
    nvmlReturn: int = 0
    value: float = 0.0
    metricInfo: FakeMetricInfo = field(default_factory=FakeMetricInfo)


class FakeGpmSample:
    """``nvmlGpmSample_t`` (opaque in NVML): after ``nvmlGpmSampleGet`` it holds the device
    and the GPM values of the device's current sample."""

    def __init__(self) -> None:
        self.device: FakeDevice | None = None
        self.sample_number = -1
        self.values: dict[str, float | None] = {}
        self.freed = False

    def __repr__(self) -> str:
        return f"FakeGpmSample(sample_number={self.sample_number}, freed={self.freed})"


class FakeGpmMetricsGet:
    """``c_nvmlGpmMetricsGet_t`` as the caller builds it (``nvml.c_nvmlGpmMetricsGet_t()``):
    ``version``, ``numMetrics``, the two samples and :data:`~gpuwatchd.testing.nvml.codes.
    NVML_GPM_METRIC_MAX` ``metrics`` whose ``metricId`` the caller sets."""

    def __init__(self) -> None:
        from gpuwatchd.testing.nvml.codes import NVML_GPM_METRIC_MAX

        self.version = 0
        self.numMetrics = 0
        self.sample1: FakeGpmSample | None = None
        self.sample2: FakeGpmSample | None = None
        self.metrics = [FakeGpmMetric() for _ in range(NVML_GPM_METRIC_MAX)]


class FakeEventSet:
    """``nvmlEventSet_t``: the devices registered with it (device -> event type mask) and
    the events delivered to it, oldest first, until ``nvmlEventSetWait`` takes them."""

    def __init__(self) -> None:
        self.registered: dict[FakeDevice, int] = {}
        self.queue: list[FakeEventData] = []
        self.freed = False

    def __repr__(self) -> str:
        return f"FakeEventSet(devices={len(self.registered)}, pending={len(self.queue)})"


class FakeDevice:
    """One scripted GPU.

    ``series`` maps :data:`ALL_SERIES` names (:data:`SERIES_FIELDS`, :data:`GPM_SERIES`,
    :data:`HEALTH_SERIES`) to values per sample (None: NVML answers ``NOT_SUPPORTED``
    for that sample, or that field's ``nvmlReturn`` for a field value); a field without
    series plays a constant (0 %, 0 B, 30 °C, 70 W, GPM 0 %, counters 0). ``processes``
    are ``(pid, used_gpu_memory_bytes or None)`` or ``(pid, used, sm_util_pct or
    None)``: a process with an ``sm_util_pct`` has one ``nvmlDeviceGetProcessUtilization``
    sample per device sample (``NOT_FOUND`` when no process has one). ``mig_devices``
    (FakeDevice objects with ``gpu_instance_id``; their ``memory.used`` series plays on
    this device's sample) turn MIG mode on. ``unsupported`` may also name ``"gpm"``
    (``isSupportedDevice`` 0), ``"process_utilization"`` and ``"mig"``. :meth:`block`
    makes one call hang until released.

    From sample number ``lost_from`` (0-based) up to, not including, ``lost_until``
    every call on the device raises ``lost_code``
    (``NVML_ERROR_GPU_IS_LOST`` by default); ``nvmlDeviceGetHandleByIndex`` keeps
    working, so a sampler can reopen it. Fields in ``unsupported`` (a series name,
    ``"processes"`` or ``"events"``) always raise ``NOT_SUPPORTED``: ``"events"`` makes
    ``nvmlDeviceRegisterEvents`` refuse the device, as ``events_error`` (an
    ``NVML_ERROR_*`` code, e.g. ``NO_PERMISSION``) does with that code. ``xids`` are
    ``(sample_number, xid)``: the Xid is raised once the device has played that sample;
    ``xid_files`` are ``(path, xid)``: the Xid is raised at the first event wait after a
    file exists at ``path``, so a test raises it when its scenario is ready (a worker in
    a trial) in a daemon subprocess, where :meth:`FakeNvml.inject_xid` cannot reach.

    The device advances one sample each time its utilization is read;
    :attr:`sample_number` is the current one (-1 before the first read).
    Raises ``ValueError`` for an unknown series or unsupported field name.
    """

    def __init__(
        self,
        uuid: str,
        name: str = DEFAULT_NAME,
        *,
        memory_total_bytes: int = DEFAULT_MEMORY_TOTAL_BYTES,
        series: Mapping[str, Sequence[float | None]] | None = None,
        processes: Iterable[tuple[int, int | None] | tuple[int, int | None, float | None]] = (),
        lost_from: int | None = None,
        lost_until: int | None = None,
        lost_code: int = NVML_ERROR_GPU_IS_LOST,
        unsupported: Iterable[str] = (),
        xids: Iterable[tuple[int, int]] = (),
        xid_files: Iterable[tuple[str | os.PathLike[str], int]] = (),
        events_error: int | None = None,
        mig_devices: Iterable[FakeDevice] = (),
        gpu_instance_id: int | None = None,
    ) -> None:
        series = dict(series or {})
        unknown = sorted(set(series) - set(ALL_SERIES))
        if unknown:
            raise ValueError(f"unknown series {', '.join(unknown)} (use {', '.join(ALL_SERIES)})")
        unsupported_set = frozenset(unsupported)
        bad = sorted(unsupported_set - set(_UNSUPPORTABLE))
        if bad:
            raise ValueError(
                f"unknown unsupported field {', '.join(bad)} (use {', '.join(_UNSUPPORTABLE)})"
            )
        self.uuid = uuid
        self.name = name
        self.memory_total_bytes = int(memory_total_bytes)
        self.series: dict[str, tuple[float | None, ...]] = {
            key: tuple(values) if len(values) else (_DEFAULTS[key],)
            for key, values in series.items()
        }
        for key in ALL_SERIES:
            self.series.setdefault(key, (_DEFAULTS[key],))
        procs: list[tuple[int, int | None, float | None]] = []
        for proc in processes:
            sm_util = proc[2] if len(proc) > 2 else None
            procs.append((int(proc[0]), proc[1], None if sm_util is None else float(sm_util)))
        self.processes: tuple[tuple[int, int | None, float | None], ...] = tuple(procs)
        """``(pid, used_gpu_memory_bytes or None, sm_util_pct or None)``."""
        self.mig_devices: tuple[FakeDevice, ...] = tuple(mig_devices)
        self.gpu_instance_id = gpu_instance_id
        """A MIG device's GPU instance id (None: a whole GPU)."""
        self.parent: FakeDevice | None = None
        for child in self.mig_devices:
            child.parent = self
        self._block: tuple[str, int, threading.Event, float] | None = None
        self._release_current = threading.Event()
        self.blocked_in: str | None = None
        """The call blocked now (see :meth:`block`), None when none is."""
        self.lost_from = lost_from
        self.lost_until = lost_until
        self.lost_code = lost_code
        self.unsupported = unsupported_set
        self.xids: list[tuple[int, int]] = sorted((int(k), int(x)) for k, x in xids)
        """Scheduled Xids not raised yet, ``(sample_number, xid)`` in sample order."""
        self.xid_files: list[tuple[str, int]] = [(os.fspath(p), int(x)) for p, x in xid_files]
        """Xids waiting for their file, ``(path, xid)``, not raised yet."""
        self.events_error = events_error
        self.sample_number = -1
        self._forced_lost = False

    def __repr__(self) -> str:
        return f"FakeDevice({self.uuid!r}, sample_number={self.sample_number})"

    def block(self, call: str, *, from_sample: int = 0, timeout_s: float = 30.0) -> threading.Event:
        """The next call of the pynvml function ``call`` on this device, from sample
        ``from_sample`` on, blocks (as a driver call in D-state) until the returned event
        is set or ``timeout_s`` seconds pass; then it answers normally and the block is
        over. Returns the event (a test sets it to release the call)."""
        release = threading.Event()
        self._block = (call, int(from_sample), release, float(timeout_s))
        return release

    def release(self) -> None:
        """Let the call scripted by :meth:`block` return (now, or at once when reached)."""
        if self._block is not None:
            self._block[2].set()
        self._release_current.set()

    def wait_if_blocked(self, call: str) -> None:
        """Block here when :meth:`block` scripted ``call`` for the current sample."""
        block = self._block
        if block is None or block[0] != call or max(self.current_sample, 0) < block[1]:
            return
        self._block = None
        self._release_current = block[2]
        self.blocked_in = call
        try:
            block[2].wait(block[3])
        finally:
            self.blocked_in = None

    @property
    def current_sample(self) -> int:
        """The sample the device plays now (a MIG device plays its parent's)."""
        return self.parent.sample_number if self.parent is not None else self.sample_number

    def lose(self) -> None:
        """From now on every call on the device raises ``lost_code`` (until :meth:`recover`)."""
        self._forced_lost = True

    def recover(self) -> None:
        """Undo :meth:`lose` and any scripted loss: the device answers again."""
        self._forced_lost = False
        self.lost_from = None

    @property
    def lost(self) -> bool:
        """Whether calls on the device fail at the current sample (a MIG device's:
        its parent's)."""
        if self.parent is not None and self.parent.lost:
            return True
        if self._forced_lost:
            return True
        k = max(self.sample_number, 0)
        return (
            self.lost_from is not None
            and k >= self.lost_from
            and (self.lost_until is None or k < self.lost_until)
        )

    def value(self, field: str) -> float:
        """The current sample's value of ``field``; raises NVMLError as the device would."""
        if self.lost:
            raise NVMLError(self.lost_code)
        if field in self.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        got = self.maybe(field)
        if got is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return got

    def maybe(self, field: str) -> float | None:
        """The current sample's value of ``field``; None where the script says
        Not Supported (a None value, or ``field`` in ``unsupported``). Never raises."""
        if field in self.unsupported:
            return None
        values = self.series[field]
        return values[min(max(self.current_sample, 0), len(values) - 1)]

    def check(self) -> None:
        """Raise ``lost_code`` when the device is lost (static queries)."""
        if self.lost:
            raise NVMLError(self.lost_code)
