"""Opening the daemon's GPU sampler from ``--devices`` (NVML, a replayed trace, or none)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

from gpuwatchd.errors import NvmlUnavailable
from gpuwatchd.logs import get_logger
from gpuwatchd.model import GpuSample
from gpuwatchd.sampling import GpuSampler

__all__ = ["HostOnlySampler", "NvmlRetrySampler", "open_gpu_sampler"]

NVML_RETRY_FIRST_S: Final = 1.0
"""The first retry of a failed NVML init comes this many seconds after the failure."""
NVML_RETRY_MAX_S: Final = 60.0
"""Retries back off by doubling up to this interval (a driver loaded an hour late is
seen within a minute; a host without GPUs costs one failed nvmlInit a minute)."""


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


class NvmlRetrySampler:
    """Host-only while NVML cannot be initialised, retrying ``nvmlInit`` with backoff.

    A driver that comes up after the daemon (late module load, driver reload, a
    persistence daemon starting later) is picked up without a restart: the first
    :meth:`sample` after a successful retry returns the GPUs, logged once as
    ``nvml.gpus_appeared``. Retries wait :data:`NVML_RETRY_FIRST_S`, then twice as
    long each time up to :data:`NVML_RETRY_MAX_S` (``clock``: seconds, default
    ``time.monotonic``). ``open_nvml`` opens a sampler or raises
    :class:`~gpuwatchd.errors.NvmlUnavailable`. Other attributes (Xid polling) are the
    NVML sampler's once it is open.
    """

    def __init__(
        self,
        reason: str,
        open_nvml: Callable[[], GpuSampler],
        *,
        logger: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reason = reason
        self._open_nvml = open_nvml
        self._log = logger
        self._clock = clock
        self._delay_s = NVML_RETRY_FIRST_S
        self._next_try_s = clock() + self._delay_s
        self._attempts = 1
        self._inner: GpuSampler | None = None

    @property
    def status(self) -> str:
        """The NVML sampler's status once open, else ``"host-only: <reason>"``."""
        return self._inner.status if self._inner is not None else f"host-only: {self.reason}"

    def sample(self, now_s: float) -> tuple[GpuSample, ...]:
        """The GPUs once NVML is up (retrying when due), else none."""
        if self._inner is None and self._clock() >= self._next_try_s:
            self._attempts += 1
            try:
                self._inner = self._open_nvml()
            except NvmlUnavailable as exc:
                self.reason = exc.reason
                self._delay_s = min(self._delay_s * 2, NVML_RETRY_MAX_S)
                self._next_try_s = self._clock() + self._delay_s
                self._log.debug(
                    "nvml.init_retry_failed", reason=exc.reason, next_retry_s=self._delay_s
                )
                return ()
            samples = self._inner.sample(now_s)
            self._log.info(
                "nvml.gpus_appeared",
                gpus=len(samples),
                attempts=self._attempts,
                uuids=[gpu.uuid for gpu in samples],
            )
            return samples
        return self._inner.sample(now_s) if self._inner is not None else ()

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def close(self) -> None:
        """Close the NVML sampler if it was opened. Idempotent."""
        if self._inner is not None:
            self._inner.close()


def open_gpu_sampler(
    devices: str, *, logger: Any = None, interval_s: float | None = None
) -> GpuSampler:
    """Open the GPU sampler named by ``devices`` (``auto``, ``nvml``, ``none``, ``replay:PATH``).

    ``interval_s`` (the daemon's tick interval) bounds the NVML sampler's per-call
    deadline to a quarter of it (:data:`gpuwatchd.sampling.nvml.CALL_DEADLINE_S` at most),
    so a hung driver call never makes a tick miss its interval.

    ``auto`` and ``nvml`` fall back to :class:`NvmlRetrySampler` when NVML cannot be
    initialised (no driver, no library, driver/library mismatch) and log that once:
    the daemon keeps watching the host and retries NVML with backoff. ``replay:PATH`` raises
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
    from gpuwatchd.sampling.nvml import CALL_DEADLINE_S, NvmlSampler

    deadline_s = CALL_DEADLINE_S if interval_s is None else min(CALL_DEADLINE_S, interval_s / 4)

    def open_nvml() -> GpuSampler:
        sampler = NvmlSampler(deadline_s=deadline_s)
        sampler.open()
        return sampler

    try:
        return open_nvml()
    except NvmlUnavailable as exc:
        log.warning("running host-only", reason=exc.reason, devices=devices)
        return NvmlRetrySampler(exc.reason, open_nvml, logger=log)
