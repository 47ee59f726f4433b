"""Live GPU sampling through NVML (the only module of gpuwatchd that imports ``pynvml``).

Specification: docs/modules.md#gpuwatchdsamplingnvml
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Final

from gpuwatchd.errors import NvmlUnavailable
from gpuwatchd.model import NA, GpuProcess, GpuSample, MaybeInt
from gpuwatchd.xid import XidEvent, describe

__all__ = ["LOST_DEVICE_RETRY_S", "MAX_XID_EVENTS_PER_POLL", "XID_LOST_POLLS_MAX", "NvmlSampler"]

LOST_DEVICE_RETRY_S: Final = 30.0
"""Seconds (of the caller's clock) between two attempts to reopen a failed device."""

XID_LOST_POLLS_MAX: Final = 3
"""Polls in a row that ``nvmlEventSetWait`` may answer ``NVML_ERROR_GPU_IS_LOST`` (each
time the set is made again without the lost GPU) before Xid polling is turned off."""

MAX_XID_EVENTS_PER_POLL: Final = 1000
"""Events one :meth:`NvmlSampler.poll_xid_events` takes at most (a storm of Xids must not
stall the tick); the rest wait in NVML's queue for the next poll."""

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


def _handle_key(handle: object) -> object:
    """What identifies a device handle: the address a pynvml ``c_nvmlDevice_t`` points to
    (two pointer objects to one device compare unequal), else the object itself."""
    import ctypes

    try:
        return ("address", ctypes.cast(handle, ctypes.c_void_p).value)  # type: ignore[arg-type]
    except (ctypes.ArgumentError, TypeError):
        return ("object", id(handle))


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
    ``nvmlDeviceGetComputeRunningProcesses``), and :meth:`poll_xid_events` one
    ``nvmlEventSetWait_v2`` for all devices when no Xid is pending.
    """

    def __init__(self, nvml: object | None = None) -> None:
        self._given: object | None = nvml
        self._nvml: Any = None
        self._devices: list[_Device] = []
        self._opened = False
        self._memory_version: object | None = None
        self._not_supported: int | None = None
        self._event_set: Any = None
        self._xid_devices: tuple[int, ...] = ()
        self._xid_unsupported: dict[int, str] = {}
        self._xid_error: str | None = None
        self._xid_lost_polls = 0

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
        self._open_xid_events()

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
        """Free the Xid event set and shut NVML down (``nvmlEventSetFree``,
        ``nvmlShutdown``). Idempotent; errors on the way are ignored."""
        if not self._opened:
            return
        self._opened = False
        self._free_event_set()
        self._xid_devices = ()
        self._devices = []
        self._shutdown_quietly()

    # -- Xid events ------------------------------------------------------------------

    def _open_xid_events(self) -> None:
        """Create the event set and register each device for Xid events (in :meth:`open`).

        Never raises: a device that refuses is noted in :attr:`xid_unsupported`; no event
        API, no set, or no device that accepts turns Xid polling off (:attr:`xid_error`).
        A device that failed at :meth:`open` is not registered (it has no handle yet).
        """
        nvml = self._nvml
        self._event_set, self._xid_devices, self._xid_unsupported = None, (), {}
        self._xid_error = None
        event_type = getattr(nvml, "nvmlEventTypeXidCriticalError", None)
        create = getattr(nvml, "nvmlEventSetCreate", None)
        register = getattr(nvml, "nvmlDeviceRegisterEvents", None)
        if event_type is None or create is None or register is None:
            self._xid_error = "the NVML bindings have no event API"
            return
        try:
            event_set = self._call(create)
        except _CallFailed as exc:
            self._xid_error = f"nvmlEventSetCreate failed (NVML: {exc.message})"
            return
        except Exception as exc:  # a binding bug must not fail open()
            self._xid_error = f"nvmlEventSetCreate failed ({type(exc).__name__}: {exc})"
            return
        if event_set is NA:
            self._xid_error = "NVML has no event sets on this system (Not Supported)"
            return
        self._event_set = event_set
        registered = []
        for device in self._devices:
            if device.handle is None:
                self._xid_unsupported[device.index] = f"not opened ({device.error})"
                continue
            try:
                result = self._call(register, device.handle, event_type, event_set)
            except _CallFailed as exc:
                self._xid_unsupported[device.index] = exc.message
                continue
            except Exception as exc:
                self._xid_unsupported[device.index] = f"{type(exc).__name__}: {exc}"
                continue
            if result is NA:
                self._xid_unsupported[device.index] = "Not Supported"
                continue
            registered.append(device.index)
        self._xid_devices = tuple(registered)
        if not registered:
            self._free_event_set()
            self._xid_error = "no GPU supports Xid events"

    def _free_event_set(self) -> None:
        event_set, self._event_set = self._event_set, None
        if event_set is None:
            return
        with contextlib.suppress(Exception):
            self._call(self._nvml.nvmlEventSetFree, event_set)

    def _disable_xid(self, reason: str) -> None:
        self._xid_error = reason
        self._xid_devices = ()
        self._free_event_set()

    @property
    def xid_devices(self) -> tuple[int, ...]:
        """NVML indices of the GPUs whose Xid errors :meth:`poll_xid_events` reports
        (empty when Xid polling is off)."""
        return self._xid_devices

    @property
    def xid_unsupported(self) -> dict[int, str]:
        """NVML index -> why that GPU has no Xid events (``"Not Supported"``,
        ``"Insufficient Permissions"``, ...), for the GPUs that refused registration."""
        return dict(self._xid_unsupported)

    @property
    def xid_error(self) -> str | None:
        """Why Xid polling is off (``None`` while it works)."""
        return self._xid_error

    def poll_xid_events(self, now_s: float) -> tuple[XidEvent, ...]:
        """Drain the pending Xid events without blocking; each stamped ``now_s``.

        Calls ``nvmlEventSetWait_v2(set, 0)`` (``nvmlEventSetWait`` where the bindings
        lack ``_v2``) until ``NVML_ERROR_TIMEOUT`` (nothing pending), at most
        :data:`MAX_XID_EVENTS_PER_POLL` times. An event's ``device`` handle is mapped
        back to the NVML index by address, else by its UUID; one that matches no
        device gets ``gpu_index=-1``. ``NVML_ERROR_GPU_IS_LOST`` (NVML API reference,
        ``nvmlEventSetWait``: a GPU has fallen off the bus) ends this poll and makes the
        set again without that GPU (:meth:`_xid_gpu_lost`). Never raises: any other error
        turns polling off (see :attr:`xid_error`) and returns what was drained before it.
        Returns ``()`` when polling is off or the sampler is closed.
        """
        if not self._opened or self._event_set is None:
            return ()
        nvml = self._nvml
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        xid_type = int(nvml.nvmlEventTypeXidCriticalError)
        timeout = getattr(nvml, "NVML_ERROR_TIMEOUT", None)
        gpu_lost = getattr(nvml, "NVML_ERROR_GPU_IS_LOST", None)
        events: list[XidEvent] = []
        for _ in range(MAX_XID_EVENTS_PER_POLL):
            try:
                data = self._call(wait, self._event_set, 0)
                if data is NA:
                    self._disable_xid("nvmlEventSetWait: Not Supported")
                    break
                if not int(data.eventType) & xid_type:
                    continue  # only Xids are registered; ignore anything else
                events.append(self._xid_event(data, now_s))
            except _CallFailed as exc:
                if exc.code is not None and exc.code == timeout:
                    self._xid_lost_polls = 0
                    break
                if exc.code is not None and exc.code == gpu_lost:
                    self._xid_gpu_lost()
                    break
                self._disable_xid(f"nvmlEventSetWait failed (NVML: {exc.message})")
                break
            except Exception as exc:  # a binding bug must not stop the daemon's tick
                self._disable_xid(f"nvmlEventSetWait failed ({type(exc).__name__}: {exc})")
                break
        return tuple(events)

    def _xid_gpu_lost(self) -> None:
        """A GPU of the event set fell off the bus: make the set again without it.

        Registration is per device, so the lost GPU refuses it (it lands in
        :attr:`xid_unsupported`) and the others go on reporting. After
        :data:`XID_LOST_POLLS_MAX` such polls in a row Xid polling is turned off.
        """
        self._xid_lost_polls += 1
        if self._xid_lost_polls >= XID_LOST_POLLS_MAX:
            self._disable_xid(
                f"nvmlEventSetWait: GPU is lost ({self._xid_lost_polls} polls in a row)"
            )
            return
        self._free_event_set()
        self._open_xid_events()

    def _xid_event(self, data: Any, now_s: float) -> XidEvent:
        """An :class:`XidEvent` from a ``c_nvmlEventData_t``."""
        xid = int(data.eventData)
        device = self._device_of(data.device)
        if device is None:
            return XidEvent(now_s, -1, "", xid, describe(xid))
        return XidEvent(now_s, device.index, device.uuid, xid, describe(xid))

    def _device_of(self, handle: Any) -> _Device | None:
        """The device ``handle`` names: same address as a known handle, else same UUID."""
        key = _handle_key(handle)
        for device in self._devices:
            if device.handle is not None and _handle_key(device.handle) == key:
                return device
        try:
            uuid = self._call(self._nvml.nvmlDeviceGetUUID, handle)
        except Exception:
            return None
        if uuid is NA:
            return None
        text = _text(uuid)
        return next((d for d in self._devices if d.uuid == text), None)

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
