"""Ask real NVML every question issue 22 names and keep the answers as plain JSON.

For each GPU: the calls the sampler makes today, the ones the DCGM-like fields need
(GPM SM activity/occupancy/tensor activity, per-process utilization, ECC, remapped
rows, clock event reasons, MIG, batched field values) and the Xid event API. Each
answer is ``{"value": ..., "us": [median, min]}`` or ``{"error": {"code", "name",
"text"}}`` or ``{"missing": true}`` (the bindings lack the function), so a fake can be
scripted from it and held to it. Struct field names and ctypes types are listed under
``"structs"``. Runs against any module shaped like ``pynvml`` (the battery also runs it
on ``gpuwatchd.testing``'s FakeNvml).

    python bench/gpu/nvml_probe.py --out probe.json [--label idle]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

REPEAT = 20
"""Calls per timed question (median and minimum are kept, in microseconds)."""

FIELD_NAMES = (
    "NVML_FI_DEV_ECC_SBE_VOL_TOTAL",
    "NVML_FI_DEV_ECC_DBE_VOL_TOTAL",
    "NVML_FI_DEV_ECC_SBE_AGG_TOTAL",
    "NVML_FI_DEV_ECC_DBE_AGG_TOTAL",
    "NVML_FI_DEV_REMAPPED_COR",
    "NVML_FI_DEV_REMAPPED_UNC",
    "NVML_FI_DEV_REMAPPED_PENDING",
    "NVML_FI_DEV_REMAPPED_FAILURE",
    "NVML_FI_DEV_MEMORY_TEMP",
    "NVML_FI_DEV_POWER_INSTANT",
    "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "NVML_FI_DEV_PCIE_REPLAY_COUNTER",
    "NVML_FI_DEV_PERF_POLICY_POWER",
    "NVML_FI_DEV_PERF_POLICY_THERMAL",
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN",
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN",
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN",
    "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
)
"""``nvmlDeviceGetFieldValues`` field ids (pynvml names; NVML API reference, "Field Value
Enums"), read in one batched call."""

GPM_METRICS = (
    "NVML_GPM_METRIC_GRAPHICS_UTIL",
    "NVML_GPM_METRIC_SM_UTIL",
    "NVML_GPM_METRIC_SM_OCCUPANCY",
    "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
    "NVML_GPM_METRIC_DRAM_BW_UTIL",
    "NVML_GPM_METRIC_FP16_UTIL",
    "NVML_GPM_METRIC_FP32_UTIL",
    "NVML_GPM_METRIC_FP64_UTIL",
    "NVML_GPM_METRIC_INTEGER_UTIL",
)
"""GPM metrics read from two samples ``GPM_INTERVAL_S`` apart (NVML API reference, "GPM")."""

GPM_INTERVAL_S = 0.2

STRUCTS = (
    "c_nvmlMemory_t",
    "c_nvmlMemory_v2_t",
    "c_nvmlUtilization_t",
    "c_nvmlProcessInfo_t",
    "c_nvmlProcessInfo_v2_t",
    "c_nvmlProcessInfo_v3_t",
    "c_nvmlProcessUtilizationSample_t",
    "c_nvmlEventData_t",
    "c_nvmlFieldValue_t",
    "c_nvmlValue_t",
    "c_nvmlGpmMetric_t",
    "c_nvmlGpmMetricsGet_t",
    "c_nvmlGpmSupport_t",
    "c_nvmlPciInfo_t",
)


def plain(value: Any, depth: int = 0) -> Any:
    """A JSON-able copy of an NVML answer: ctypes structs and unions as dicts of their
    fields (``"_type"`` names the class), arrays and lists as lists, bytes as text."""
    if depth > 6:
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (ctypes.Structure, ctypes.Union)):
        out: dict[str, Any] = {"_type": type(value).__name__}
        for field in type(value)._fields_:
            name, kind = field[0], field[1]
            if isinstance(kind, type) and issubclass(kind, ctypes._Pointer):
                out[name] = "<pointer>"
                continue
            if isinstance(kind, type) and issubclass(kind, ctypes.Array) and depth > 0:
                out[name] = "<array>"
                continue
            out[name] = plain(getattr(value, name), depth + 1)
        return out
    if isinstance(value, (list, tuple, ctypes.Array)):
        return [plain(item, depth + 1) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    if hasattr(value, "__dict__") and not callable(value):
        return {k: plain(v, depth + 1) for k, v in vars(value).items() if not k.startswith("_")}
    return repr(value)


def struct_fields(nvml: Any) -> dict[str, Any]:
    """``{struct name: [[field, ctypes type name], ...]}`` of the structs NVML answers
    with, or ``None`` where the module lacks the struct."""
    out: dict[str, Any] = {}
    for name in STRUCTS:
        cls = getattr(nvml, name, None)
        fields = getattr(cls, "_fields_", None)
        out[name] = (
            None
            if fields is None
            else [[f[0], getattr(f[1], "__name__", repr(f[1]))] for f in fields]
        )
    return out


class Asker:
    """Calls NVML functions by name, timing them, never raising."""

    def __init__(self, nvml: Any, repeat: int = REPEAT) -> None:
        self.nvml = nvml
        self.repeat = repeat

    def error(self, exc: BaseException) -> dict[str, Any]:
        code = getattr(exc, "value", None)
        try:
            text = str(exc)
        except Exception:  # str() of an NVMLError can call back into NVML
            text = ""
        return {"code": code, "name": type(exc).__name__, "text": text}

    def ask(self, name: str, *args: Any, timed: bool = True, **kwargs: Any) -> dict[str, Any]:
        fn: Callable[..., Any] | None = getattr(self.nvml, name, None)
        if fn is None:
            return {"missing": True}
        times: list[float] = []
        result: Any = None
        for _ in range(self.repeat if timed else 1):
            started = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                return {"error": self.error(exc)}
            times.append((time.perf_counter() - started) * 1e6)
        return {
            "value": plain(result),
            "us": [round(statistics.median(times), 1), round(min(times), 1)],
        }

    def raw(self, name: str, *args: Any) -> Any:
        """The unconverted answer (or the exception) of one call."""
        fn = getattr(self.nvml, name, None)
        if fn is None:
            return AttributeError(name)
        try:
            return fn(*args)
        except Exception as exc:
            return exc


def gpm(asker: Asker, handle: Any) -> dict[str, Any]:
    """GPM support and the :data:`GPM_METRICS` over two samples :data:`GPM_INTERVAL_S`
    apart: ``{"support": ..., "metrics": {name: {"value", "nvmlReturn"}}, "us": ...}``."""
    nvml = asker.nvml
    out: dict[str, Any] = {"support": asker.ask("nvmlGpmQueryDeviceSupport", handle, timed=False)}
    needed = (
        "nvmlGpmSampleAlloc",
        "nvmlGpmSampleGet",
        "nvmlGpmMetricsGet",
        "c_nvmlGpmMetricsGet_t",
    )
    if any(getattr(nvml, n, None) is None for n in needed):
        out["metrics"] = {"missing": True}
        return out
    samples: list[Any] = []
    try:
        samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
        started = time.perf_counter()
        nvml.nvmlGpmSampleGet(handle, samples[0])
        sample_us = (time.perf_counter() - started) * 1e6
        time.sleep(GPM_INTERVAL_S)
        nvml.nvmlGpmSampleGet(handle, samples[1])
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        ids = [(name, getattr(nvml, name, None)) for name in GPM_METRICS]
        ids = [(name, value) for name, value in ids if value is not None]
        request.numMetrics = len(ids)
        request.sample1 = samples[0]
        request.sample2 = samples[1]
        for i, (_, metric_id) in enumerate(ids):
            request.metrics[i].metricId = metric_id
        started = time.perf_counter()
        answer = nvml.nvmlGpmMetricsGet(request)
        metrics_us = (time.perf_counter() - started) * 1e6
        out["metrics"] = {
            name: {
                "value": float(answer.metrics[i].value),
                "nvmlReturn": int(answer.metrics[i].nvmlReturn),
            }
            for i, (name, _) in enumerate(ids)
        }
        out["us"] = {
            "nvmlGpmSampleGet": round(sample_us, 1),
            "nvmlGpmMetricsGet": round(metrics_us, 1),
        }
    except Exception as exc:
        out["metrics"] = {"error": asker.error(exc)}
    finally:
        for sample in samples:
            with contextlib.suppress(Exception):
                nvml.nvmlGpmSampleFree(sample)
    return out


def field_values(asker: Asker, handle: Any) -> dict[str, Any]:
    """The :data:`FIELD_NAMES` in one ``nvmlDeviceGetFieldValues`` call: per field its
    ``nvmlReturn``, ``valueType`` and every member of the value union."""
    nvml = asker.nvml
    ids = [(name, getattr(nvml, name, None)) for name in FIELD_NAMES]
    known = [(name, value) for name, value in ids if value is not None]
    out: dict[str, Any] = {"absent_from_bindings": [name for name, value in ids if value is None]}
    answer = asker.ask("nvmlDeviceGetFieldValues", handle, [v for _, v in known])
    if "value" not in answer:
        out["call"] = answer
        return out
    out["us"] = answer["us"]
    out["fields"] = {name: entry for (name, _), entry in zip(known, answer["value"], strict=False)}
    return out


def clock_reason_names(nvml: Any) -> dict[str, int]:
    """The module's clock event (throttle) reason bit names and values."""
    prefixes = ("nvmlClocksEventReason", "nvmlClocksThrottleReason")
    return {
        name: int(getattr(nvml, name))
        for name in dir(nvml)
        if name.startswith(prefixes) and isinstance(getattr(nvml, name), int)
    }


def xid_api(asker: Asker, handles: list[Any]) -> dict[str, Any]:
    """Event set create, supported types, registration and one non-blocking wait."""
    nvml = asker.nvml
    out: dict[str, Any] = {}
    event_set = asker.raw("nvmlEventSetCreate")
    if isinstance(event_set, BaseException):
        out["nvmlEventSetCreate"] = {"error": asker.error(event_set)}
        return out
    xid = getattr(nvml, "nvmlEventTypeXidCriticalError", None)
    for index, handle in enumerate(handles):
        out[f"nvmlDeviceGetSupportedEventTypes[{index}]"] = asker.ask(
            "nvmlDeviceGetSupportedEventTypes", handle, timed=False
        )
        out[f"nvmlDeviceRegisterEvents[{index}]"] = asker.ask(
            "nvmlDeviceRegisterEvents", handle, xid, event_set, timed=False
        )
    wait = "nvmlEventSetWait_v2" if hasattr(nvml, "nvmlEventSetWait_v2") else "nvmlEventSetWait"
    out[wait] = asker.ask(wait, event_set, 0, timed=False)
    asker.ask("nvmlEventSetFree", event_set, timed=False)
    return out


def device(asker: Asker, index: int) -> dict[str, Any]:
    """Every question about GPU ``index``."""
    nvml = asker.nvml
    handle = asker.raw("nvmlDeviceGetHandleByIndex", index)
    if isinstance(handle, BaseException):
        return {"nvmlDeviceGetHandleByIndex": {"error": asker.error(handle)}}
    ask = asker.ask
    const = lambda name: getattr(nvml, name, None)  # noqa: E731
    out: dict[str, Any] = {
        "nvmlDeviceGetName": ask("nvmlDeviceGetName", handle),
        "nvmlDeviceGetUUID": ask("nvmlDeviceGetUUID", handle),
        "nvmlDeviceGetPciInfo": ask("nvmlDeviceGetPciInfo", handle, timed=False),
        "nvmlDeviceGetCudaComputeCapability": ask(
            "nvmlDeviceGetCudaComputeCapability", handle, timed=False
        ),
        "nvmlDeviceGetArchitecture": ask("nvmlDeviceGetArchitecture", handle, timed=False),
        # the sampler's five reads per tick
        "nvmlDeviceGetUtilizationRates": ask("nvmlDeviceGetUtilizationRates", handle),
        "nvmlDeviceGetMemoryInfo": ask("nvmlDeviceGetMemoryInfo", handle),
        "nvmlDeviceGetMemoryInfo(version=nvmlMemory_v2)": (
            ask("nvmlDeviceGetMemoryInfo", handle, version=const("nvmlMemory_v2"))
            if const("nvmlMemory_v2") is not None
            else {"missing": True}
        ),
        "nvmlDeviceGetTemperature": ask(
            "nvmlDeviceGetTemperature", handle, const("NVML_TEMPERATURE_GPU")
        ),
        "nvmlDeviceGetPowerUsage": ask("nvmlDeviceGetPowerUsage", handle),
        "nvmlDeviceGetComputeRunningProcesses": ask("nvmlDeviceGetComputeRunningProcesses", handle),
        # what issue 22 adds
        "nvmlDeviceGetProcessUtilization": ask("nvmlDeviceGetProcessUtilization", handle, 0),
        "nvmlDeviceGetEnforcedPowerLimit": ask(
            "nvmlDeviceGetEnforcedPowerLimit", handle, timed=False
        ),
        "nvmlDeviceGetEccMode": ask("nvmlDeviceGetEccMode", handle, timed=False),
        "nvmlDeviceGetTotalEccErrors(UNCORRECTED,VOLATILE)": ask(
            "nvmlDeviceGetTotalEccErrors",
            handle,
            const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED"),
            const("NVML_VOLATILE_ECC"),
        ),
        "nvmlDeviceGetTotalEccErrors(CORRECTED,VOLATILE)": ask(
            "nvmlDeviceGetTotalEccErrors",
            handle,
            const("NVML_MEMORY_ERROR_TYPE_CORRECTED"),
            const("NVML_VOLATILE_ECC"),
        ),
        "nvmlDeviceGetRemappedRows": ask("nvmlDeviceGetRemappedRows", handle),
        "nvmlDeviceGetRetiredPagesPendingStatus": ask(
            "nvmlDeviceGetRetiredPagesPendingStatus", handle, timed=False
        ),
        "nvmlDeviceGetCurrentClocksEventReasons": ask(
            "nvmlDeviceGetCurrentClocksEventReasons", handle
        ),
        "nvmlDeviceGetCurrentClocksThrottleReasons": ask(
            "nvmlDeviceGetCurrentClocksThrottleReasons", handle, timed=False
        ),
        "nvmlDeviceGetClockInfo(SM)": ask("nvmlDeviceGetClockInfo", handle, const("NVML_CLOCK_SM")),
        "nvmlDeviceGetMaxClockInfo(SM)": ask(
            "nvmlDeviceGetMaxClockInfo", handle, const("NVML_CLOCK_SM"), timed=False
        ),
        "nvmlDeviceGetPerformanceState": ask("nvmlDeviceGetPerformanceState", handle),
        "nvmlDeviceGetTotalEnergyConsumption": ask("nvmlDeviceGetTotalEnergyConsumption", handle),
        "nvmlDeviceGetPcieReplayCounter": ask(
            "nvmlDeviceGetPcieReplayCounter", handle, timed=False
        ),
        "nvmlDeviceGetMigMode": ask("nvmlDeviceGetMigMode", handle, timed=False),
        "nvmlDeviceGetMaxMigDeviceCount": ask(
            "nvmlDeviceGetMaxMigDeviceCount", handle, timed=False
        ),
        "nvmlDeviceIsMigDeviceHandle": ask("nvmlDeviceIsMigDeviceHandle", handle, timed=False),
        "field_values": field_values(asker, handle),
        "gpm": gpm(asker, handle),
    }
    mig = out["nvmlDeviceGetMigMode"].get("value")
    if isinstance(mig, list) and mig and mig[0] == 1:
        instances = []
        count = out["nvmlDeviceGetMaxMigDeviceCount"].get("value") or 0
        for i in range(int(count)):
            mig_handle = asker.raw("nvmlDeviceGetMigDeviceHandleByIndex", handle, i)
            if isinstance(mig_handle, BaseException):
                instances.append(
                    {"nvmlDeviceGetMigDeviceHandleByIndex": {"error": asker.error(mig_handle)}}
                )
                continue
            instances.append(
                {
                    "nvmlDeviceGetUUID": ask("nvmlDeviceGetUUID", mig_handle, timed=False),
                    "nvmlDeviceGetGpuInstanceId": ask(
                        "nvmlDeviceGetGpuInstanceId", mig_handle, timed=False
                    ),
                    "nvmlDeviceGetMemoryInfo": ask(
                        "nvmlDeviceGetMemoryInfo", mig_handle, timed=False
                    ),
                    "nvmlDeviceGetUtilizationRates": ask(
                        "nvmlDeviceGetUtilizationRates", mig_handle, timed=False
                    ),
                }
            )
        out["mig_devices"] = instances
    return out


def probe(nvml: Any, label: str = "", repeat: int = REPEAT) -> dict[str, Any]:
    """Initialise NVML, ask everything of every GPU, shut NVML down; the answers."""
    asker = Asker(nvml, repeat)
    report: dict[str, Any] = {"label": label, "repeat": repeat}
    init = asker.ask("nvmlInit", timed=False)
    report["nvmlInit"] = init
    if "error" in init or "missing" in init:
        return report
    try:
        report["system"] = {
            name: asker.ask(name, timed=False)
            for name in (
                "nvmlSystemGetDriverVersion",
                "nvmlSystemGetNVMLVersion",
                "nvmlSystemGetCudaDriverVersion",
            )
        }
        count = asker.ask("nvmlDeviceGetCount", timed=False)
        report["nvmlDeviceGetCount"] = count
        n = int(count.get("value") or 0)
        report["devices"] = [device(asker, i) for i in range(n)]
        handles = [asker.raw("nvmlDeviceGetHandleByIndex", i) for i in range(n)]
        report["xid_api"] = xid_api(asker, [h for h in handles if not isinstance(h, BaseException)])
        report["clock_event_reasons"] = clock_reason_names(nvml)
        report["structs"] = struct_fields(nvml)
    finally:
        asker.ask("nvmlShutdown", timed=False)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="")
    parser.add_argument("--fake", action="store_true", help="ask gpuwatchd's FakeNvml (2 H100s)")
    args = parser.parse_args()
    if args.fake:
        from gpuwatchd.testing.nvml import FakeNvml

        nvml: Any = FakeNvml.h100s(2)
    else:
        import pynvml

        nvml = pynvml
    report = probe(nvml, args.label)
    with open(args.out, "w", encoding="utf-8") as out:
        json.dump(report, out, indent=1, sort_keys=True)
    print(f"probe {args.label or '-'}: {len(report.get('devices', []))} device(s) -> {args.out}")
    return 0 if "devices" in report else 1


if __name__ == "__main__":
    sys.exit(main())
