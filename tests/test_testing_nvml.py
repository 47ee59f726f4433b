"""The fake NVML: faithful to pynvml where the sampler relies on it, and scriptable."""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from pathlib import Path

import pytest

from conftest import TRACES
from gpuwatchd.errors import ReplayError
from gpuwatchd.model import NA
from gpuwatchd.sampling.nvml import NvmlSampler
from gpuwatchd.sampling.replay import parse_trace
from gpuwatchd.testing.clock import FakeClock
from gpuwatchd.testing.nvml import (
    DEFAULT_MEMORY_TOTAL_BYTES,
    FakeDevice,
    FakeEventData,
    FakeNvml,
    NVMLError,
    install,
    install_fake_nvml,
)

GIB = 2**30


def test_error_codes_and_texts_match_the_real_pynvml() -> None:
    # The real bindings are installed (nvidia-ml-py); no driver is needed to read constants.
    real = importlib.import_module("pynvml")
    fake = FakeNvml()
    names = [n for n in dir(fake) if n.startswith("NVML_ERROR_")]
    assert "NVML_ERROR_GPU_IS_LOST" in names and "NVML_ERROR_NOT_SUPPORTED" in names
    for name in names:
        code = getattr(fake, name)
        assert code == getattr(real, name), name
        if code in real.NVMLError._errcode_to_string:
            assert str(NVMLError(code)) == real.NVMLError._errcode_to_string[code], name
    assert fake.nvmlMemory_v2 == real.nvmlMemory_v2
    assert fake.NVML_TEMPERATURE_GPU == real.NVML_TEMPERATURE_GPU


def test_error_has_value_and_pynvml_text() -> None:
    error = NVMLError(FakeNvml.NVML_ERROR_GPU_IS_LOST)
    assert error.value == 15 and str(error) == "GPU is lost"
    assert str(NVMLError(12345)) == "NVML Error with code 12345"


def test_calls_before_init_raise_uninitialized_and_init_error_is_raised() -> None:
    fake = FakeNvml.h100s(1)
    with pytest.raises(NVMLError) as caught:
        fake.nvmlDeviceGetCount()
    assert caught.value.value == fake.NVML_ERROR_UNINITIALIZED

    broken = FakeNvml(init_error=FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(NVMLError, match="Driver Not Loaded"):
        broken.nvmlInit()


def test_device_plays_series_one_sample_per_utilization_read() -> None:
    device = FakeDevice(
        "GPU-a",
        memory_total_bytes=16 * GIB,
        series={
            "utilization.gpu": [0.0, 50.0, 99.6],
            "memory.used": [1 * GIB, 2 * GIB],
            "power.draw": [100.0, None, 300.25],
        },
        processes=[(77, 5 * GIB)],
    )
    fake = FakeNvml([device])
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    seen = []
    for _ in range(4):
        util = fake.nvmlDeviceGetUtilizationRates(handle)
        memory = fake.nvmlDeviceGetMemoryInfo(handle, version=fake.nvmlMemory_v2)
        try:
            power_mw: int | None = fake.nvmlDeviceGetPowerUsage(handle)
        except NVMLError as exc:
            assert exc.value == fake.NVML_ERROR_NOT_SUPPORTED
            power_mw = None
        seen.append((util.gpu, memory.used, memory.total, memory.free, power_mw))
    assert seen == [
        (0, 1 * GIB, 16 * GIB, 15 * GIB, 100_000),
        (50, 2 * GIB, 16 * GIB, 14 * GIB, None),
        (100, 2 * GIB, 16 * GIB, 14 * GIB, 300_250),  # NVML reports integers
        (100, 2 * GIB, 16 * GIB, 14 * GIB, 300_250),  # last value held
    ]
    assert fake.nvmlDeviceGetTemperature(handle, fake.NVML_TEMPERATURE_GPU) == 30  # default
    (proc,) = fake.nvmlDeviceGetComputeRunningProcesses(handle)
    assert (proc.pid, proc.usedGpuMemory) == (77, 5 * GIB)


def test_lost_from_and_lost_until_count_samples() -> None:
    device = FakeDevice("GPU-b", lost_from=1, lost_until=3)
    fake = FakeNvml([device])
    fake.nvmlInit()
    outcomes = []
    for _ in range(4):
        try:
            fake.nvmlDeviceGetUtilizationRates(device)
            outcomes.append("ok")
        except NVMLError as exc:
            outcomes.append(str(exc))
    assert outcomes == ["ok", "GPU is lost", "GPU is lost", "ok"]


def test_unknown_series_or_field_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown series utilisation"):
        FakeDevice("GPU-c", series={"utilisation": [1.0]})
    with pytest.raises(ValueError, match=r"unknown unsupported field fan.speed"):
        FakeDevice("GPU-c", unsupported={"fan.speed"})


def test_from_script_builds_devices_errors_and_processes() -> None:
    script = {
        "devices": [
            {
                "uuid": "GPU-1",
                "name": "NVIDIA L4",
                "memory_total_bytes": 24 * GIB,
                "series": {"utilization.gpu": [12, 34], "memory.used": [GIB]},
                "processes": [[11, GIB], {"pid": 12, "used_gpu_memory_bytes": None}],
                "unsupported": ["temperature.gpu"],
            },
            {"uuid": "GPU-2", "lost_from": 1, "lost_code": "UNKNOWN"},
        ]
    }
    fake = FakeNvml.from_script(json.loads(json.dumps(script)))
    sampler = NvmlSampler(fake)
    sampler.open()
    first = sampler.sample(1.0)
    assert (first[0].uuid, first[0].name) == ("GPU-1", "NVIDIA L4")
    assert first[0].utilization_gpu_pct == 12.0
    assert first[0].memory_total_bytes == 24 * GIB and first[0].temperature_gpu_c is NA
    assert [(p.pid, p.used_gpu_memory_bytes) for p in first[0].processes] == [(11, GIB), (12, NA)]
    assert first[1].uuid == "GPU-2" and first[1].error is None
    second = sampler.sample(2.0)
    assert second[0].utilization_gpu_pct == 34.0
    assert second[1].error == "Unknown Error"


def test_from_script_init_error_by_name_and_bad_scripts() -> None:
    fake = FakeNvml.from_script({"init_error": "DRIVER_NOT_LOADED", "devices": []})
    assert fake.init_error == fake.NVML_ERROR_DRIVER_NOT_LOADED
    mismatch = FakeNvml.from_script({"init_error": "NVML_ERROR_LIB_RM_VERSION_MISMATCH"})
    assert mismatch.init_error == 18
    with pytest.raises(ValueError, match=r"unknown NVML error 'NO_DRIVER'"):
        FakeNvml.from_script({"init_error": "NO_DRIVER"})
    with pytest.raises(ValueError, match=r"unknown key 'gpus' in script"):
        FakeNvml.from_script({"gpus": 2})
    with pytest.raises(ValueError, match=r"devices\[0\]: unknown series"):
        FakeNvml.from_script({"devices": [{"uuid": "GPU-x", "series": {"util": [1]}}]})
    with pytest.raises(ValueError, match=r"unknown key 'lost' in devices\[0\]"):
        FakeNvml.from_script({"devices": [{"uuid": "GPU-x", "lost": 3}]})


def test_from_json_file(tmp_path: Path) -> None:
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({"devices": [{"uuid": "GPU-j", "series": {"power.draw": [250]}}]}))
    fake = FakeNvml.from_json(path)
    sampler = NvmlSampler(fake)
    sampler.open()
    assert sampler.sample(0.0)[0].power_draw_w == 250.0


def test_from_trace_plays_the_recorded_trace_through_the_sampler() -> None:
    path = TRACES / "titanx2_gpt_ddp_100ms.csv"
    trace = parse_trace(path)
    fake = FakeNvml.from_trace(path)
    assert [d.uuid for d in fake.devices] == ["GPU-replay-0", "GPU-replay-1"]
    sampler = NvmlSampler(fake)
    sampler.open()
    for frame in trace.frames[:600]:
        got = sampler.sample(frame.timestamp_s)
        for live, recorded in zip(got, frame.samples, strict=True):
            assert live.utilization_gpu_pct == recorded.utilization_gpu_pct
            assert live.memory_used_bytes == recorded.memory_used_bytes
            assert live.power_draw_w == recorded.power_draw_w
            assert live.memory_total_bytes == DEFAULT_MEMORY_TOTAL_BYTES
            assert live.temperature_gpu_c is NA  # not in the trace -> NOT_SUPPORTED


def test_from_script_trace_form() -> None:
    fake = FakeNvml.from_script(
        {"trace": str(TRACES / "h100x8_gpt350m_ckpt10_100ms.csv"), "gpus": 8,
         "memory_total_bytes": 81559 * 2**20}
    )  # fmt: skip
    assert len(fake.devices) == 8
    assert fake.devices[0].memory_total_bytes == 81559 * 2**20
    assert fake.devices[0].series["memory.used"][0] == 124 * 2**20
    with pytest.raises(ReplayError):
        FakeNvml.from_script({"trace": str(TRACES / "missing.csv")})


def test_install_fake_nvml_restores_what_was_there(monkeypatch: pytest.MonkeyPatch) -> None:
    sentinel = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", sentinel)
    fake = FakeNvml.h100s(1)
    with pytest.raises(KeyError), install_fake_nvml(fake):
        import pynvml

        assert pynvml is fake
        raise KeyError("boom")
    assert sys.modules["pynvml"] is sentinel

    monkeypatch.delitem(sys.modules, "pynvml")
    with install_fake_nvml(fake):
        assert sys.modules["pynvml"] is fake
    assert "pynvml" not in sys.modules


def test_install_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    fake = install(FakeNvml.h100s(2))
    assert sys.modules["pynvml"] is fake  # monkeypatch removes it again after the test


def test_h100s_builder() -> None:
    fake = FakeNvml.h100s(3, utilization_pct=[5.0, 95.0], memory_used_bytes=70 * GIB)
    assert [d.uuid for d in fake.devices] == [
        f"GPU-00000000-0000-0000-0000-{i:012d}" for i in range(3)
    ]
    sampler = NvmlSampler(fake)
    sampler.open()
    sampler.sample(0.0)
    gpus = sampler.sample(1.0)
    assert [g.utilization_gpu_pct for g in gpus] == [95.0] * 3
    assert gpus[0].memory_used_pct == pytest.approx(87.5)


def test_fake_clock() -> None:
    clock = FakeClock()
    assert clock() == 1_000_000.0
    assert clock.advance(2.5) == 1_000_002.5 and clock() == 1_000_002.5
    with pytest.raises(ValueError):
        clock.advance(-1)
    assert FakeClock(start_s=5)() == 5.0


# -- the event API -------------------------------------------------------------------


def test_event_api_matches_the_real_pynvml() -> None:
    real = importlib.import_module("pynvml")
    fake = FakeNvml()
    names = [n for n in dir(fake) if n.startswith("nvmlEventType")]
    assert "nvmlEventTypeXidCriticalError" in names
    for name in names:
        assert getattr(fake, name) == getattr(real, name), name
    for function in (
        "nvmlEventSetCreate",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait_v2",
        "nvmlEventSetWait",
        "nvmlEventSetFree",
    ):
        assert callable(getattr(real, function)) and callable(getattr(fake, function))
    real_fields = [name for name, _ in real.c_nvmlEventData_t._fields_]
    assert real_fields == [f.name for f in dataclasses.fields(FakeEventData)]


def test_event_set_delivers_injected_and_scripted_xids_then_times_out() -> None:
    fake = FakeNvml.h100s(2)
    fake.devices[1].xids = [(1, 79)]
    fake.nvmlInit()
    event_set = fake.nvmlEventSetCreate()
    for i in range(2):
        fake.nvmlDeviceRegisterEvents(
            fake.nvmlDeviceGetHandleByIndex(i), fake.nvmlEventTypeXidCriticalError, event_set
        )
    assert fake.inject_xid(0, 43) == 1
    data = fake.nvmlEventSetWait_v2(event_set, 0)
    assert (data.device, data.eventType, data.eventData) == (fake.devices[0], 0x8, 43)
    assert (data.gpuInstanceId, data.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)
    with pytest.raises(NVMLError) as caught:
        fake.nvmlEventSetWait(event_set, 0)
    assert caught.value.value == fake.NVML_ERROR_TIMEOUT
    fake.nvmlDeviceGetUtilizationRates(fake.devices[1])  # sample 0: not yet
    with pytest.raises(NVMLError, match="Timeout"):
        fake.nvmlEventSetWait_v2(event_set, 0)
    fake.nvmlDeviceGetUtilizationRates(fake.devices[1])  # sample 1: the scripted Xid
    assert fake.nvmlEventSetWait_v2(event_set, 0).eventData == 79
    fake.nvmlEventSetFree(event_set)
    with pytest.raises(NVMLError, match="Invalid Argument"):
        fake.nvmlEventSetWait_v2(event_set, 0)
    with pytest.raises(NVMLError, match="Invalid Argument"):
        fake.nvmlEventSetFree(event_set)
    assert fake.inject_xid(0, 13) == 0  # no live set: lost
    with pytest.raises(IndexError):
        fake.inject_xid(2, 13)


def test_registration_refusals_and_wait_errors() -> None:
    fake = FakeNvml.h100s(3)
    fake.devices[0].unsupported = frozenset({"events"})
    fake.devices[1].events_error = fake.NVML_ERROR_NO_PERMISSION
    fake.devices[2].lose()
    with pytest.raises(NVMLError, match="Uninitialized"):
        fake.nvmlEventSetCreate()
    fake.nvmlInit()
    event_set = fake.nvmlEventSetCreate()
    xid = fake.nvmlEventTypeXidCriticalError
    expected = ["Not Supported", "Insufficient Permissions", "GPU is lost"]
    for device, text in zip(fake.devices, expected, strict=True):
        with pytest.raises(NVMLError, match=text):
            fake.nvmlDeviceRegisterEvents(device, xid, event_set)
    fake.event_wait_error = fake.NVML_ERROR_UNKNOWN
    with pytest.raises(NVMLError, match="Unknown Error"):
        fake.nvmlEventSetWait_v2(event_set, 0)


def test_from_script_schedules_xids_and_event_errors() -> None:
    script = {
        "event_wait_error": None,
        "devices": [
            {"uuid": "GPU-a", "xids": [[2, 43], {"sample": 0, "xid": 31}]},
            {"uuid": "GPU-b", "unsupported": ["events"]},
            {"uuid": "GPU-c", "events_error": "NO_PERMISSION"},
        ],
    }
    fake = FakeNvml.from_script(json.loads(json.dumps(script)))
    assert fake.devices[0].xids == [(0, 31), (2, 43)]
    assert "events" in fake.devices[1].unsupported
    assert fake.devices[2].events_error == fake.NVML_ERROR_NO_PERMISSION
    sampler = NvmlSampler(fake)
    sampler.open()
    assert sampler.xid_devices == (0,)
    seen = []
    for t in range(3):
        sampler.sample(float(t))
        seen.append([e.xid for e in sampler.poll_xid_events(float(t))])
    assert seen == [[31], [], [43]]
    broken = FakeNvml.from_script({"event_wait_error": "UNKNOWN", "devices": [{}]})
    assert broken.event_wait_error == broken.NVML_ERROR_UNKNOWN


def test_from_script_raises_an_xid_once_its_file_exists(tmp_path: Path) -> None:
    trigger = tmp_path / "xid-now"
    script = {"devices": [{}, {"xids": [{"file_exists": str(trigger), "xid": 79}]}]}
    fake = FakeNvml.from_script(json.loads(json.dumps(script)))
    sampler = NvmlSampler(fake)
    sampler.open()
    seen = []
    for t in range(6):
        if t == 3:
            trigger.touch()
        sampler.sample(float(t))
        seen.append([(e.gpu_index, e.xid) for e in sampler.poll_xid_events(float(t))])
    assert seen == [[], [], [], [(1, 79)], [], []]  # once, when the file came
    assert fake.devices[1].xid_files == []


def test_from_script_refuses_bad_xids() -> None:
    with pytest.raises(ValueError, match=r"devices\[0\]\.xids\[0\] must be \[sample, xid\]"):
        FakeNvml.from_script({"devices": [{"xids": [[1]]}]})
    with pytest.raises(ValueError, match=r"devices\[0\]\.xids\[1\] must be"):
        FakeNvml.from_script({"devices": [{"xids": [[1, 2], {"sample": 1}]}]})
    with pytest.raises(ValueError, match=r"unknown key 'at' in devices\[0\]\.xids\[0\]"):
        FakeNvml.from_script({"devices": [{"xids": [{"at": 1, "xid": 2}]}]})
    with pytest.raises(ValueError, match=r"unknown key 'sample' in devices\[0\]\.xids\[0\]"):
        FakeNvml.from_script({"devices": [{"xids": [{"file_exists": "x", "sample": 1}]}]})
    with pytest.raises(ValueError, match=r"devices\[0\]\.xids\[0\] must be .*file_exists"):
        FakeNvml.from_script({"devices": [{"xids": [{"file_exists": 3, "xid": 79}]}]})
    with pytest.raises(ValueError, match=r"devices\[0\]: unknown NVML error 'NOPE'"):
        FakeNvml.from_script({"devices": [{"events_error": "NOPE"}]})
