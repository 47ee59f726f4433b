"""Opening the daemon's GPU sampler from --devices (gpuwatchd.sampling.open)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import TRACES
from gpuwatchd.errors import ReplayError
from gpuwatchd.sampling.open import HostOnlySampler, NvmlRetrySampler, open_gpu_sampler
from gpuwatchd.testing import FakeNvml


def test_devices_none_watches_the_host_only() -> None:
    sampler = open_gpu_sampler("none")
    assert isinstance(sampler, HostOnlySampler)
    assert sampler.status == "host-only: GPU sampling disabled (--devices none)"
    assert sampler.sample(0.0) == ()


def test_a_replayed_trace_plays_its_gpus() -> None:
    sampler = open_gpu_sampler(f"replay:{TRACES / 'titanx2_gpt_ddp_100ms.csv'}")
    try:
        assert sampler.status.startswith("replay: ")
    finally:
        sampler.close()


def test_an_unreadable_trace_is_a_replay_error(tmp_path: Path) -> None:
    with pytest.raises(ReplayError):
        open_gpu_sampler(f"replay:{tmp_path / 'missing.csv'}")


def test_nvml_opens_the_gpus_it_finds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml.h100s(2))
    sampler = open_gpu_sampler("nvml")
    try:
        assert sampler.status == "nvml"
        assert [gpu.index for gpu in sampler.sample(0.0)] == [0, 1]
    finally:
        sampler.close()


def test_nvml_that_fails_at_start_is_retried_with_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver loaded after the daemon: init fails twice, then the GPUs appear."""
    fake = FakeNvml.h100s(2)
    fake.init_error, fake.init_failures = 9, 2  # NVML_ERROR_DRIVER_NOT_LOADED
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    now = [0.0]

    class Log:
        def __init__(self) -> None:
            self.events: list[str] = []

        def __getattr__(self, level: str) -> object:
            return lambda event, **fields: self.events.append(event)

    log = Log()
    assert isinstance(open_gpu_sampler("auto", logger=log), NvmlRetrySampler)  # init 1 failed
    from gpuwatchd.sampling.nvml import NvmlSampler

    def open_nvml() -> NvmlSampler:
        nvml = NvmlSampler()
        nvml.open()
        return nvml

    sampler = NvmlRetrySampler("driver not loaded", open_nvml, logger=log, clock=lambda: now[0])
    assert sampler.status.startswith("host-only: ") and sampler.sample(0.0) == ()
    now[0] = 1.0  # the first retry is due: it fails, the next waits 2 s
    assert sampler.sample(1.0) == () and fake.calls["nvmlInit"] == 2
    now[0] = 2.5
    assert sampler.sample(2.5) == () and fake.calls["nvmlInit"] == 2  # not due yet
    now[0] = 3.5
    assert [gpu.index for gpu in sampler.sample(3.5)] == [0, 1]
    assert sampler.status == "nvml" and log.events.count("nvml.gpus_appeared") == 1
    assert isinstance(sampler.xid_devices, tuple)  # the NVML sampler's own attribute
    sampler.close()
    assert fake.init_count == 0
