"""A fake of the ``pynvml`` module (nvidia-ml-py) for tests without an NVIDIA GPU.

Specification: docs/modules.md#gpuwatchdtestingnvml
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import types
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "DEFAULT_MEMORY_TOTAL_BYTES",
    "DEFAULT_NAME",
    "SERIES_FIELDS",
    "FakeDevice",
    "FakeEventData",
    "FakeEventSet",
    "FakeMemory",
    "FakeNvml",
    "FakeProcessInfo",
    "FakeUtilization",
    "NVMLError",
    "error_code",
    "install",
    "install_fake_nvml",
]

# NVML return codes, with the values of nvml.h / pynvml (nvmlReturn_t).
NVML_SUCCESS: Final = 0
NVML_ERROR_UNINITIALIZED: Final = 1
NVML_ERROR_INVALID_ARGUMENT: Final = 2
NVML_ERROR_NOT_SUPPORTED: Final = 3
NVML_ERROR_NO_PERMISSION: Final = 4
NVML_ERROR_ALREADY_INITIALIZED: Final = 5
NVML_ERROR_NOT_FOUND: Final = 6
NVML_ERROR_INSUFFICIENT_SIZE: Final = 7
NVML_ERROR_INSUFFICIENT_POWER: Final = 8
NVML_ERROR_DRIVER_NOT_LOADED: Final = 9
NVML_ERROR_TIMEOUT: Final = 10
NVML_ERROR_IRQ_ISSUE: Final = 11
NVML_ERROR_LIBRARY_NOT_FOUND: Final = 12
NVML_ERROR_FUNCTION_NOT_FOUND: Final = 13
NVML_ERROR_CORRUPTED_INFOROM: Final = 14
NVML_ERROR_GPU_IS_LOST: Final = 15
NVML_ERROR_RESET_REQUIRED: Final = 16
NVML_ERROR_OPERATING_SYSTEM: Final = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH: Final = 18
NVML_ERROR_IN_USE: Final = 19
NVML_ERROR_MEMORY: Final = 20
NVML_ERROR_NO_DATA: Final = 21
NVML_ERROR_ARGUMENT_VERSION_MISMATCH: Final = 25
NVML_ERROR_UNKNOWN: Final = 999

NVML_TEMPERATURE_GPU: Final = 0
"""``nvmlTemperatureSensors_t``: the GPU die sensor (nvidia-smi ``temperature.gpu``)."""
nvmlMemory_v2: Final = 0x02000028
"""Struct version of ``nvmlMemory_v2_t`` (``sizeof | 2 << 24``), as in pynvml."""

# Event type masks (``nvmlEventType*`` of nvml.h / pynvml).
nvmlEventTypeNone: Final = 0x0
nvmlEventTypeSingleBitEccError: Final = 0x1
nvmlEventTypeDoubleBitEccError: Final = 0x2
nvmlEventTypePState: Final = 0x4
nvmlEventTypeXidCriticalError: Final = 0x8
nvmlEventTypeClock: Final = 0x10
_NO_INSTANCE: Final = 0xFFFFFFFF
"""``gpuInstanceId``/``computeInstanceId`` of an event outside MIG (pynvml's ``~0``)."""

_ERROR_TEXT: Final[Mapping[int, str]] = {  # pynvml's NVMLError._errcode_to_string
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    NVML_ERROR_MEMORY: "Insufficient Memory",
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}
_ERROR_CODES: Final[Mapping[str, int]] = {
    name[len("NVML_ERROR_") :]: value
    for name, value in dict(globals()).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}

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


class NVMLError(Exception):
    """pynvml's exception: ``value`` is the NVML return code, ``str()`` its text."""

    def __init__(self, value: int) -> None:
        self.value = value
        super().__init__(value)

    def __str__(self) -> str:
        return _ERROR_TEXT.get(self.value, f"NVML Error with code {self.value}")

    def __repr__(self) -> str:
        return f"NVMLError({self.value})"


@dataclass(frozen=True, slots=True)
class FakeUtilization:
    """``nvmlUtilization_t``: percent of time a kernel (``gpu``) / memory copy ran."""

    gpu: int
    memory: int = 0


@dataclass(frozen=True, slots=True)
class FakeMemory:
    """``nvmlMemory_t`` / ``nvmlMemory_v2_t`` in bytes."""

    total: int
    used: int
    free: int
    reserved: int = 0
    version: int = 0


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


class FakeNvml(types.ModuleType):
    """A stand-in for the ``pynvml`` module over scripted :class:`FakeDevice` objects.

    ``init_error`` (an ``NVML_ERROR_*`` code, e.g. ``NVML_ERROR_DRIVER_NOT_LOADED``)
    makes ``nvmlInit`` raise it; with ``init_failures=N`` only the first N calls do (a
    driver loaded after the daemon started). ``memory_v2=False`` plays a driver without
    ``nvmlDeviceGetMemoryInfo_v2`` (a versioned call raises ``FUNCTION_NOT_FOUND``).
    ``event_wait_error`` (a code) makes every ``nvmlEventSetWait`` raise it.
    :attr:`calls` counts calls per function name, to check what a tick costs;
    :attr:`event_sets` holds every set ``nvmlEventSetCreate`` made.
    """

    NVMLError = NVMLError
    NVML_SUCCESS = NVML_SUCCESS
    NVML_ERROR_UNINITIALIZED = NVML_ERROR_UNINITIALIZED
    NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = NVML_ERROR_NO_PERMISSION
    NVML_ERROR_ALREADY_INITIALIZED = NVML_ERROR_ALREADY_INITIALIZED
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_ERROR_INSUFFICIENT_SIZE = NVML_ERROR_INSUFFICIENT_SIZE
    NVML_ERROR_INSUFFICIENT_POWER = NVML_ERROR_INSUFFICIENT_POWER
    NVML_ERROR_DRIVER_NOT_LOADED = NVML_ERROR_DRIVER_NOT_LOADED
    NVML_ERROR_TIMEOUT = NVML_ERROR_TIMEOUT
    NVML_ERROR_IRQ_ISSUE = NVML_ERROR_IRQ_ISSUE
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_ERROR_CORRUPTED_INFOROM = NVML_ERROR_CORRUPTED_INFOROM
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_RESET_REQUIRED = NVML_ERROR_RESET_REQUIRED
    NVML_ERROR_OPERATING_SYSTEM = NVML_ERROR_OPERATING_SYSTEM
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = NVML_ERROR_LIB_RM_VERSION_MISMATCH
    NVML_ERROR_IN_USE = NVML_ERROR_IN_USE
    NVML_ERROR_MEMORY = NVML_ERROR_MEMORY
    NVML_ERROR_NO_DATA = NVML_ERROR_NO_DATA
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    NVML_ERROR_UNKNOWN = NVML_ERROR_UNKNOWN
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    nvmlMemory_v2 = nvmlMemory_v2
    nvmlEventTypeNone = nvmlEventTypeNone
    nvmlEventTypeSingleBitEccError = nvmlEventTypeSingleBitEccError
    nvmlEventTypeDoubleBitEccError = nvmlEventTypeDoubleBitEccError
    nvmlEventTypePState = nvmlEventTypePState
    nvmlEventTypeXidCriticalError = nvmlEventTypeXidCriticalError
    nvmlEventTypeClock = nvmlEventTypeClock

    def __init__(
        self,
        devices: Sequence[FakeDevice] = (),
        *,
        init_error: int | None = None,
        memory_v2: bool = True,
        driver_version: str = "550.54.15",
        event_wait_error: int | None = None,
        init_failures: int | None = None,
    ) -> None:
        super().__init__("pynvml", "Fake pynvml (gpuwatchd.testing.nvml.FakeNvml).")
        # Constants in the module namespace too, so dir(fake) lists them as dir(pynvml) does.
        self.__dict__.update(
            {
                k: v
                for k, v in vars(FakeNvml).items()
                if k.startswith(("NVML", "nvmlMemory", "nvmlEventType"))
            }
        )
        self.devices: list[FakeDevice] = list(devices)
        self.init_error = init_error
        self.init_failures = init_failures
        self.memory_v2 = memory_v2
        self.driver_version = driver_version
        self.init_count = 0
        self.calls: Counter[str] = Counter()
        self.event_wait_error = event_wait_error
        self.event_sets: list[FakeEventSet] = []

    def __repr__(self) -> str:
        return f"<FakeNvml devices={len(self.devices)} init_error={self.init_error}>"

    # -- builders --------------------------------------------------------------------

    @classmethod
    def h100s(
        cls,
        n: int,
        *,
        utilization_pct: float | Sequence[float | None] = 0.0,
        memory_used_bytes: float | Sequence[float | None] = 0,
        temperature_c: float | Sequence[float | None] = 35.0,
        power_draw_w: float | Sequence[float | None] = 70.0,
        memory_total_bytes: int = DEFAULT_MEMORY_TOTAL_BYTES,
    ) -> FakeNvml:
        """``n`` H100s (UUIDs ``GPU-00000000-0000-0000-0000-00000000000<i>``) playing the
        same values: a number is a constant, a sequence a series per sample."""

        def as_series(value: float | Sequence[float | None]) -> Sequence[float | None]:
            return [float(value)] if isinstance(value, (int, float)) else list(value)

        series = {
            "utilization.gpu": as_series(utilization_pct),
            "memory.used": as_series(memory_used_bytes),
            "temperature.gpu": as_series(temperature_c),
            "power.draw": as_series(power_draw_w),
        }
        return cls(
            [
                FakeDevice(
                    f"GPU-00000000-0000-0000-0000-{i:012d}",
                    memory_total_bytes=memory_total_bytes,
                    series=series,
                )
                for i in range(n)
            ]
        )

    @classmethod
    def from_trace(
        cls,
        path: str | os.PathLike[str],
        gpus: int | None = None,
        *,
        memory_total_bytes: int = DEFAULT_MEMORY_TOTAL_BYTES,
    ) -> FakeNvml:
        """Devices that play a real ``nvidia-smi --format=csv`` log, one sample per frame.

        Parsed by :func:`gpuwatchd.sampling.replay.parse_trace` (``gpus`` as there);
        ``[N/A]`` values become ``NOT_SUPPORTED``; ``memory.total`` comes from the
        trace when it has that column, else ``memory_total_bytes`` (80 GiB).
        Raises :class:`~gpuwatchd.errors.ReplayError` for a bad trace.
        """
        from gpuwatchd.sampling.replay import parse_trace

        trace = parse_trace(path, gpus=gpus)
        devices = []
        for i in range(trace.gpu_count):
            samples = [frame.samples[i] for frame in trace.frames]
            first = samples[0]

            def na(value: object) -> float | None:
                return None if not isinstance(value, (int, float)) else float(value)

            total = first.memory_total_bytes
            devices.append(
                FakeDevice(
                    first.uuid,
                    first.name,
                    memory_total_bytes=total if isinstance(total, int) else memory_total_bytes,
                    series={
                        "utilization.gpu": [na(s.utilization_gpu_pct) for s in samples],
                        "memory.used": [na(s.memory_used_bytes) for s in samples],
                        "temperature.gpu": [na(s.temperature_gpu_c) for s in samples],
                        "power.draw": [na(s.power_draw_w) for s in samples],
                    },
                )
            )
        return cls(devices)

    @classmethod
    def from_script(cls, script: Mapping[str, Any]) -> FakeNvml:
        """Build a fake from a JSON-able dict (e.g. a file given to a daemon subprocess).

        Either ``{"trace": PATH, "gpus": N, "memory_total_bytes": B}`` or::

            {"init_error": "DRIVER_NOT_LOADED" | 9 | null,
             "init_failures": null | 3,
             "memory_v2": true,
             "event_wait_error": null | "UNKNOWN",
             "devices": [{"uuid": "GPU-...", "name": "...", "memory_total_bytes": B,
                          "series": {"utilization.gpu": [97, 3], "memory.used": [...],
                                     "temperature.gpu": [...], "power.draw": [...]},
                          "processes": [[1234, 1073741824]] | [{"pid": 1234,
                                        "used_gpu_memory_bytes": null}],
                          "lost_from": 5, "lost_until": null, "lost_code": "GPU_IS_LOST",
                          "unsupported": ["power.draw", "events"],
                          "xids": [[3, 43]] | [{"sample": 3, "xid": 43}],
                          "events_error": "NO_PERMISSION"}]}

        ``init_error`` / ``lost_code`` / ``event_wait_error`` / ``events_error`` take a
        code or its name with or without the ``NVML_ERROR_`` prefix. ``xids`` raise Xid
        ``xid`` once the device has played sample ``sample`` (0-based; the sampler reads
        one sample per tick, so a daemon sees it on that tick). Raises ``ValueError``
        naming the bad key or value.
        """
        if not isinstance(script, Mapping):
            raise ValueError(f"a fake NVML script is a JSON object, got {type(script).__name__}")
        if "trace" in script:
            _check_keys(script, {"trace", "gpus", "memory_total_bytes"}, "script")
            return cls.from_trace(
                str(script["trace"]),
                script.get("gpus"),
                memory_total_bytes=int(script.get("memory_total_bytes",
                                                  DEFAULT_MEMORY_TOTAL_BYTES)),
            )  # fmt: skip
        _check_keys(
            script,
            {
                "init_error",
                "init_failures",
                "memory_v2",
                "devices",
                "driver_version",
                "event_wait_error",
            },
            "script",
        )
        devices_spec = script.get("devices", [])
        if not isinstance(devices_spec, list):
            raise ValueError("script 'devices' must be a list")
        devices = [_device_from_script(spec, i) for i, spec in enumerate(devices_spec)]
        init_error = script.get("init_error")
        wait_error = script.get("event_wait_error")
        return cls(
            devices,
            init_error=None if init_error is None else error_code(init_error),
            memory_v2=bool(script.get("memory_v2", True)),
            driver_version=str(script.get("driver_version", "550.54.15")),
            event_wait_error=None if wait_error is None else error_code(wait_error),
            init_failures=None if script.get("init_failures") is None
            else int(script["init_failures"]),
        )  # fmt: skip

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> FakeNvml:
        """:meth:`from_script` of a JSON file."""
        with open(path, encoding="utf-8") as stream:
            return cls.from_script(json.load(stream))

    # -- the pynvml functions --------------------------------------------------------

    def _device(self, handle: object) -> FakeDevice:
        if self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, FakeDevice) or handle not in self.devices:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return handle

    def nvmlInit(self) -> None:
        """Initialise NVML; raises ``init_error`` when one is set."""
        self.calls["nvmlInit"] += 1
        failing = self.init_failures is None or self.calls["nvmlInit"] <= self.init_failures
        if self.init_error is not None and failing:
            raise NVMLError(self.init_error)
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        """Undo one ``nvmlInit``; raises ``UNINITIALIZED`` without one."""
        self.calls["nvmlShutdown"] += 1
        if self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        self.init_count -= 1

    def nvmlErrorString(self, result: int) -> str:
        """The text of an NVML return code."""
        return _ERROR_TEXT.get(result, f"NVML Error with code {result}")

    def nvmlSystemGetDriverVersion(self) -> str:
        """The (fake) driver version."""
        self.calls["nvmlSystemGetDriverVersion"] += 1
        if self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        """Number of devices."""
        self.calls["nvmlDeviceGetCount"] += 1
        if self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        """The device at NVML index ``index`` (works even while the device is lost)."""
        self.calls["nvmlDeviceGetHandleByIndex"] += 1
        if self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if not 0 <= index < len(self.devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.devices[index]

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        """``GPU-…`` UUID."""
        self.calls["nvmlDeviceGetUUID"] += 1
        device = self._device(handle)
        device.check()
        return device.uuid

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str:
        """Product name."""
        self.calls["nvmlDeviceGetName"] += 1
        device = self._device(handle)
        device.check()
        return device.name

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> FakeUtilization:
        """Utilization in percent; advances the device to its next sample."""
        self.calls["nvmlDeviceGetUtilizationRates"] += 1
        device = self._device(handle)
        device.sample_number += 1
        return FakeUtilization(round(device.value("utilization.gpu")))

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice, version: int | None = None) -> FakeMemory:
        """Memory in bytes (v1, or v2 with ``version=nvmlMemory_v2``)."""
        self.calls["nvmlDeviceGetMemoryInfo"] += 1
        device = self._device(handle)
        if version:
            if not self.memory_v2:
                raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
            if version != nvmlMemory_v2:
                raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        used = int(device.value("memory.used"))
        total = device.memory_total_bytes
        return FakeMemory(total, used, max(total - used, 0), 0, version or 0)

    def nvmlDeviceGetTemperature(self, handle: FakeDevice, sensor: int) -> int:
        """Temperature in °C of ``sensor`` (only ``NVML_TEMPERATURE_GPU``)."""
        self.calls["nvmlDeviceGetTemperature"] += 1
        device = self._device(handle)
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return round(device.value("temperature.gpu"))

    def nvmlDeviceGetPowerUsage(self, handle: FakeDevice) -> int:
        """Power draw in milliwatts (NVML's unit)."""
        self.calls["nvmlDeviceGetPowerUsage"] += 1
        device = self._device(handle)
        return round(device.value("power.draw") * 1000)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[FakeProcessInfo]:
        """Processes with a compute context on the device."""
        self.calls["nvmlDeviceGetComputeRunningProcesses"] += 1
        device = self._device(handle)
        device.check()
        if "processes" in device.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [FakeProcessInfo(pid, used) for pid, used in device.processes]

    # -- events ----------------------------------------------------------------------

    def _event_set(self, event_set: object) -> FakeEventSet:
        if self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if not isinstance(event_set, FakeEventSet) or event_set.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return event_set

    def nvmlEventSetCreate(self) -> FakeEventSet:
        """A new, empty event set."""
        self.calls["nvmlEventSetCreate"] += 1
        if self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        event_set = FakeEventSet()
        self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(
        self, handle: FakeDevice, eventTypes: int, eventSet: FakeEventSet
    ) -> None:
        """Register ``handle`` for the ``eventTypes`` mask in ``eventSet``; raises
        ``NOT_SUPPORTED`` for ``unsupported=["events"]``, or the device's ``events_error``."""
        self.calls["nvmlDeviceRegisterEvents"] += 1
        device = self._device(handle)
        event_set = self._event_set(eventSet)
        device.check()
        if "events" in device.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if device.events_error is not None:
            raise NVMLError(device.events_error)
        event_set.registered[device] = event_set.registered.get(device, 0) | int(eventTypes)

    def nvmlEventSetWait_v2(self, eventSet: FakeEventSet, timeoutms: int) -> FakeEventData:
        """The oldest pending event of ``eventSet``; ``TIMEOUT`` when none is pending.

        Never blocks (``timeoutms`` is ignored). Raises ``event_wait_error`` when set.
        """
        self.calls["nvmlEventSetWait_v2"] += 1
        return self._wait(eventSet)

    def nvmlEventSetWait(self, eventSet: FakeEventSet, timeoutms: int) -> FakeEventData:
        """As :meth:`nvmlEventSetWait_v2` (pynvml's ``nvmlEventSetWait`` calls it too)."""
        self.calls["nvmlEventSetWait"] += 1
        return self._wait(eventSet)

    def _wait(self, event_set_arg: FakeEventSet) -> FakeEventData:
        event_set = self._event_set(event_set_arg)
        if self.event_wait_error is not None:
            raise NVMLError(self.event_wait_error)
        self._raise_due_xids()
        if not event_set.queue:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        return event_set.queue.pop(0)

    def nvmlEventSetFree(self, eventSet: FakeEventSet) -> None:
        """Free ``eventSet`` (a freed set answers ``INVALID_ARGUMENT`` from then on)."""
        self.calls["nvmlEventSetFree"] += 1
        event_set = self._event_set(eventSet)
        event_set.freed = True
        event_set.queue.clear()

    def _raise_due_xids(self) -> None:
        for device in self.devices:
            while device.xids and device.xids[0][0] <= device.sample_number:
                _, xid = device.xids.pop(0)
                self._deliver(device, xid)

    def _deliver(self, device: FakeDevice, xid: int) -> int:
        delivered = 0
        for event_set in self.event_sets:
            mask = event_set.registered.get(device, 0)
            if not event_set.freed and mask & nvmlEventTypeXidCriticalError:
                event_set.queue.append(
                    FakeEventData(device, nvmlEventTypeXidCriticalError, int(xid))
                )
                delivered += 1
        return delivered

    def inject_xid(self, index: int, xid: int) -> int:
        """Raise Xid ``xid`` on the device at NVML index ``index`` now.

        It reaches each live event set the device is registered with for Xid events (an
        Xid before registration is lost, as with the real driver). Returns how many sets
        got it. Raises ``IndexError`` for an unknown index.
        """
        if not 0 <= index < len(self.devices):
            raise IndexError(f"no fake GPU {index} (there are {len(self.devices)})")
        return self._deliver(self.devices[index], xid)


def error_code(value: int | str) -> int:
    """An NVML return code from its number or name (``"GPU_IS_LOST"``, ``"NVML_ERROR_…"``)."""
    if isinstance(value, bool):
        raise ValueError(f"not an NVML error code: {value!r}")
    if isinstance(value, int):
        return value
    name = str(value).upper()
    name = name[len("NVML_ERROR_") :] if name.startswith("NVML_ERROR_") else name
    if name not in _ERROR_CODES:
        raise ValueError(
            f"unknown NVML error {value!r} (e.g. DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, "
            "LIB_RM_VERSION_MISMATCH, GPU_IS_LOST, UNKNOWN)"
        )
    return _ERROR_CODES[name]


def _check_keys(mapping: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise ValueError(
            f"unknown key {', '.join(map(repr, unknown))} in {where} "
            f"(allowed: {', '.join(sorted(allowed))})"
        )


def _device_from_script(spec: object, i: int) -> FakeDevice:
    where = f"devices[{i}]"
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where} must be an object")
    _check_keys(
        spec,
        {"uuid", "name", "memory_total_bytes", "series", "processes", "lost_from",
         "lost_until", "lost_code", "unsupported", "xids", "events_error"},
        where,
    )  # fmt: skip
    processes: list[tuple[int, int | None]] = []
    for proc in spec.get("processes", []):
        if isinstance(proc, Mapping):
            _check_keys(proc, {"pid", "used_gpu_memory_bytes"}, f"{where}.processes")
            used = proc.get("used_gpu_memory_bytes")
            processes.append((int(proc["pid"]), None if used is None else int(used)))
        else:
            pid, used = proc
            processes.append((int(pid), None if used is None else int(used)))
    xids: list[tuple[int, int]] = []
    for j, item in enumerate(spec.get("xids", [])):
        pair: Any = item
        if isinstance(item, Mapping):
            _check_keys(item, {"sample", "xid"}, f"{where}.xids[{j}]")
            pair = (item.get("sample"), item.get("xid"))
        try:
            sample, xid = pair
            xids.append((int(sample), int(xid)))
        except (TypeError, ValueError):
            raise ValueError(
                f'{where}.xids[{j}] must be [sample, xid] or {{"sample": N, "xid": X}}'
            ) from None
    events_error = spec.get("events_error")
    try:
        return FakeDevice(
            str(spec.get("uuid", f"GPU-00000000-0000-0000-0000-{i:012d}")),
            str(spec.get("name", DEFAULT_NAME)),
            memory_total_bytes=int(spec.get("memory_total_bytes", DEFAULT_MEMORY_TOTAL_BYTES)),
            series={
                key: [None if v is None else float(v) for v in values]
                for key, values in dict(spec.get("series", {})).items()
            },
            processes=processes,
            lost_from=spec.get("lost_from"),
            lost_until=spec.get("lost_until"),
            lost_code=error_code(spec.get("lost_code", NVML_ERROR_GPU_IS_LOST)),
            unsupported=list(spec.get("unsupported", [])),
            xids=xids,
            events_error=None if events_error is None else error_code(events_error),
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def install(fake: FakeNvml) -> FakeNvml:
    """Put ``fake`` in ``sys.modules["pynvml"]`` for good (e.g. in a subprocess runner).

    Every later ``import pynvml`` in the process gets the fake. Returns ``fake``.
    """
    sys.modules["pynvml"] = fake
    return fake


@contextlib.contextmanager
def install_fake_nvml(fake: FakeNvml) -> Iterator[FakeNvml]:
    """Within the ``with`` block ``import pynvml`` returns ``fake``; the previous
    ``sys.modules["pynvml"]`` (or its absence) is restored afterwards."""
    missing = object()
    previous: Any = sys.modules.get("pynvml", missing)
    sys.modules["pynvml"] = fake
    try:
        yield fake
    finally:
        if previous is missing:
            sys.modules.pop("pynvml", None)
        else:
            sys.modules["pynvml"] = previous
