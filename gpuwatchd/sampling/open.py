"""Opening the daemon's GPU sampler from ``--devices`` (NVML, a replayed trace, or none)."""

from __future__ import annotations

from typing import Any

from gpuwatchd.errors import NvmlUnavailable
from gpuwatchd.logs import get_logger
from gpuwatchd.model import GpuSample
from gpuwatchd.sampling import GpuSampler

__all__ = ["HostOnlySampler", "open_gpu_sampler"]


class HostOnlySampler:
    """The GPU sampler used when there is no GPU to watch: returns no samples.

    ``reason`` is shown by ``gpuwatchctl status`` as ``host-only: <reason>``.
    """

    def __init__(self, reason: str) -> None:
        self.reason = reason

    @property
    def status(self) -> str:
        """``"host-only: <reason>"``."""
        return f"host-only: {self.reason}"

    def sample(self, now_s: float) -> tuple[GpuSample, ...]:
        """Return no GPU samples."""
        return ()

    def close(self) -> None:
        """Nothing to release."""


def open_gpu_sampler(devices: str, *, logger: Any = None) -> GpuSampler:
    """Open the GPU sampler named by ``devices`` (``auto``, ``nvml``, ``none``, ``replay:PATH``).

    ``auto`` and ``nvml`` fall back to :class:`HostOnlySampler` when NVML cannot be
    initialised (no driver, no library, driver/library mismatch) and log that once:
    the daemon keeps watching the host. ``replay:PATH`` raises
    :class:`~gpuwatchd.errors.ReplayError` for an unreadable trace.
    """
    log = logger or get_logger("gpuwatchd.daemon")
    if devices == "none":
        return HostOnlySampler("GPU sampling disabled (--devices none)")
    if devices.startswith("replay:"):
        from gpuwatchd.sampling.replay import ReplaySampler, parse_trace

        trace = parse_trace(devices[len("replay:") :])
        log.info(
            "replaying trace",
            path=str(trace.path),
            gpus=trace.gpu_count,
            frames=len(trace.frames),
            duration_s=round(trace.duration_s, 1),
        )
        # The daemon scales its own clock by replay_speed (see Daemon), so the sampler
        # plays at speed 1 on that clock and `for:` durations stay in trace seconds.
        return ReplaySampler(trace, speed=1.0)
    from gpuwatchd.sampling.nvml import NvmlSampler

    sampler = NvmlSampler()
    try:
        sampler.open()
    except NvmlUnavailable as exc:
        log.warning("running host-only", reason=exc.reason, devices=devices)
        return HostOnlySampler(exc.reason)
    return sampler
