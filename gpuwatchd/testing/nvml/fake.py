"""``FakeNvml``: the fake ``pynvml`` module over scripted devices (the functions, the
event API, Xid injection) and its installation in ``sys.modules``.

Specification: docs/modules.md#gpuwatchdtestingnvml
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import types
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gpuwatchd.testing.nvml import codes as _codes
from gpuwatchd.testing.nvml.codes import (
    ERROR_TEXT,
    NVML_ERROR_ALREADY_INITIALIZED,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_CORRUPTED_INFOROM,
    NVML_ERROR_DEPRECATED,
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FREQ_NOT_SUPPORTED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_GPU_NOT_FOUND,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_POWER,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_INVALID_STATE,
    NVML_ERROR_IRQ_ISSUE,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_MEMORY,
    NVML_ERROR_NO_DATA,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_READY,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_OPERATING_SYSTEM,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_RESET_TYPE_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    NVML_ERROR_UNKNOWN,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED,
    NVML_SUCCESS,
    NVML_TEMPERATURE_GPU,
    NVMLError,
    nvmlEventTypeClock,
    nvmlEventTypeDoubleBitEccError,
    nvmlEventTypeNone,
    nvmlEventTypePState,
    nvmlEventTypeSingleBitEccError,
    nvmlEventTypeXidCriticalError,
    nvmlMemory_v2,
)
from gpuwatchd.testing.nvml.device import (
    DEFAULT_MEMORY_TOTAL_BYTES,
    GPM_SERIES,
    TIMESTAMP_BASE_US,
    FakeDevice,
    FakeEventData,
    FakeEventSet,
    FakeFieldValue,
    FakeGpmMetricsGet,
    FakeGpmSample,
    FakeGpmSupport,
    FakeMemory,
    FakeMemoryV2,
    FakeProcessInfo,
    FakeProcessUtilizationSample,
    FakeUtilization,
    FakeValue,
)
from gpuwatchd.testing.nvml.script import h100_devices, script_devices, trace_devices


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
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = NVML_ERROR_VGPU_ECC_NOT_SUPPORTED
    NVML_ERROR_INSUFFICIENT_RESOURCES = NVML_ERROR_INSUFFICIENT_RESOURCES
    NVML_ERROR_FREQ_NOT_SUPPORTED = NVML_ERROR_FREQ_NOT_SUPPORTED
    NVML_ERROR_DEPRECATED = NVML_ERROR_DEPRECATED
    NVML_ERROR_NOT_READY = NVML_ERROR_NOT_READY
    NVML_ERROR_GPU_NOT_FOUND = NVML_ERROR_GPU_NOT_FOUND
    NVML_ERROR_INVALID_STATE = NVML_ERROR_INVALID_STATE
    NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = NVML_ERROR_RESET_TYPE_NOT_SUPPORTED
    NVML_ERROR_UNKNOWN = NVML_ERROR_UNKNOWN
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    nvmlMemory_v2 = nvmlMemory_v2
    nvmlEventTypeNone = nvmlEventTypeNone
    nvmlEventTypeSingleBitEccError = nvmlEventTypeSingleBitEccError
    nvmlEventTypeDoubleBitEccError = nvmlEventTypeDoubleBitEccError
    nvmlEventTypePState = nvmlEventTypePState
    nvmlEventTypeXidCriticalError = nvmlEventTypeXidCriticalError
    nvmlEventTypeClock = nvmlEventTypeClock
    NVML_FI_DEV_ECC_SBE_VOL_TOTAL = _codes.NVML_FI_DEV_ECC_SBE_VOL_TOTAL
    NVML_FI_DEV_ECC_DBE_VOL_TOTAL = _codes.NVML_FI_DEV_ECC_DBE_VOL_TOTAL
    NVML_FI_DEV_REMAPPED_COR = _codes.NVML_FI_DEV_REMAPPED_COR
    NVML_FI_DEV_REMAPPED_UNC = _codes.NVML_FI_DEV_REMAPPED_UNC
    NVML_FI_DEV_REMAPPED_PENDING = _codes.NVML_FI_DEV_REMAPPED_PENDING
    NVML_FI_DEV_REMAPPED_FAILURE = _codes.NVML_FI_DEV_REMAPPED_FAILURE
    NVML_VALUE_TYPE_DOUBLE = _codes.NVML_VALUE_TYPE_DOUBLE
    NVML_VALUE_TYPE_UNSIGNED_INT = _codes.NVML_VALUE_TYPE_UNSIGNED_INT
    NVML_VALUE_TYPE_UNSIGNED_LONG = _codes.NVML_VALUE_TYPE_UNSIGNED_LONG
    NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = _codes.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    NVML_VALUE_TYPE_SIGNED_LONG_LONG = _codes.NVML_VALUE_TYPE_SIGNED_LONG_LONG
    NVML_VALUE_TYPE_SIGNED_INT = _codes.NVML_VALUE_TYPE_SIGNED_INT
    NVML_VALUE_TYPE_UNSIGNED_SHORT = _codes.NVML_VALUE_TYPE_UNSIGNED_SHORT
    NVML_GPM_SUPPORT_VERSION = _codes.NVML_GPM_SUPPORT_VERSION
    NVML_GPM_METRICS_GET_VERSION = _codes.NVML_GPM_METRICS_GET_VERSION
    NVML_GPM_METRIC_SM_UTIL = _codes.NVML_GPM_METRIC_SM_UTIL
    NVML_GPM_METRIC_SM_OCCUPANCY = _codes.NVML_GPM_METRIC_SM_OCCUPANCY
    NVML_GPM_METRIC_ANY_TENSOR_UTIL = _codes.NVML_GPM_METRIC_ANY_TENSOR_UTIL
    NVML_GPM_METRIC_DRAM_BW_UTIL = _codes.NVML_GPM_METRIC_DRAM_BW_UTIL
    NVML_GPM_METRIC_MAX = _codes.NVML_GPM_METRIC_MAX
    NVML_DEVICE_MIG_DISABLE = _codes.NVML_DEVICE_MIG_DISABLE
    NVML_DEVICE_MIG_ENABLE = _codes.NVML_DEVICE_MIG_ENABLE
    nvmlClocksEventReasonNone = _codes.nvmlClocksEventReasonNone
    nvmlClocksEventReasonGpuIdle = _codes.nvmlClocksEventReasonGpuIdle
    nvmlClocksEventReasonApplicationsClocksSetting = (
        _codes.nvmlClocksEventReasonApplicationsClocksSetting
    )
    nvmlClocksEventReasonSwPowerCap = _codes.nvmlClocksEventReasonSwPowerCap
    nvmlClocksEventReasonHwSlowdown = _codes.nvmlClocksEventReasonHwSlowdown
    nvmlClocksEventReasonSyncBoost = _codes.nvmlClocksEventReasonSyncBoost
    nvmlClocksEventReasonSwThermalSlowdown = _codes.nvmlClocksEventReasonSwThermalSlowdown
    nvmlClocksEventReasonHwThermalSlowdown = _codes.nvmlClocksEventReasonHwThermalSlowdown
    nvmlClocksEventReasonHwPowerBrakeSlowdown = _codes.nvmlClocksEventReasonHwPowerBrakeSlowdown
    nvmlClocksEventReasonDisplayClockSetting = _codes.nvmlClocksEventReasonDisplayClockSetting

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
                if k.startswith(("NVML", "nvmlMemory", "nvmlEventType", "nvmlClocksEventReason"))
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
        self.gpm_samples: list[FakeGpmSample] = []
        self._lock = threading.Lock()

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
        return cls(
            h100_devices(
                n,
                utilization_pct=utilization_pct,
                memory_used_bytes=memory_used_bytes,
                temperature_c=temperature_c,
                power_draw_w=power_draw_w,
                memory_total_bytes=memory_total_bytes,
            )
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
        return cls(trace_devices(path, gpus, memory_total_bytes=memory_total_bytes))

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
                          "xids": [[3, 43]] | [{"sample": 3, "xid": 43}]
                                  | [{"file_exists": PATH, "xid": 79}],
                          "events_error": "NO_PERMISSION",
                          "mig_devices": [{"uuid": "MIG-...", "gpu_instance_id": 1,
                                           "memory_total_bytes": B,
                                           "memory_used_bytes": [B, ...]}],
                          "block": {"call": "nvmlDeviceGetFieldValues",
                                    "from_sample": 3, "seconds": 30}}]}

        ``series`` also takes the GPM series (``sm_active_pct``, ...) and the health
        series (``ecc_dbe_volatile_total``, ``row_remap_pending``,
        ``clocks_event_reasons``, ...) of :class:`FakeDevice`; a process may carry
        ``sm_util_pct`` (``[pid, used, sm_util]``). ``block`` makes that call hang once
        for ``seconds`` (or until ``devices[i].release()``).

        ``init_error`` / ``lost_code`` / ``event_wait_error`` / ``events_error`` take a
        code or its name with or without the ``NVML_ERROR_`` prefix. ``xids`` raise Xid
        ``xid`` once the device has played sample ``sample`` (0-based; the sampler reads
        one sample per tick, so a daemon sees it on that tick); ``file_exists`` ones once a
        file exists at ``PATH`` (a test creates it when its scenario is ready: see
        :class:`FakeDevice`'s ``xid_files``). Raises ``ValueError``
        naming the bad key or value.
        """
        devices, options = script_devices(script)
        return cls(devices, **options)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> FakeNvml:
        """:meth:`from_script` of a JSON file."""
        with open(path, encoding="utf-8") as stream:
            return cls.from_script(json.load(stream))

    # -- the pynvml functions --------------------------------------------------------

    def _device(self, handle: object) -> FakeDevice:
        if self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, FakeDevice) or (
            handle not in self.devices and handle.parent not in self.devices
        ):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return handle

    def _enter(self, call: str, handle: object) -> FakeDevice:
        """Count ``call`` (thread-safe: the sampler calls from one thread per device),
        check ``handle`` and block where :meth:`FakeDevice.block` says so."""
        with self._lock:
            self.calls[call] += 1
        device = self._device(handle)
        device.wait_if_blocked(call)
        return device

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
        return ERROR_TEXT.get(result, f"NVML Error with code {result}")

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
        device = self._enter("nvmlDeviceGetUUID", handle)
        device.check()
        return device.uuid

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str:
        """Product name."""
        device = self._enter("nvmlDeviceGetName", handle)
        device.check()
        return device.name

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> FakeUtilization:
        """Utilization in percent; advances the device to its next sample."""
        device = self._enter("nvmlDeviceGetUtilizationRates", handle)
        device.sample_number += 1
        return FakeUtilization(round(device.value("utilization.gpu")))

    def nvmlDeviceGetMemoryInfo(
        self, handle: FakeDevice, version: int | None = None
    ) -> FakeMemory | FakeMemoryV2:
        """Memory in bytes: ``FakeMemory`` (v1), or ``FakeMemoryV2`` with
        ``version=nvmlMemory_v2`` (pynvml returns ``c_nvmlMemory_t`` / ``c_nvmlMemory_v2_t``)."""
        device = self._enter("nvmlDeviceGetMemoryInfo", handle)
        if version:
            if not self.memory_v2:
                raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
            if version != nvmlMemory_v2:
                raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        used = int(device.value("memory.used"))
        total = device.memory_total_bytes
        free = max(total - used, 0)
        if version:
            return FakeMemoryV2(version=version, total=total, reserved=0, free=free, used=used)
        return FakeMemory(total=total, free=free, used=used)

    def nvmlDeviceGetTemperature(self, handle: FakeDevice, sensor: int) -> int:
        """Temperature in °C of ``sensor`` (only ``NVML_TEMPERATURE_GPU``)."""
        device = self._enter("nvmlDeviceGetTemperature", handle)
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return round(device.value("temperature.gpu"))

    def nvmlDeviceGetPowerUsage(self, handle: FakeDevice) -> int:
        """Power draw in milliwatts (NVML's unit)."""
        device = self._enter("nvmlDeviceGetPowerUsage", handle)
        return round(device.value("power.draw") * 1000)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[FakeProcessInfo]:
        """Processes with a compute context on the device."""
        device = self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        device.check()
        if "processes" in device.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return [FakeProcessInfo(pid, used) for pid, used, _ in device.processes]

    def nvmlDeviceGetProcessUtilization(
        self, handle: FakeDevice, timeStamp: int
    ) -> list[FakeProcessUtilizationSample]:
        """One sample per scripted ``sm_util_pct`` process per device sample up to the
        current one, those newer than ``timeStamp`` (µs); raises ``NOT_FOUND`` when there
        is none (as NVML does when no process ran since), ``NOT_SUPPORTED`` for
        ``unsupported=["process_utilization"]``."""
        device = self._enter("nvmlDeviceGetProcessUtilization", handle)
        device.check()
        if "process_utilization" in device.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        samples = []
        for k in range(max(device.sample_number, 0) + 1):
            stamp = TIMESTAMP_BASE_US + k * 1_000_000
            if stamp <= timeStamp:
                continue
            for pid, _, sm_util in device.processes:
                if sm_util is not None:
                    samples.append(FakeProcessUtilizationSample(pid, stamp, round(sm_util)))
        if not samples:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return samples

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeDevice) -> int:
        """The ``nvmlClocksEventReason*`` bit mask (series ``clocks_event_reasons``)."""
        device = self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle)
        return int(device.value("clocks_event_reasons"))

    def nvmlDeviceGetFieldValues(
        self, handle: FakeDevice, fieldIds: Sequence[int | tuple[int, int]]
    ) -> list[FakeFieldValue]:
        """One ``FakeFieldValue`` per id (or ``(id, scopeId)``), as unsigned long long;
        an id the fake does not know, or a series that is None or unsupported, gets
        ``nvmlReturn`` ``NOT_SUPPORTED`` (the call itself succeeds, as NVML's does)."""
        device = self._enter("nvmlDeviceGetFieldValues", handle)
        device.check()
        stamp = TIMESTAMP_BASE_US + max(device.sample_number, 0) * 1_000_000
        out = []
        for item in fieldIds:
            field_id, scope = item if isinstance(item, tuple) else (item, 0)
            series = _FIELD_SERIES.get(int(field_id))
            got = None if series is None else device.maybe(series)
            if got is None:
                out.append(
                    FakeFieldValue(int(field_id), int(scope), nvmlReturn=NVML_ERROR_NOT_SUPPORTED)
                )
                continue
            number = int(got)
            value = FakeValue(float(number), number, number, number, number, number, number)
            out.append(
                FakeFieldValue(
                    int(field_id),
                    int(scope),
                    timestamp=stamp,
                    valueType=_codes.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
                    nvmlReturn=NVML_SUCCESS,
                    value=value,
                )
            )
        return out

    # -- GPM -------------------------------------------------------------------------

    c_nvmlGpmMetricsGet_t = FakeGpmMetricsGet

    def nvmlGpmQueryDeviceSupport(self, device: FakeDevice) -> FakeGpmSupport:
        """``isSupportedDevice`` 1, or 0 for ``unsupported=["gpm"]`` (pre-Hopper)."""
        fake = self._enter("nvmlGpmQueryDeviceSupport", device)
        fake.check()
        return FakeGpmSupport(
            _codes.NVML_GPM_SUPPORT_VERSION, 0 if "gpm" in fake.unsupported else 1
        )

    def nvmlGpmSampleAlloc(self) -> FakeGpmSample:
        """A new GPM sample buffer (kept in :attr:`gpm_samples` to check it is freed)."""
        with self._lock:
            self.calls["nvmlGpmSampleAlloc"] += 1
            sample = FakeGpmSample()
            self.gpm_samples.append(sample)
        if self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return sample

    def nvmlGpmSampleFree(self, gpmSample: FakeGpmSample) -> None:
        """Free a sample buffer (a freed one answers ``INVALID_ARGUMENT`` from then on)."""
        with self._lock:
            self.calls["nvmlGpmSampleFree"] += 1
        if not isinstance(gpmSample, FakeGpmSample) or gpmSample.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpmSample.freed = True

    def nvmlGpmSampleGet(self, device: FakeDevice, gpmSample: FakeGpmSample) -> FakeGpmSample:
        """Fill ``gpmSample`` with the device's current GPM values; returns it."""
        fake = self._enter("nvmlGpmSampleGet", device)
        fake.check()
        if "gpm" in fake.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not isinstance(gpmSample, FakeGpmSample) or gpmSample.freed:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpmSample.device = fake
        gpmSample.sample_number = fake.sample_number
        gpmSample.values = {name: fake.maybe(name) for name in GPM_SERIES}
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: FakeGpmMetricsGet) -> FakeGpmMetricsGet:
        """Fill ``metrics[:numMetrics]`` from ``sample2``'s values (a metric the fake
        does not play, or a None value, gets ``nvmlReturn`` ``NOT_SUPPORTED``); returns
        ``metricsGet``. Raises ``ARGUMENT_VERSION_MISMATCH`` for a wrong ``version``,
        ``INVALID_ARGUMENT`` for samples not taken, freed, of two devices or out of order.
        """
        with self._lock:
            self.calls["nvmlGpmMetricsGet"] += 1
        if self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if metricsGet.version != _codes.NVML_GPM_METRICS_GET_VERSION:
            raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first, second = metricsGet.sample1, metricsGet.sample2
        for sample in (first, second):
            if not isinstance(sample, FakeGpmSample) or sample.freed or sample.device is None:
                raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        assert isinstance(first, FakeGpmSample) and isinstance(second, FakeGpmSample)
        if first.device is not second.device or first.sample_number > second.sample_number:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        assert second.device is not None
        second.device.wait_if_blocked("nvmlGpmMetricsGet")
        for metric in metricsGet.metrics[: metricsGet.numMetrics]:
            name = _GPM_METRIC_SERIES.get(int(metric.metricId))
            value = None if name is None else second.values.get(name)
            if value is None:
                metric.nvmlReturn, metric.value = NVML_ERROR_NOT_SUPPORTED, 0.0
            else:
                metric.nvmlReturn, metric.value = NVML_SUCCESS, float(value)
        return metricsGet

    # -- MIG -------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, device: FakeDevice) -> list[int]:
        """``[current, pending]``: 1 with ``mig_devices``, else 0; ``NOT_SUPPORTED`` for
        ``unsupported=["mig"]`` (a GPU without MIG)."""
        fake = self._enter("nvmlDeviceGetMigMode", device)
        fake.check()
        if "mig" in fake.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        mode = _codes.NVML_DEVICE_MIG_ENABLE if fake.mig_devices else 0
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: FakeDevice) -> int:
        """7 slots in MIG mode (an H100's maximum), else 0."""
        fake = self._enter("nvmlDeviceGetMaxMigDeviceCount", device)
        fake.check()
        return max(7, len(fake.mig_devices)) if fake.mig_devices else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: FakeDevice, index: int) -> FakeDevice:
        """The MIG device in slot ``index``; ``NOT_FOUND`` for an empty slot."""
        fake = self._enter("nvmlDeviceGetMigDeviceHandleByIndex", device)
        fake.check()
        if not 0 <= index < len(fake.mig_devices):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return fake.mig_devices[index]

    def nvmlDeviceGetGpuInstanceId(self, device: FakeDevice) -> int:
        """A MIG device's GPU instance id; ``INVALID_ARGUMENT`` for a whole GPU."""
        fake = self._enter("nvmlDeviceGetGpuInstanceId", device)
        fake.check()
        if fake.gpu_instance_id is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return fake.gpu_instance_id

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
        device = self._enter("nvmlDeviceRegisterEvents", handle)
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
            for path, xid in [f for f in device.xid_files if os.path.exists(f[0])]:
                device.xid_files.remove((path, xid))
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


_FIELD_SERIES: Mapping[int, str] = {
    _codes.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: "ecc_sbe_volatile_total",
    _codes.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: "ecc_dbe_volatile_total",
    _codes.NVML_FI_DEV_REMAPPED_COR: "remapped_rows_correctable",
    _codes.NVML_FI_DEV_REMAPPED_UNC: "remapped_rows_uncorrectable",
    _codes.NVML_FI_DEV_REMAPPED_PENDING: "row_remap_pending",
    _codes.NVML_FI_DEV_REMAPPED_FAILURE: "row_remap_failure",
}
"""Field id -> the series that plays it."""

_GPM_METRIC_SERIES: Mapping[int, str] = {
    _codes.NVML_GPM_METRIC_SM_UTIL: "sm_active_pct",
    _codes.NVML_GPM_METRIC_SM_OCCUPANCY: "sm_occupancy_pct",
    _codes.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "tensor_active_pct",
    _codes.NVML_GPM_METRIC_DRAM_BW_UTIL: "dram_active_pct",
}
"""GPM metric id -> the series that plays it."""


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
