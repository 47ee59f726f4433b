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
from gpuwatchd.testing.nvml import (
    FakeDevice,
    FakeEventData,
    FakeNvml,
    NVMLError,
    install_fake_nvml,
)

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


# -- Xid events ----------------------------------------------------------------------


def test_xid_events_are_drained_and_mapped_to_the_gpu_index() -> None:
    fake = three_gpus()
    sampler = open_sampler(fake)
    assert sampler.xid_devices == (0, 1, 2) and sampler.xid_error is None
    assert sampler.xid_unsupported == {}
    assert fake.calls["nvmlEventSetCreate"] == 1
    assert fake.calls["nvmlDeviceRegisterEvents"] == 3
    assert sampler.poll_xid_events(1.0) == ()  # TIMEOUT: nothing pending

    fake.inject_xid(2, 43)
    fake.inject_xid(0, 31)
    fake.inject_xid(2, 45)
    events = sampler.poll_xid_events(2.0)
    assert [(e.gpu_index, e.gpu_uuid, e.xid) for e in events] == [
        (2, UUID2, 43),
        (0, UUID0, 31),
        (2, UUID2, 45),
    ]
    assert all(e.timestamp_s == 2.0 for e in events)
    assert events[1].description.startswith("GPU memory page fault")
    assert sampler.poll_xid_events(3.0) == ()  # drained
    assert sampler.xid_error is None


def test_a_poll_costs_one_wait_when_nothing_is_pending() -> None:
    fake = FakeNvml.h100s(8)
    sampler = open_sampler(fake)
    for t in range(10):
        sampler.sample(float(t))
        sampler.poll_xid_events(float(t))
    assert fake.calls["nvmlEventSetWait_v2"] == 10


def test_scripted_xid_arrives_on_the_tick_of_its_sample() -> None:
    fake = three_gpus()
    fake.devices[1].xids = [(2, 79)]
    sampler = open_sampler(fake)
    got = []
    for t in range(4):
        sampler.sample(float(t))
        got.append([(e.gpu_index, e.xid) for e in sampler.poll_xid_events(float(t))])
    assert got == [[], [], [(1, 79)], []]


def test_registration_not_supported_on_one_gpu_leaves_the_others() -> None:
    fake = three_gpus()
    fake.devices[1].unsupported = frozenset({"events"})
    fake.devices[2].events_error = FakeNvml.NVML_ERROR_NO_PERMISSION
    sampler = open_sampler(fake)
    assert sampler.xid_devices == (0,)
    assert sampler.xid_unsupported == {1: "Not Supported", 2: "Insufficient Permissions"}
    assert sampler.xid_error is None
    assert fake.inject_xid(1, 43) == 0  # not registered: the event goes nowhere
    fake.inject_xid(0, 13)
    assert [(e.gpu_index, e.xid) for e in sampler.poll_xid_events(1.0)] == [(0, 13)]
    assert sampler.sample(1.0)[1].error is None  # sampling itself is unaffected


def test_no_gpu_with_xid_support_turns_polling_off_and_frees_the_set() -> None:
    fake = FakeNvml.h100s(2)
    for device in fake.devices:
        device.unsupported = frozenset({"events"})
    sampler = open_sampler(fake)
    assert sampler.xid_devices == ()
    assert sampler.xid_error == "no GPU supports Xid events"
    assert fake.calls["nvmlEventSetFree"] == 1
    assert sampler.poll_xid_events(1.0) == ()
    assert fake.calls["nvmlEventSetWait_v2"] == 0


def test_an_unknown_wait_error_disables_polling_without_raising() -> None:
    fake = three_gpus()
    sampler = open_sampler(fake)
    fake.inject_xid(0, 31)
    assert [e.xid for e in sampler.poll_xid_events(1.0)] == [31]
    fake.event_wait_error = FakeNvml.NVML_ERROR_UNKNOWN
    assert sampler.poll_xid_events(2.0) == ()
    assert sampler.xid_error == "nvmlEventSetWait failed (NVML: Unknown Error)"
    assert sampler.xid_devices == ()
    assert fake.calls["nvmlEventSetFree"] == 1 and fake.event_sets[0].freed
    waits = fake.calls["nvmlEventSetWait_v2"]
    assert sampler.poll_xid_events(3.0) == ()  # off for good: NVML is not asked again
    assert fake.calls["nvmlEventSetWait_v2"] == waits
    assert [g.error for g in sampler.sample(3.0)] == [None, None, None]
    sampler.close()
    assert fake.calls["nvmlEventSetFree"] == 1  # not freed twice


def test_a_lost_gpu_leaves_the_event_set_and_the_others_keep_reporting() -> None:
    fake = three_gpus()
    sampler = open_sampler(fake)
    fake.inject_xid(2, 79)
    assert [(e.gpu_index, e.xid) for e in sampler.poll_xid_events(1.0)] == [(2, 79)]
    fake.devices[2].lose()
    fake.event_wait_error = FakeNvml.NVML_ERROR_GPU_IS_LOST  # as NVML says once GPU 2 is gone
    assert sampler.poll_xid_events(2.0) == ()
    fake.event_wait_error = None
    assert sampler.xid_error is None and sampler.xid_devices == (0, 1)  # a new set without 2
    assert sampler.xid_unsupported == {2: "GPU is lost"}
    assert fake.calls["nvmlEventSetFree"] == 1 and len(fake.event_sets) == 2
    fake.inject_xid(0, 43)
    assert [(e.gpu_index, e.xid) for e in sampler.poll_xid_events(3.0)] == [(0, 43)]
    sampler.close()


def test_a_gpu_lost_poll_after_poll_turns_xid_polling_off() -> None:
    fake = three_gpus()
    sampler = open_sampler(fake)
    fake.event_wait_error = FakeNvml.NVML_ERROR_GPU_IS_LOST
    for now in (1.0, 2.0):
        assert sampler.poll_xid_events(now) == ()
        assert sampler.xid_error is None
    assert sampler.poll_xid_events(3.0) == ()
    assert sampler.xid_error == "nvmlEventSetWait: GPU is lost (3 polls in a row)"
    assert sampler.xid_devices == ()
    sampler.close()


def test_a_non_nvml_exception_while_polling_disables_polling() -> None:
    fake = three_gpus()

    def broken(event_set: object, timeout_ms: int) -> object:
        raise OSError("garbled")

    fake.nvmlEventSetWait_v2 = broken  # type: ignore[method-assign,assignment]
    sampler = open_sampler(fake)
    assert sampler.poll_xid_events(1.0) == ()
    assert sampler.xid_error == "nvmlEventSetWait failed (OSError: garbled)"


def test_wait_falls_back_to_nvml_event_set_wait_without_v2() -> None:
    fake = three_gpus()
    fake.nvmlEventSetWait_v2 = None  # type: ignore[assignment]  # older bindings
    sampler = open_sampler(fake)
    fake.inject_xid(1, 94)
    assert [(e.gpu_index, e.xid) for e in sampler.poll_xid_events(1.0)] == [(1, 94)]
    assert fake.calls["nvmlEventSetWait"] == 2  # the event, then TIMEOUT


def test_event_of_an_unknown_handle_maps_by_uuid_or_to_minus_one() -> None:
    fake = three_gpus()
    sampler = open_sampler(fake)
    stranger = FakeDevice(UUID1)  # another handle object for GPU 1's UUID
    fake.event_sets[0].queue.append(FakeEventData(stranger, 0x8, 48))
    # the fake answers INVALID_ARGUMENT for a handle it does not know: no UUID, index -1
    events = sampler.poll_xid_events(1.0)
    assert [(e.gpu_index, e.gpu_uuid, e.xid) for e in events] == [(-1, "", 48)]
    fake.devices.append(stranger)  # now NVML knows it: mapped by UUID
    fake.event_sets[0].queue.append(FakeEventData(stranger, 0x8, 48))
    assert [(e.gpu_index, e.gpu_uuid) for e in sampler.poll_xid_events(2.0)] == [(1, UUID1)]


def test_non_xid_events_are_ignored() -> None:
    fake = three_gpus()
    sampler = open_sampler(fake)
    fake.event_sets[0].queue.append(FakeEventData(fake.devices[0], 0x4, 0))  # a PState change
    fake.inject_xid(0, 63)
    assert [e.xid for e in sampler.poll_xid_events(1.0)] == [63]


def test_close_frees_the_event_set_and_polling_after_close_returns_nothing() -> None:
    fake = three_gpus()
    sampler = open_sampler(fake)
    fake.inject_xid(0, 31)
    sampler.close()
    assert fake.calls["nvmlEventSetFree"] == 1 and fake.event_sets[0].freed
    assert fake.init_count == 0
    assert sampler.poll_xid_events(1.0) == ()
    assert sampler.xid_devices == ()
    sampler.close()
    assert fake.calls["nvmlEventSetFree"] == 1


def test_a_gpu_that_failed_at_open_has_no_xid_events() -> None:
    fake = three_gpus(lost_from=0)
    sampler = open_sampler(fake)
    assert sampler.xid_devices == (0, 2)
    assert sampler.xid_unsupported == {1: "GPU is lost"}


def test_bindings_without_the_event_api_just_have_no_xid_events() -> None:
    fake = three_gpus()
    fake.nvmlEventSetCreate = None  # type: ignore[assignment]
    sampler = open_sampler(fake)
    assert sampler.xid_error == "the NVML bindings have no event API"
    assert sampler.poll_xid_events(1.0) == ()
    assert len(sampler.sample(1.0)) == 3


def test_event_set_create_failure_just_has_no_xid_events() -> None:
    fake = three_gpus()

    def create() -> object:
        raise NVMLError(FakeNvml.NVML_ERROR_NO_PERMISSION)

    fake.nvmlEventSetCreate = create  # type: ignore[method-assign,assignment]
    sampler = open_sampler(fake)
    assert sampler.xid_error == "nvmlEventSetCreate failed (NVML: Insufficient Permissions)"
    assert sampler.poll_xid_events(1.0) == ()
    sampler.close()
    assert fake.calls["nvmlEventSetFree"] == 0 and fake.init_count == 0
