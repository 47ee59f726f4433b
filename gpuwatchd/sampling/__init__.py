"""Samplers: where snapshots come from (NVML, the host, a recorded trace).

Specification: docs/modules.md#gpuwatchdsampling
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
