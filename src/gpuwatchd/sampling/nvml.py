"""Live GPU sampling through NVML (the only module of gpuwatchd that imports ``pynvml``).

``pynvml`` is the module of the ``nvidia-ml-py`` package (NVIDIA's own bindings of
the NVIDIA Management Library). It is imported inside :meth:`NvmlSampler.open`,
never at import time, so this module loads on machines without a driver.

Every NVML call goes through one choke point, :meth:`NvmlSampler._call`, which
maps ``NVMLError`` codes (NVML API reference, "Error reporting"):

* ``NVML_ERROR_NOT_SUPPORTED`` -> :data:`~gpuwatchd.model.NA` for that one field
  (e.g. ``power.draw`` on a GPU without a power sensor, as nvidia-smi's ``[N/A]``);
* any other code (``NVML_ERROR_GPU_IS_LOST``, ``NVML_ERROR_UNKNOWN``, ...) fails the
  whole device for this tick: its :class:`~gpuwatchd.model.GpuSample` gets
  ``error="<NVML message>"`` and NA metrics, the other devices are unaffected.

A failed device is retried (its handle re-fetched with
``nvmlDeviceGetHandleByIndex``) at most every :data:`LOST_DEVICE_RETRY_S` seconds.

Error classes and constants are always read from the module object the sampler
was given (``self._nvml.NVMLError``), so :class:`gpuwatchd.testing.nvml.FakeNvml`
can stand in for ``pynvml``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Final

from gpuwatchd.errors import NvmlUnavailable
from gpuwatchd.model import NA, GpuProcess, GpuSample, MaybeInt

__all__ = ["LOST_DEVICE_RETRY_S", "NvmlSampler"]

LOST_DEVICE_RETRY_S: Final = 30.0
"""Seconds (of the caller's clock) between two attempts to reopen a failed device."""

_MW_PER_W: Final = 1000.0
"""``nvmlDeviceGetPowerUsage`` returns milliwatts (NVML API reference)."""


class _CallFailed(Exception):
    """An NVML call failed with a code other than NOT_SUPPORTED (internal)."""

    def __init__(self, code: int | None, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(message)


@dataclass(slots=True)
class _Device:
    index: int
    handle: Any
    uuid: str
    name: str
    memory_total_bytes: MaybeInt
    static_known: bool = False
    error: str | None = None
    retry_at_s: float | None = None
    """When ``error`` is set: earliest ``now_s`` of the next reopen (None: next tick)."""


def _text(value: object) -> str:
    """Old bindings return ``bytes`` for names and UUIDs, new ones ``str``."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


class NvmlSampler:
    """Sample every GPU NVML sees, one :class:`~gpuwatchd.model.GpuSample` per device.

    ``nvml`` is the ``pynvml`` module to use; ``None`` (the default) imports the
    real one in :meth:`open`. Tests pass a :class:`gpuwatchd.testing.nvml.FakeNvml`.

    Usage::

        sampler = NvmlSampler()
        sampler.open()                 # raises NvmlUnavailable -> run host-only
        samples = sampler.sample(time.time())
        sampler.close()

    Static device facts (UUID, name, ``memory.total``) are read once in
    :meth:`open`; a tick makes five NVML calls per device
    (``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetMemoryInfo``,
    ``nvmlDeviceGetTemperature``, ``nvmlDeviceGetPowerUsage``,
    ``nvmlDeviceGetComputeRunningProcesses``).
    """

    def __init__(self, nvml: object | None = None) -> None:
        self._given: object | None = nvml
        self._nvml: Any = None
        self._devices: list[_Device] = []
        self._opened = False
        self._memory_version: object | None = None
        self._not_supported: int | None = None

    # -- the choke point -------------------------------------------------------------

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call the NVML function ``fn``; the only place that handles ``NVMLError``.

        Returns ``fn``'s result, or :data:`NA` when NVML answers
        ``NVML_ERROR_NOT_SUPPORTED``. Raises :class:`_CallFailed` (code and NVML's
        message) for every other NVML error.
        """
        try:
            return fn(*args, **kwargs)
        except self._nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code is not None and code == self._not_supported:
                return NA
            try:
                message = str(exc)
            except Exception:  # str() of a pynvml error may call back into NVML
                message = f"NVML error {code}"
            raise _CallFailed(code, message) from None

    # -- life cycle ------------------------------------------------------------------

    def open(self) -> None:
        """Initialise NVML and read each device's UUID, name and ``memory.total`` once.

        Raises :class:`~gpuwatchd.errors.NvmlUnavailable` with a one-line reason
        when the bindings are not installed, the NVIDIA driver or ``libnvidia-ml``
        is missing (``NVML_ERROR_DRIVER_NOT_LOADED``, ``NVML_ERROR_LIBRARY_NOT_FOUND``),
        the driver and library versions differ (``NVML_ERROR_LIB_RM_VERSION_MISMATCH``),
        or NVML sees no GPU. A device that fails here does not fail the others: it
        is reported with ``error`` and reopened on the next :meth:`sample`.
        Calling ``open`` on an open sampler does nothing.
        """
        if self._opened:
            return
        nvml: Any = self._given
        if nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise NvmlUnavailable(
                    f"NVML bindings not installed (pip install nvidia-ml-py): {exc}"
                ) from None
            nvml = pynvml
        self._nvml = nvml
        self._not_supported = nvml.NVML_ERROR_NOT_SUPPORTED
        try:
            self._call(nvml.nvmlInit)
        except _CallFailed as exc:
            raise NvmlUnavailable(self._init_reason(exc)) from None
        try:
            count = self._call(nvml.nvmlDeviceGetCount)
        except _CallFailed as exc:
            self._shutdown_quietly()
            raise NvmlUnavailable(f"NVML cannot count GPUs (NVML: {exc.message})") from None
        if count is NA or int(count) <= 0:
            self._shutdown_quietly()
            raise NvmlUnavailable("no NVIDIA GPU found (NVML reports 0 devices)")
        self._memory_version = getattr(nvml, "nvmlMemory_v2", None)
        devices = []
        for index in range(int(count)):
            device = _Device(index, None, f"GPU-unknown-index-{index}", "unknown", NA)
            try:
                self._reopen(device)
            except _CallFailed as exc:
                device.error = exc.message
            devices.append(device)
        self._devices = devices
        self._opened = True

    def _init_reason(self, exc: _CallFailed) -> str:
        """One line for ``gpuwatchctl status`` from an ``nvmlInit`` failure."""
        nvml = self._nvml
        reasons = {
            getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", None): "no NVIDIA driver",
            getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", None): (
                "no NVIDIA driver (libnvidia-ml.so.1 not found)"
            ),
            getattr(nvml, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", None): (
                "NVIDIA driver/library version mismatch (reboot or reload the nvidia module)"
            ),
            getattr(nvml, "NVML_ERROR_NO_PERMISSION", None): (
                "no permission to use the NVIDIA driver"
            ),
        }
        reasons.pop(None, None)
        what = reasons.get(exc.code, "NVML failed to start")
        return f"{what} (NVML: {exc.message})"

    def _shutdown_quietly(self) -> None:
        with contextlib.suppress(_CallFailed):
            self._call(self._nvml.nvmlShutdown)

    def close(self) -> None:
        """Shut NVML down (``nvmlShutdown``). Idempotent; errors on shutdown are ignored."""
        if not self._opened:
            return
        self._opened = False
        self._devices = []
        self._shutdown_quietly()

    # -- sampling --------------------------------------------------------------------

    @property
    def status(self) -> str:
        """``"nvml"`` (the daemon shows it in ``gpuwatchctl status``)."""
        return "nvml"

    @property
    def device_errors(self) -> dict[int, str]:
        """NVML index -> error of every device that failed its last sample (or open).

        The daemon compares it tick to tick to log a device's loss and recovery once.
        """
        return {d.index: d.error for d in self._devices if d.error is not None}

    def sample(self, now_s: float) -> tuple[GpuSample, ...]:
        """Return one sample per device in NVML index order, stamped ``now_s``.

        Units: ``utilization.gpu`` percent (``nvmlDeviceGetUtilizationRates().gpu``),
        ``memory.used``/``memory.total`` bytes (``nvmlDeviceGetMemoryInfo``, v2 where
        the driver has it), ``temperature.gpu`` °C (``NVML_TEMPERATURE_GPU``),
        ``power.draw`` W (milliwatts / 1000), processes with ``usedGpuMemory`` bytes.
        Never raises for a device failure (see the module docstring).
        Raises ``RuntimeError`` when the sampler is not open.
        """
        if not self._opened:
            raise RuntimeError("NvmlSampler.sample() called before open() or after close()")
        return tuple([self._sample_device(device, now_s) for device in self._devices])

    def _reopen(self, device: _Device) -> None:
        """(Re)fetch the handle of ``device``, and its static facts if not known yet.

        Raises :class:`_CallFailed`. Static facts are read once: a reopened device
        keeps the UUID, name and ``memory.total`` read at :meth:`open`.
        """
        nvml = self._nvml
        handle = self._call(nvml.nvmlDeviceGetHandleByIndex, device.index)
        if handle is NA:
            raise _CallFailed(self._not_supported, "Not Supported")
        device.handle = handle
        if device.static_known:
            return
        uuid = self._call(nvml.nvmlDeviceGetUUID, handle)
        name = self._call(nvml.nvmlDeviceGetName, handle)
        memory = self._memory_info(handle)
        if uuid is not NA:
            device.uuid = _text(uuid)
        if name is not NA:
            device.name = _text(name)
        device.memory_total_bytes = NA if memory is NA else int(memory.total)
        device.static_known = True

    def _memory_info(self, handle: Any) -> Any:
        """``nvmlDeviceGetMemoryInfo``: v2 (``used`` without driver-reserved memory) or v1.

        Falls back to v1 for good when the binding or driver lacks v2
        (``TypeError``, ``NVML_ERROR_FUNCTION_NOT_FOUND``,
        ``NVML_ERROR_ARGUMENT_VERSION_MISMATCH``).
        """
        get = self._nvml.nvmlDeviceGetMemoryInfo
        version = self._memory_version
        if version is not None:
            try:
                info = self._call(get, handle, version=version)
            except TypeError:
                info = None
            except _CallFailed as exc:
                no_v2 = (
                    getattr(self._nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", None),
                    getattr(self._nvml, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", None),
                )
                if exc.code is None or exc.code not in no_v2:
                    raise
                info = None
            if info is None:
                self._memory_version = None
            elif info is not NA:
                return info
        return self._call(get, handle)

    def _sample_device(self, device: _Device, now_s: float) -> GpuSample:
        if device.error is not None:
            if device.retry_at_s is not None and now_s < device.retry_at_s:
                return self._failed_sample(device, now_s)
            try:
                self._reopen(device)
            except _CallFailed as exc:
                return self._fail(device, exc.message, now_s)
            except Exception as exc:  # a binding bug must not stop the daemon's tick
                return self._fail(device, f"{type(exc).__name__}: {exc}", now_s)
        try:
            sample = self._read(device, now_s)
        except _CallFailed as exc:
            return self._fail(device, exc.message, now_s)
        except Exception as exc:  # a binding bug or odd value must not stop the daemon's tick
            return self._fail(device, f"{type(exc).__name__}: {exc}", now_s)
        device.error = None
        device.retry_at_s = None
        return sample

    def _read(self, device: _Device, now_s: float) -> GpuSample:
        """The five per-tick NVML reads of one device; raises :class:`_CallFailed`."""
        nvml = self._nvml
        call = self._call
        handle = device.handle
        rates = call(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = self._memory_info(handle)
        temperature = call(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
        power_mw = call(nvml.nvmlDeviceGetPowerUsage, handle)
        processes = call(nvml.nvmlDeviceGetComputeRunningProcesses, handle)
        procs: tuple[GpuProcess, ...] = ()
        if processes is not NA:
            procs = tuple(
                [
                    GpuProcess(
                        int(p.pid),
                        NA if p.usedGpuMemory is None else int(p.usedGpuMemory),
                    )
                    for p in processes
                ]
            )
        return GpuSample(
            device.uuid,
            device.index,
            device.name,
            now_s,
            NA if rates is NA else float(rates.gpu),
            NA if memory is NA else int(memory.used),
            device.memory_total_bytes,
            NA if temperature is NA else float(temperature),
            NA if power_mw is NA else power_mw / _MW_PER_W,
            procs,
            None,
        )

    def _fail(self, device: _Device, message: str, now_s: float) -> GpuSample:
        device.error = message
        device.retry_at_s = now_s + LOST_DEVICE_RETRY_S
        return self._failed_sample(device, now_s)

    @staticmethod
    def _failed_sample(device: _Device, now_s: float) -> GpuSample:
        return GpuSample(
            uuid=device.uuid,
            index=device.index,
            name=device.name,
            timestamp_s=now_s,
            error=device.error,
        )
