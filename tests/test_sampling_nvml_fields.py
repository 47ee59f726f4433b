"""The DCGM-like fields of issue 22 read through NVML (GPM, health counters, per-process
SM use, MIG) and the per-device deadline, on FakeNvml held to the real H100's answers
in tests/data/gpu/h100_nvml_probe.json."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatchd.model import NA, GpuHealth, MigDevice
from gpuwatchd.sampling.nvml import NvmlSampler
from gpuwatchd.testing.nvml import FakeDevice, FakeNvml

PROBE = Path(__file__).parent / "data" / "gpu" / "h100_nvml_probe.json"
GIB = 2**30


def probe() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(PROBE.read_text(encoding="utf-8"))
    return data


def tiny_device() -> FakeDevice:
    """A FakeDevice scripted with what the H100 answered in the ``tiny`` phase (one-element
    kernels back to back)."""
    dev = probe()["tiny"]["devices"][0]
    metrics = dev["gpm"]["metrics"]
    memory = dev["nvmlDeviceGetMemoryInfo(version=nvmlMemory_v2)"]["value"]
    proc = dev["nvmlDeviceGetComputeRunningProcesses"]["value"][0]
    util = dev["nvmlDeviceGetProcessUtilization"]["value"][0]
    return FakeDevice(
        dev["nvmlDeviceGetUUID"]["value"],
        dev["nvmlDeviceGetName"]["value"],
        memory_total_bytes=memory["total"],
        series={
            "utilization.gpu": [dev["nvmlDeviceGetUtilizationRates"]["value"]["gpu"]],
            "memory.used": [memory["used"]],
            "temperature.gpu": [dev["nvmlDeviceGetTemperature"]["value"]],
            "power.draw": [dev["nvmlDeviceGetPowerUsage"]["value"] / 1000],
            "sm_active_pct": [metrics["NVML_GPM_METRIC_SM_UTIL"]["value"]],
            "sm_occupancy_pct": [metrics["NVML_GPM_METRIC_SM_OCCUPANCY"]["value"]],
            "tensor_active_pct": [metrics["NVML_GPM_METRIC_ANY_TENSOR_UTIL"]["value"]],
            "dram_active_pct": [metrics["NVML_GPM_METRIC_DRAM_BW_UTIL"]["value"]],
            "clocks_event_reasons": [dev["nvmlDeviceGetCurrentClocksEventReasons"]["value"]],
        },
        processes=[(proc["pid"], proc["usedGpuMemory"], util["smUtil"])],
    )


def open_sampler(fake: FakeNvml, **kwargs: Any) -> NvmlSampler:
    kwargs.setdefault("slow_interval_s", 0.0)
    sampler = NvmlSampler(fake, **kwargs)
    sampler.open()
    return sampler


def test_the_recorded_tiny_phase_gives_36_percent_utilization_and_004_sm_active() -> None:
    sampler = open_sampler(FakeNvml([tiny_device()]))
    first = sampler.sample(0.0)[0]
    assert first.sm_active_pct is NA and first.gpm_unavailable == "waiting for a second GPM sample"
    gpu = sampler.sample(1.0)[0]
    assert gpu.utilization_gpu_pct == 36.0
    assert gpu.sm_active_pct == pytest.approx(0.04, abs=0.01)
    assert gpu.sm_occupancy_pct == pytest.approx(0.0017, abs=1e-4)
    assert gpu.gpm_unavailable is None and gpu.error is None and gpu.stale is None
    assert gpu.health.clocks_event_reasons == 0
    assert gpu.health.ecc_dbe_volatile_total == 0 and gpu.health.row_remap_pending == 0
    assert [(p.pid, p.sm_util_pct) for p in gpu.processes] == [(534, 62.0)]
    assert gpu.mig_devices == ()
    sampler.close()


def _keys(value: Any) -> Any:
    """The shape of an answer: field names (without the probe's ``_type``), recursively."""
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in value.items() if k != "_type"}
    if isinstance(value, list):
        return [_keys(value[0])] if value else []
    return type(value).__name__ if isinstance(value, bool) else "scalar"


def _fake_keys(obj: Any) -> Any:
    from dataclasses import fields, is_dataclass

    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _fake_keys(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, list):
        return [_fake_keys(obj[0])] if obj else []
    return "scalar"


def test_the_fakes_answers_have_the_shape_of_the_real_h100s() -> None:
    recorded = probe()["busy"]["devices"][0]
    fake = FakeNvml([tiny_device()])
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    fake.nvmlDeviceGetUtilizationRates(handle)
    answers = {
        "nvmlDeviceGetUtilizationRates": fake.nvmlDeviceGetUtilizationRates(handle),
        "nvmlDeviceGetMemoryInfo": fake.nvmlDeviceGetMemoryInfo(handle),
        "nvmlDeviceGetMemoryInfo(version=nvmlMemory_v2)": fake.nvmlDeviceGetMemoryInfo(
            handle, version=fake.nvmlMemory_v2
        ),
        "nvmlDeviceGetComputeRunningProcesses": fake.nvmlDeviceGetComputeRunningProcesses(handle),
        "nvmlDeviceGetProcessUtilization": fake.nvmlDeviceGetProcessUtilization(handle, 0),
    }
    for call, answer in answers.items():
        assert _fake_keys(answer) == _keys(recorded[call]["value"]), call
    support = fake.nvmlGpmQueryDeviceSupport(handle)
    assert _fake_keys(support) == _keys(recorded["gpm"]["support"]["value"])
    fields = recorded["field_values"]["fields"]
    ids = [fake.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, fake.NVML_FI_DEV_REMAPPED_PENDING]
    for entry in fake.nvmlDeviceGetFieldValues(handle, ids):
        real = fields["NVML_FI_DEV_ECC_DBE_VOL_TOTAL"]
        assert _fake_keys(entry) == _keys(real)
        assert entry.valueType == real["valueType"] and entry.nvmlReturn == real["nvmlReturn"]
    # scalar answers: same Python kind, MIG mode as [current, pending]
    for call, answer in (
        ("nvmlDeviceGetCurrentClocksEventReasons", fake.nvmlDeviceGetCurrentClocksEventReasons),
        ("nvmlDeviceGetMigMode", fake.nvmlDeviceGetMigMode),
        ("nvmlDeviceGetMaxMigDeviceCount", fake.nvmlDeviceGetMaxMigDeviceCount),
    ):
        assert type(answer(handle)) is type(recorded[call]["value"]), call
    assert fake.nvmlDeviceGetMigMode(handle) == recorded["nvmlDeviceGetMigMode"]["value"]
    # the GPM request: the recorded structs' field names
    structs = probe()["busy"]["structs"]
    request = fake.c_nvmlGpmMetricsGet_t()
    assert list(vars(request)) == [name for name, _ in structs["c_nvmlGpmMetricsGet_t"]]
    assert _fake_keys(request.metrics[0]).keys() == {n for n, _ in structs["c_nvmlGpmMetric_t"]}
    # where the H100 says NotFound (no process ran: idle), the fake does too
    idle = probe()["idle"]["devices"][0]["nvmlDeviceGetProcessUtilization"]["error"]
    quiet = FakeNvml([FakeDevice("GPU-q", processes=[(1, GIB)])])
    quiet.nvmlInit()
    with pytest.raises(quiet.NVMLError) as caught:
        quiet.nvmlDeviceGetProcessUtilization(quiet.nvmlDeviceGetHandleByIndex(0), 0)
    assert (caught.value.value, str(caught.value)) == (idle["code"], idle["text"])


def test_health_faults_are_read_from_one_field_values_call_per_read() -> None:
    device = FakeDevice(
        "GPU-h",
        series={
            "ecc_dbe_volatile_total": [0, 0, 2, 3],
            "row_remap_pending": [0, 1],
            "remapped_rows_uncorrectable": [0, 1],
            "clocks_event_reasons": [0, 0x40 | 0x4],
            "ecc_sbe_volatile_total": [None],
        },
        unsupported=["remapped_rows_correctable"],
    )
    fake = FakeNvml([device])
    sampler = open_sampler(fake)
    got = [sampler.sample(float(t))[0].health for t in range(4)]
    assert [h.ecc_dbe_volatile_total for h in got] == [0, 0, 2, 3]
    assert [h.row_remap_pending for h in got] == [0, 1, 1, 1]
    assert got[1].clocks_event_reasons == 0x44
    assert got[3].ecc_sbe_volatile_total is NA and got[3].remapped_rows_correctable is NA
    assert got[3].row_remap_failure == 0
    assert fake.calls["nvmlDeviceGetFieldValues"] == 4


def test_expensive_groups_are_read_every_slow_interval() -> None:
    fake = FakeNvml.h100s(1)
    sampler = open_sampler(fake, slow_interval_s=5.0)
    for t in range(10):
        sampler.sample(float(t))
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 10
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 10
    assert fake.calls["nvmlDeviceGetFieldValues"] == 2  # t=0 and t=5
    assert fake.calls["nvmlGpmSampleGet"] == 2 and fake.calls["nvmlGpmMetricsGet"] == 1
    assert fake.calls["nvmlGpmSampleAlloc"] == 2


def test_process_utilization_not_found_is_no_sample_not_an_error() -> None:
    device = FakeDevice("GPU-p", processes=[(10, GIB, 40.0), (11, GIB)])
    quiet = FakeDevice("GPU-q", processes=[(12, GIB)])
    fake = FakeNvml([device, quiet])
    sampler = open_sampler(fake)
    busy, idle = sampler.sample(0.0)
    assert [(p.pid, p.sm_util_pct) for p in busy.processes] == [(10, 40.0), (11, NA)]
    assert idle.error is None and [p.sm_util_pct for p in idle.processes] == [NA]
    # lastSeenTimeStamp moves on: the next read gets only the newer sample
    assert sampler.sample(1.0)[0].processes[0].sm_util_pct == 40.0


def test_gpm_unsupported_says_why_and_samples_are_freed_on_close() -> None:
    fake = FakeNvml([FakeDevice("GPU-old", unsupported=["gpm"]), FakeDevice("GPU-new")])
    sampler = open_sampler(fake)
    for t in range(3):
        old, new = sampler.sample(float(t))
    assert old.sm_active_pct is NA and old.gpm_unavailable is not None
    assert "not supported" in old.gpm_unavailable
    assert new.sm_active_pct == 0.0 and new.gpm_unavailable is None
    assert fake.calls["nvmlGpmQueryDeviceSupport"] == 2  # asked once per device
    assert len(fake.gpm_samples) == 2 and not any(s.freed for s in fake.gpm_samples)
    sampler.close()
    assert all(s.freed for s in fake.gpm_samples)


def test_a_mig_device_is_listed_with_its_memory() -> None:
    fake = FakeNvml.from_script(
        {
            "devices": [
                {
                    "uuid": "GPU-mig",
                    "mig_devices": [
                        {
                            "uuid": "MIG-1",
                            "gpu_instance_id": 3,
                            "memory_total_bytes": 10 * GIB,
                            "memory_used_bytes": [2 * GIB],
                        }
                    ],
                },
                {"uuid": "GPU-plain", "unsupported": ["mig"]},
            ]
        }
    )
    sampler = open_sampler(fake)
    mig, plain = sampler.sample(0.0)
    assert mig.mig_devices == (MigDevice("MIG-1", 3, 2 * GIB, 10 * GIB),)
    assert plain.mig_devices == () and plain.error is None


def test_gpu_lost_in_a_slow_read_fails_the_device() -> None:
    fake = FakeNvml([FakeDevice("GPU-l", lost_from=1)])
    sampler = open_sampler(fake)
    assert sampler.sample(0.0)[0].error is None
    gpu = sampler.sample(1.0)[0]
    assert gpu.error == "GPU is lost" and gpu.health == GpuHealth()


def test_a_call_blocked_30s_leaves_the_tick_on_time_and_the_device_recovers() -> None:
    """Issue 22's acceptance: a FakeNvml call scripted to block (released by the test, at
    most 30 s): no tick waits past the deadline, that device is stale with the call's
    name while the others keep sampling, and it recovers once the call returns."""
    devices = [
        FakeDevice(f"GPU-{i}", series={"utilization.gpu": [float(10 * k + i) for k in range(20)]})
        for i in range(3)
    ]
    release = devices[1].block("nvmlDeviceGetFieldValues", from_sample=2, timeout_s=30.0)
    fake = FakeNvml(devices)
    interval_s, deadline_s = 1.0, 0.3
    sampler = open_sampler(fake, deadline_s=deadline_s)
    stale_ticks = []
    for t in range(6):
        started = time.perf_counter()
        gpus = sampler.sample(float(t))
        assert time.perf_counter() - started < interval_s  # the tick keeps its interval
        assert [g.utilization_gpu_pct for g in (gpus[0], gpus[2])] == [10.0 * t, 10.0 * t + 2]
        assert gpus[0].stale is None and gpus[2].stale is None
        if gpus[1].stale is not None:
            stale_ticks.append(t)
            assert gpus[1].stale == "nvmlDeviceGetFieldValues"
            assert gpus[1].utilization_gpu_pct == 11.0  # the last complete sample (t=1)
            assert gpus[1].timestamp_s == float(t) and gpus[1].error is None
    assert stale_ticks == [2, 3, 4, 5]
    assert devices[1].blocked_in == "nvmlDeviceGetFieldValues"
    assert devices[1].sample_number == 2  # no second call started on the blocked device
    release.set()
    assert sampler.drain(5.0)
    gpu = sampler.sample(6.0)[1]
    assert gpu.stale is None and gpu.error is None
    assert gpu.utilization_gpu_pct == 31.0  # its next scripted sample
    sampler.close()


def test_a_device_that_blocks_before_any_sample_is_stale_with_na_values() -> None:
    devices = [FakeDevice("GPU-0"), FakeDevice("GPU-1")]
    release = devices[0].block("nvmlDeviceGetUtilizationRates")
    sampler = open_sampler(FakeNvml(devices), deadline_s=0.3)
    blocked, fine = sampler.sample(0.0)
    assert blocked.stale == "nvmlDeviceGetUtilizationRates"
    assert blocked.utilization_gpu_pct is NA and fine.stale is None
    release.set()
    assert sampler.drain(5.0)
    assert sampler.sample(1.0)[0].stale is None
    sampler.close()


def test_a_scripted_block_times_out_by_itself() -> None:
    fake = FakeNvml.from_script(
        {"devices": [{"block": {"call": "nvmlGpmMetricsGet", "from_sample": 1, "seconds": 0.01}}]}
    )
    sampler = open_sampler(fake)
    sampler.sample(0.0)
    sampler.sample(1.0)
    assert sampler.drain(5.0)
    assert sampler.sample(2.0)[0].stale is None
