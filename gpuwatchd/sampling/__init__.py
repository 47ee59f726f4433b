"""Samplers: where snapshots come from (NVML, the host, a recorded trace).

A GPU sampler turns "now" into one :class:`~gpuwatchd.model.GpuSample` per GPU.
These implement :class:`GpuSampler`:

* :class:`gpuwatchd.sampling.nvml.NvmlSampler` reads the live GPUs through NVML
  (status ``"nvml"``);
* :class:`gpuwatchd.sampling.replay.ReplaySampler` plays an ``nvidia-smi --format=csv``
  log on the caller's clock (status ``"replay: <path>"``);
* :class:`gpuwatchd.sampling.open.HostOnlySampler` reports no GPU, for a host without NVIDIA driver
  or with ``devices: none`` (status ``"host-only: <reason>"``).

The host side (:class:`gpuwatchd.sampling.host.HostSampler`) has its own interface
because it also needs the pids of the attached jobs.

This package never imports ``pynvml`` or ``psutil`` itself: only
:mod:`gpuwatchd.sampling.nvml` and :mod:`gpuwatchd.sampling.host` do, lazily, so that
importing :mod:`gpuwatchd.sampling` is cheap and works on any machine.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gpuwatchd.model import GpuSample

__all__ = ["GpuSampler"]


@runtime_checkable
class GpuSampler(Protocol):
    """What the daemon's tick needs from a source of GPU samples."""

    def sample(self, now_s: float) -> tuple[GpuSample, ...]:
        """Return one sample per GPU, ordered by NVML index, stamped ``timestamp_s=now_s``.

        Never raises for a per-device failure: such a device's sample carries
        ``error`` and NA metrics instead.
        """
        ...

    @property
    def status(self) -> str:
        """``"nvml"``, ``"host-only: <reason>"`` or ``"replay: <path>"`` (for ``status``)."""
        ...

    def close(self) -> None:
        """Release the source (``nvmlShutdown`` for NVML). Idempotent."""
        ...
