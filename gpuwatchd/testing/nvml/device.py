"""The fake GPU model: ``FakeDevice`` playing scripted series, and pynvml's return structs.

Specification: docs/modules.md#gpuwatchdtestingnvml
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gpuwatchd.testing.nvml.codes import (
    _NO_INSTANCE,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    NVMLError,
)

DEFAULT_NAME: Final = "NVIDIA H100 80GB HBM3"
DEFAULT_MEMORY_TOTAL_BYTES: Final = 80 * 2**30
SERIES_FIELDS: Final = ("utilization.gpu", "memory.used", "temperature.gpu", "power.draw")
"""Series a :class:`FakeDevice` plays, in nvidia-smi names and base units (%, bytes, °C, W)."""
_UNSUPPORTABLE: Final = (*SERIES_FIELDS, "processes", "events")
_DEFAULTS: Final[Mapping[str, float]] = {
    "utilization.gpu": 0.0,
    "memory.used": 0.0,
    "temperature.gpu": 30.0,
    "power.draw": 70.0,
}


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
    gpuInstanceId: int = _NO_INSTANCE
    computeInstanceId: int = _NO_INSTANCE


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

    ``series`` maps :data:`SERIES_FIELDS` names to values per sample (None: NVML
    answers ``NOT_SUPPORTED`` for that sample); a field without series plays a
    constant (0 %, 0 B, 30 °C, 70 W). ``processes`` are ``(pid, used_gpu_memory_bytes
    or None)``. From sample number ``lost_from`` (0-based) up to, not including,
    ``lost_until`` every call on the device raises ``lost_code``
    (``NVML_ERROR_GPU_IS_LOST`` by default); ``nvmlDeviceGetHandleByIndex`` keeps
    working, so a sampler can reopen it. Fields in ``unsupported`` (a series name,
    ``"processes"`` or ``"events"``) always raise ``NOT_SUPPORTED``: ``"events"`` makes
    ``nvmlDeviceRegisterEvents`` refuse the device, as ``events_error`` (an
    ``NVML_ERROR_*`` code, e.g. ``NO_PERMISSION``) does with that code. ``xids`` are
    ``(sample_number, xid)``: the Xid is raised once the device has played that sample.

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
        processes: Iterable[tuple[int, int | None]] = (),
        lost_from: int | None = None,
        lost_until: int | None = None,
        lost_code: int = NVML_ERROR_GPU_IS_LOST,
        unsupported: Iterable[str] = (),
        xids: Iterable[tuple[int, int]] = (),
        events_error: int | None = None,
    ) -> None:
        series = dict(series or {})
        unknown = sorted(set(series) - set(SERIES_FIELDS))
        if unknown:
            raise ValueError(
                f"unknown series {', '.join(unknown)} (use {', '.join(SERIES_FIELDS)})"
            )
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
        for key in SERIES_FIELDS:
            self.series.setdefault(key, (_DEFAULTS[key],))
        self.processes = tuple((int(pid), used) for pid, used in processes)
        self.lost_from = lost_from
        self.lost_until = lost_until
        self.lost_code = lost_code
        self.unsupported = unsupported_set
        self.xids: list[tuple[int, int]] = sorted((int(k), int(x)) for k, x in xids)
        """Scheduled Xids not raised yet, ``(sample_number, xid)`` in sample order."""
        self.events_error = events_error
        self.sample_number = -1
        self._forced_lost = False

    def __repr__(self) -> str:
        return f"FakeDevice({self.uuid!r}, sample_number={self.sample_number})"

    def lose(self) -> None:
        """From now on every call on the device raises ``lost_code`` (until :meth:`recover`)."""
        self._forced_lost = True

    def recover(self) -> None:
        """Undo :meth:`lose` and any scripted loss: the device answers again."""
        self._forced_lost = False
        self.lost_from = None

    @property
    def lost(self) -> bool:
        """Whether calls on the device fail at the current sample."""
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
        values = self.series[field]
        got = values[min(max(self.sample_number, 0), len(values) - 1)]
        if got is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return got

    def check(self) -> None:
        """Raise ``lost_code`` when the device is lost (static queries)."""
        if self.lost:
            raise NVMLError(self.lost_code)
