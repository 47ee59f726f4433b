"""Opening the daemon's GPU sampler from --devices (gpuwatchd.sampling.open)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import TRACES
from gpuwatchd.errors import ReplayError
from gpuwatchd.sampling.open import HostOnlySampler, open_gpu_sampler
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
