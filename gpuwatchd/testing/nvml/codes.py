"""NVML return codes, constants and ``NVMLError`` with the values and texts of pynvml.

Specification: docs/modules.md#gpuwatchdtestingnvml
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

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
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: Final = 22
NVML_ERROR_INSUFFICIENT_RESOURCES: Final = 23
NVML_ERROR_FREQ_NOT_SUPPORTED: Final = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH: Final = 25
NVML_ERROR_DEPRECATED: Final = 26
NVML_ERROR_NOT_READY: Final = 27
NVML_ERROR_GPU_NOT_FOUND: Final = 28
NVML_ERROR_INVALID_STATE: Final = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: Final = 30
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

# Field ids of nvmlDeviceGetFieldValues (nvml.h "Field Value Enums" / pynvml).
NVML_FI_DEV_ECC_SBE_VOL_TOTAL: Final = 3
NVML_FI_DEV_ECC_DBE_VOL_TOTAL: Final = 4
NVML_FI_DEV_REMAPPED_COR: Final = 142
NVML_FI_DEV_REMAPPED_UNC: Final = 143
NVML_FI_DEV_REMAPPED_PENDING: Final = 144
NVML_FI_DEV_REMAPPED_FAILURE: Final = 145
# nvmlValueType_t: which member of c_nvmlValue_t holds a field value.
NVML_VALUE_TYPE_DOUBLE: Final = 0
NVML_VALUE_TYPE_UNSIGNED_INT: Final = 1
NVML_VALUE_TYPE_UNSIGNED_LONG: Final = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: Final = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG: Final = 4
NVML_VALUE_TYPE_SIGNED_INT: Final = 5
NVML_VALUE_TYPE_UNSIGNED_SHORT: Final = 6
# GPM (nvml.h "GPM"): struct versions and the metric ids gpuwatchd reads.
NVML_GPM_SUPPORT_VERSION: Final = 1
NVML_GPM_METRICS_GET_VERSION: Final = 1
NVML_GPM_METRIC_SM_UTIL: Final = 2
NVML_GPM_METRIC_SM_OCCUPANCY: Final = 3
NVML_GPM_METRIC_ANY_TENSOR_UTIL: Final = 5
NVML_GPM_METRIC_DRAM_BW_UTIL: Final = 10
NVML_GPM_METRIC_MAX: Final = 477
"""Entries of ``c_nvmlGpmMetricsGet_t.metrics`` in the pynvml this fake follows
(nvidia-ml-py 13.x; the H100 run's 13.610 had 333)."""
# MIG mode (nvmlDeviceGetMigMode's current/pending).
NVML_DEVICE_MIG_DISABLE: Final = 0
NVML_DEVICE_MIG_ENABLE: Final = 1
# Clock event (throttle) reason bits of nvmlDeviceGetCurrentClocksEventReasons.
nvmlClocksEventReasonNone: Final = 0x0
nvmlClocksEventReasonGpuIdle: Final = 0x1
nvmlClocksEventReasonApplicationsClocksSetting: Final = 0x2
nvmlClocksEventReasonSwPowerCap: Final = 0x4
nvmlClocksEventReasonHwSlowdown: Final = 0x8
nvmlClocksEventReasonSyncBoost: Final = 0x10
nvmlClocksEventReasonSwThermalSlowdown: Final = 0x20
nvmlClocksEventReasonHwThermalSlowdown: Final = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown: Final = 0x80
nvmlClocksEventReasonDisplayClockSetting: Final = 0x100
NO_INSTANCE: Final = 0xFFFFFFFF
"""``gpuInstanceId``/``computeInstanceId`` of an event outside MIG (pynvml's ``~0``)."""

ERROR_TEXT: Final[Mapping[int, str]] = {  # pynvml's NVMLError._errcode_to_string
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
"""NVML error code -> the text pynvml's ``NVMLError`` gives it (``str(error)``)."""
_ERROR_CODES: Final[Mapping[str, int]] = {
    name[len("NVML_ERROR_") :]: value
    for name, value in dict(globals()).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}


class NVMLError(Exception):
    """pynvml's exception: ``value`` is the NVML return code, ``str()`` its text."""

    def __init__(self, value: int) -> None:
        self.value = value
        super().__init__(value)

    def __str__(self) -> str:
        return ERROR_TEXT.get(self.value, f"NVML Error with code {self.value}")

    def __repr__(self) -> str:
        return f"NVMLError({self.value})"


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
