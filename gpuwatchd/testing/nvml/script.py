"""Building fake GPUs: ``h100s``, a real nvidia-smi trace, or a JSON-able script.

The builders behind :meth:`FakeNvml.h100s`, :meth:`FakeNvml.from_trace` and
:meth:`FakeNvml.from_script`. Specification: docs/modules.md#gpuwatchdtestingnvml
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatchd.testing.nvml.codes import NVML_ERROR_GPU_IS_LOST, error_code
from gpuwatchd.testing.nvml.device import DEFAULT_MEMORY_TOTAL_BYTES, DEFAULT_NAME, FakeDevice


def h100_devices(
    n: int,
    *,
    utilization_pct: float | Sequence[float | None] = 0.0,
    memory_used_bytes: float | Sequence[float | None] = 0,
    temperature_c: float | Sequence[float | None] = 35.0,
    power_draw_w: float | Sequence[float | None] = 70.0,
    memory_total_bytes: int = DEFAULT_MEMORY_TOTAL_BYTES,
) -> list[FakeDevice]:
    """The devices of :meth:`~gpuwatchd.testing.nvml.FakeNvml.h100s` (see there)."""

    def as_series(value: float | Sequence[float | None]) -> Sequence[float | None]:
        return [float(value)] if isinstance(value, (int, float)) else list(value)

    series = {
        "utilization.gpu": as_series(utilization_pct),
        "memory.used": as_series(memory_used_bytes),
        "temperature.gpu": as_series(temperature_c),
        "power.draw": as_series(power_draw_w),
    }
    return [
        FakeDevice(
            f"GPU-00000000-0000-0000-0000-{i:012d}",
            memory_total_bytes=memory_total_bytes,
            series=series,
        )
        for i in range(n)
    ]


def trace_devices(
    path: str | os.PathLike[str],
    gpus: int | None = None,
    *,
    memory_total_bytes: int = DEFAULT_MEMORY_TOTAL_BYTES,
) -> list[FakeDevice]:
    """The devices of :meth:`~gpuwatchd.testing.nvml.FakeNvml.from_trace` (see there)."""
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
    return devices


def script_devices(script: Mapping[str, Any]) -> tuple[list[FakeDevice], dict[str, Any]]:
    """The devices and the other ``FakeNvml`` arguments of a script.

    See :meth:`~gpuwatchd.testing.nvml.FakeNvml.from_script` for the format; raises
    ``ValueError`` naming the bad key or value.
    """
    if not isinstance(script, Mapping):
        raise ValueError(f"a fake NVML script is a JSON object, got {type(script).__name__}")
    if "trace" in script:
        _check_keys(script, {"trace", "gpus", "memory_total_bytes"}, "script")
        devices = trace_devices(
            str(script["trace"]),
            script.get("gpus"),
            memory_total_bytes=int(script.get("memory_total_bytes",
                                              DEFAULT_MEMORY_TOTAL_BYTES)),
        )  # fmt: skip
        return devices, {}
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
    return devices, {
        "init_error": None if init_error is None else error_code(init_error),
        "memory_v2": bool(script.get("memory_v2", True)),
        "driver_version": str(script.get("driver_version", "550.54.15")),
        "event_wait_error": None if wait_error is None else error_code(wait_error),
        "init_failures": None if script.get("init_failures") is None
        else int(script["init_failures"]),
    }  # fmt: skip


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
         "lost_until", "lost_code", "unsupported", "xids", "events_error", "mig_devices",
         "block"},
        where,
    )  # fmt: skip
    processes: list[tuple[int, int | None, float | None]] = []
    for proc in spec.get("processes", []):
        if isinstance(proc, Mapping):
            _check_keys(proc, {"pid", "used_gpu_memory_bytes", "sm_util_pct"}, f"{where}.processes")
            used = proc.get("used_gpu_memory_bytes")
            sm = proc.get("sm_util_pct")
            processes.append(
                (
                    int(proc["pid"]),
                    None if used is None else int(used),
                    None if sm is None else float(sm),
                )
            )
        else:
            pid, used, *rest = proc
            sm = rest[0] if rest else None
            processes.append(
                (int(pid), None if used is None else int(used), None if sm is None else float(sm))
            )
    mig: list[FakeDevice] = []
    for j, item in enumerate(spec.get("mig_devices", [])):
        at = f"{where}.mig_devices[{j}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{at} must be an object")
        _check_keys(
            item, {"uuid", "gpu_instance_id", "memory_total_bytes", "memory_used_bytes"}, at
        )
        used_series = item.get("memory_used_bytes", [0])
        if not isinstance(used_series, list):
            used_series = [used_series]
        mig.append(
            FakeDevice(
                str(item.get("uuid", f"MIG-{i:08d}-{j:04d}")),
                memory_total_bytes=int(item.get("memory_total_bytes", 10 * 2**30)),
                series={"memory.used": [None if v is None else float(v) for v in used_series]},
                gpu_instance_id=int(item.get("gpu_instance_id", j + 1)),
            )
        )
    xids: list[tuple[int, int]] = []
    xid_files: list[tuple[str, int]] = []
    for j, item in enumerate(spec.get("xids", [])):
        pair: Any = item
        on_file = isinstance(item, Mapping) and "file_exists" in item
        if isinstance(item, Mapping):
            keys = {"file_exists", "xid"} if on_file else {"sample", "xid"}
            _check_keys(item, keys, f"{where}.xids[{j}]")
            pair = (item.get("file_exists" if on_file else "sample"), item.get("xid"))
        try:
            when, xid = pair
            if on_file:
                if not isinstance(when, str) or not when:
                    raise ValueError(when)
                xid_files.append((when, int(xid)))
            else:
                xids.append((int(when), int(xid)))
        except (TypeError, ValueError):
            raise ValueError(
                f'{where}.xids[{j}] must be [sample, xid], {{"sample": N, "xid": X}} '
                f'or {{"file_exists": PATH, "xid": X}}'
            ) from None
    events_error = spec.get("events_error")
    block = spec.get("block")
    if block is not None:
        if not isinstance(block, Mapping) or "call" not in block:
            raise ValueError(
                f'{where}.block must be {{"call": NAME, "from_sample": N, "seconds": S}}'
            )
        _check_keys(block, {"call", "from_sample", "seconds"}, f"{where}.block")
    try:
        device = FakeDevice(
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
            xid_files=xid_files,
            events_error=None if events_error is None else error_code(events_error),
            mig_devices=mig,
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if block is not None:
        device.block(
            str(block["call"]),
            from_sample=int(block.get("from_sample", 0)),
            timeout_s=float(block.get("seconds", 30.0)),
        )
    return device
