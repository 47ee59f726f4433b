"""NvmlSampler over the fake NVML (the hardware boundary) and over the real pynvml."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpuwatchd.errors import NvmlUnavailable
from gpuwatchd.model import NA, GpuProcess
from gpuwatchd.sampling import GpuSampler
from gpuwatchd.sampling.nvml import LOST_DEVICE_RETRY_S, NvmlSampler
from gpuwatchd.testing.nvml import FakeDevice, FakeNvml, install_fake_nvml

GIB = 2**30
UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"
UUID2 = "GPU-22222222-2222-2222-2222-222222222222"


def three_gpus(lost_from: int | None = None) -> FakeNvml:
    """GPU 0 busy, GPU 1 idle (lost from sample ``lost_from``), GPU 2 ramping up."""
    return FakeNvml(
        [
            FakeDevice(
                UUID0,
                memory_total_bytes=80 * GIB,
                series={
                    "utilization.gpu": [97.0],
                    "memory.used": [60 * GIB],
                    "temperature.gpu": [61.0],
                    "power.draw": [412.5],
                },
                processes=[(4242, 59 * GIB), (4243, None)],
            ),
            FakeDevice(
                UUID1,
                "NVIDIA A100-SXM4-40GB",
                memory_total_bytes=40 * GIB,
                series={"utilization.gpu": [3.0], "memory.used": [1 * GIB]},
                lost_from=lost_from,
            ),
            FakeDevice(UUID2, series={"utilization.gpu": [0.0, 10.0, 20.0, 30.0, 40.0]}),
        ]
    )


def open_sampler(fake: FakeNvml) -> NvmlSampler:
    sampler = NvmlSampler(fake)
    sampler.open()
    return sampler


def test_samples_carry_nvml_values_in_base_units() -> None:
    sampler = open_sampler(three_gpus())
    assert isinstance(sampler, GpuSampler)
    assert sampler.status == "nvml"

    gpu0, gpu1, gpu2 = sampler.sample(1234.5)

    assert (gpu0.uuid, gpu0.index, gpu0.name) == (UUID0, 0, "NVIDIA H100 80GB HBM3")
    assert gpu0.timestamp_s == 1234.5
    assert gpu0.utilization_gpu_pct == 97.0
    assert gpu0.memory_used_bytes == 60 * GIB
    assert gpu0.memory_total_bytes == 80 * GIB
    assert gpu0.memory_used_pct == 75.0
    assert gpu0.temperature_gpu_c == 61.0
    assert gpu0.power_draw_w == 412.5  # NVML reports 412500 mW
    assert gpu0.processes == (GpuProcess(4242, 59 * GIB), GpuProcess(4243, NA))
    assert gpu0.error is None
    assert (gpu1.uuid, gpu1.index, gpu1.name) == (UUID1, 1, "NVIDIA A100-SXM4-40GB")
    assert gpu1.memory_total_bytes == 40 * GIB and gpu1.utilization_gpu_pct == 3.0
    assert gpu2.utilization_gpu_pct == 0.0

    # One tick is one sample of each device's series.
    assert [sampler.sample(1235.5 + i)[2].utilization_gpu_pct for i in range(5)] == [
        10.0,
        20.0,
        30.0,
        40.0,
        40.0,  # the series holds its last value
    ]


def test_not_supported_makes_only_that_field_na() -> None:
    fake = three_gpus()
    fake.devices[0].unsupported = frozenset({"power.draw"})
    fake.devices[2].series["temperature.gpu"] = (50.0, None, 52.0)
    sampler = open_sampler(fake)

    gpu0 = sampler.sample(1.0)[0]
    assert gpu0.power_draw_w is NA
    assert gpu0.error is None
    assert gpu0.utilization_gpu_pct == 97.0 and gpu0.temperature_gpu_c == 61.0
    assert gpu0.memory_used_bytes == 60 * GIB and len(gpu0.processes) == 2

    temps = [sampler.sample(float(t))[2].temperature_gpu_c for t in range(2, 5)]
    assert temps == [NA, 52.0, 52.0]  # NA for the one sample NVML could not read
    assert sampler.device_errors == {}


def test_lost_gpu_degrades_only_that_gpu_and_recovers() -> None:
    fake = three_gpus(lost_from=2)
    sampler = open_sampler(fake)
    t0 = 10_000.0

    first = sampler.sample(t0)
    second = sampler.sample(t0 + 1)
    assert all(g.error is None for g in first + second)

    third = sampler.sample(t0 + 2)  # GPU 1's sample number 2: GPU_IS_LOST
    gpu0, gpu1, gpu2 = third
    assert gpu1.error == "GPU is lost"
    assert gpu1.uuid == UUID1 and gpu1.index == 1  # still identifiable
    assert gpu1.utilization_gpu_pct is NA and gpu1.memory_used_bytes is NA
    assert gpu1.power_draw_w is NA and gpu1.temperature_gpu_c is NA
    assert gpu0.error is None and gpu0.utilization_gpu_pct == 97.0
    assert gpu2.error is None and gpu2.utilization_gpu_pct == 20.0
    assert sampler.device_errors == {1: "GPU is lost"}

    # Within the retry interval the lost device is not touched; the others go on.
    handle_calls = fake.calls["nvmlDeviceGetHandleByIndex"]
    for dt in (3.0, 10.0, LOST_DEVICE_RETRY_S + 1.0):
        gpus = sampler.sample(t0 + dt)
        assert gpus[1].error == "GPU is lost"
        assert gpus[0].utilization_gpu_pct == 97.0 and gpus[2].error is None
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == handle_calls
    assert fake.devices[1].sample_number == 2

    # 30 s after the failure the handle is re-fetched; still lost -> wait again.
    gpus = sampler.sample(t0 + 2 + LOST_DEVICE_RETRY_S)
    assert gpus[1].error == "GPU is lost"
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == handle_calls + 1

    # The device answers again: the next retry brings it back.
    fake.devices[1].recover()
    gpus = sampler.sample(t0 + 2 + LOST_DEVICE_RETRY_S + 1)
    assert gpus[1].error == "GPU is lost"  # not retried yet
    gpus = sampler.sample(t0 + 2 + 2 * LOST_DEVICE_RETRY_S)
    assert gpus[1].error is None
    assert gpus[1].utilization_gpu_pct == 3.0 and gpus[1].memory_used_bytes == 1 * GIB
    assert gpus[1].uuid == UUID1 and gpus[1].memory_total_bytes == 40 * GIB
    assert sampler.device_errors == {}


def test_unknown_error_is_a_device_error_with_nvml_message() -> None:
    fake = three_gpus()
    fake.devices[2].lost_code = fake.NVML_ERROR_UNKNOWN
    fake.devices[2].lose()
    sampler = open_sampler(fake)  # open reads static facts: GPU 2 already fails

    assert sampler.device_errors == {2: "Unknown Error"}
    gpus = sampler.sample(5.0)  # retried on the first tick, fails again
    assert gpus[2].error == "Unknown Error" and gpus[2].index == 2
    assert gpus[0].error is None and gpus[1].error is None
    assert sampler.device_errors == {2: "Unknown Error"}

    fake.devices[2].recover()
    assert sampler.sample(6.0)[2].error == "Unknown Error"  # next retry at 5 + 30 s
    gpus = sampler.sample(5.0 + LOST_DEVICE_RETRY_S)
    assert gpus[2].error is None
    assert gpus[2].uuid == UUID2 and gpus[2].name == "NVIDIA H100 80GB HBM3"
    assert gpus[2].utilization_gpu_pct == 0.0


@pytest.mark.parametrize(
    ("code_name", "expected"),
    [
        ("NVML_ERROR_DRIVER_NOT_LOADED", "no NVIDIA driver (NVML: Driver Not Loaded)"),
        ("NVML_ERROR_LIBRARY_NOT_FOUND", "libnvidia-ml.so.1 not found"),
        ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", "driver/library version mismatch"),
        ("NVML_ERROR_NO_PERMISSION", "no permission"),
        ("NVML_ERROR_UNKNOWN", "NVML failed to start (NVML: Unknown Error)"),
    ],
)
def test_init_failure_raises_nvml_unavailable_with_reason(code_name: str, expected: str) -> None:
    fake = FakeNvml([], init_error=getattr(FakeNvml, code_name))
    sampler = NvmlSampler(fake)
    with pytest.raises(NvmlUnavailable) as caught:
        sampler.open()
    assert expected in caught.value.reason
    assert "\n" not in caught.value.reason
    sampler.close()  # harmless after a failed open
    assert fake.calls["nvmlShutdown"] == 0


def test_zero_gpus_is_unavailable_and_shuts_nvml_down() -> None:
    fake = FakeNvml([])
    with pytest.raises(NvmlUnavailable, match=r"no NVIDIA GPU found"):
        NvmlSampler(fake).open()
    assert fake.init_count == 0  # nvmlShutdown balanced the nvmlInit


def test_missing_bindings_are_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` -> ImportError
    with pytest.raises(NvmlUnavailable, match=r"nvidia-ml-py"):
        NvmlSampler().open()


def test_default_sampler_imports_pynvml_which_the_fake_can_replace() -> None:
    with install_fake_nvml(FakeNvml.h100s(2, utilization_pct=55.0)) as fake:
        sampler = NvmlSampler()
        sampler.open()
        assert [g.utilization_gpu_pct for g in sampler.sample(1.0)] == [55.0, 55.0]
        sampler.close()
    assert fake.init_count == 0


def test_real_pynvml_on_this_machine() -> None:
    """The real bindings: without an NVIDIA driver, NvmlUnavailable with a readable reason."""
    sampler = NvmlSampler()
    if not os.path.exists("/proc/driver/nvidia/version"):
        with pytest.raises(NvmlUnavailable) as caught:
            sampler.open()
        reason = caught.value.reason
        assert reason.startswith("no NVIDIA driver"), reason
        assert "(NVML: " in reason and "\n" not in reason
        sampler.close()
        return
    sampler.open()  # a machine with a driver: the same code reads real GPUs
    try:
        gpus = sampler.sample(time.time())
        assert gpus and all(g.uuid.startswith(("GPU-", "MIG-")) for g in gpus)
        assert all(g.error is None for g in gpus)
        assert all(isinstance(g.memory_total_bytes, int) for g in gpus)
    finally:
        sampler.close()


def test_memory_info_falls_back_to_v1_without_v2() -> None:
    fake = three_gpus()
    fake.memory_v2 = False  # an older driver: nvmlDeviceGetMemoryInfo_v2 missing
    sampler = open_sampler(fake)
    for t in range(3):
        gpu0 = sampler.sample(float(t))[0]
        assert gpu0.memory_used_bytes == 60 * GIB and gpu0.memory_total_bytes == 80 * GIB
        assert gpu0.error is None


def test_close_is_idempotent_and_sample_after_close_is_refused() -> None:
    fake = three_gpus()
    sampler = open_sampler(fake)
    sampler.open()  # already open: no second nvmlInit
    assert fake.calls["nvmlInit"] == 1
    sampler.close()
    sampler.close()
    assert fake.calls["nvmlShutdown"] == 1 and fake.init_count == 0
    with pytest.raises(RuntimeError, match="open"):
        sampler.sample(1.0)


def test_eight_gpus_sample_without_refetching_static_info() -> None:
    # (The per-tick cost is measured by bench/tick.py, not asserted here.)
    fake = FakeNvml.h100s(8, utilization_pct=[10.0, 90.0], memory_used_bytes=30 * GIB)
    sampler = open_sampler(fake)
    for i in range(100):
        gpus = sampler.sample(float(i))
    assert len(gpus) == 8 and all(g.utilization_gpu_pct == 90.0 for g in gpus)
    # UUID, name and memory.total are read once per device, at open.
    assert fake.calls["nvmlDeviceGetUUID"] == 8 and fake.calls["nvmlDeviceGetName"] == 8
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 8


def test_importing_sampling_imports_neither_pynvml_nor_psutil() -> None:
    code = (
        "import sys, gpuwatchd.sampling, gpuwatchd.sampling.nvml, gpuwatchd.sampling.host, "
        "gpuwatchd.sampling.replay, gpuwatchd.testing.nvml, gpuwatchd.testing.clock; "
        "print(sorted(m for m in ('pynvml', 'psutil') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


def test_a_non_nvml_exception_fails_only_that_device() -> None:
    fake = three_gpus()
    real_power = fake.nvmlDeviceGetPowerUsage

    def power(handle: FakeDevice) -> int:
        if handle is fake.devices[1]:
            raise ValueError("garbled reply")
        return real_power(handle)

    fake.nvmlDeviceGetPowerUsage = power  # type: ignore[method-assign]
    sampler = open_sampler(fake)
    gpus = sampler.sample(1.0)  # no exception escapes sample()
    assert gpus[1].error == "ValueError: garbled reply" and gpus[1].power_draw_w is NA
    assert gpus[0].error is None and gpus[0].power_draw_w == 412.5
