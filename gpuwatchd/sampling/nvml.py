"""Live GPU sampling through NVML (the only module of gpuwatchd that imports ``pynvml``).

Specification: docs/modules.md#gpuwatchdsamplingnvml
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Final

from gpuwatchd.errors import NvmlUnavailable
from gpuwatchd.model import NA, GpuHealth, GpuProcess, GpuSample, MaybeFloat, MaybeInt, MigDevice
from gpuwatchd.xid import XidEvent, describe

__all__ = [
    "CALL_DEADLINE_S",
    "HEALTH_FIELDS",
    "LOST_DEVICE_RETRY_S",
    "MAX_XID_EVENTS_PER_POLL",
    "SLOW_READ_INTERVAL_S",
    "XID_LOST_POLLS_MAX",
    "NvmlSampler",
]

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

CALL_DEADLINE_S: Final = 0.25
"""Seconds :meth:`NvmlSampler.sample` waits for a device's NVML calls (all devices at
once, each on its own worker thread) before it reports that device ``stale`` with the
call still in flight. A healthy H100 answers a whole tick's calls in about 10 ms
(tests/data/gpu/h100_nvml_probe.json); the daemon uses ``min(CALL_DEADLINE_S,
interval / 4)`` so a hung driver call never makes a tick miss its interval."""

SLOW_READ_INTERVAL_S: Final = 5.0
"""Seconds (of the caller's clock) between two reads of the expensive groups: GPM
(``nvmlGpmSampleGet`` ~730 µs + ``nvmlGpmMetricsGet`` ~3900 µs), the health fields
(``nvmlDeviceGetFieldValues``: ~5000 µs for 18 fields on the H100), per-process
utilization (``nvmlDeviceGetProcessUtilization`` ~1400-2000 µs) and MIG (``nvmlDeviceGetMigMode``
~360 µs), all measured on the H100 of tests/data/gpu/h100_nvml_probe.json. Read every
1-s tick they would cost ~10 ms of CPU per GPU per second (1 % of a core per GPU, 8 % on
an 8-GPU node); every 5 s they cost ~2 ms/s per GPU, against ~25 µs for the five basic
reads. GPM metrics are computed between the last two GPM samples, so a 5-s cadence gives
the mean over those 5 s (what the detectors' windows average anyway); per-process
utilization returns every driver sample since ``lastSeenTimeStamp``, so none is lost.
Values are carried between reads. Clock event reasons (~2 µs) are read every tick."""

HEALTH_FIELDS: Final = (
    ("ecc_sbe_volatile_total", "NVML_FI_DEV_ECC_SBE_VOL_TOTAL"),
    ("ecc_dbe_volatile_total", "NVML_FI_DEV_ECC_DBE_VOL_TOTAL"),
    ("remapped_rows_correctable", "NVML_FI_DEV_REMAPPED_COR"),
    ("remapped_rows_uncorrectable", "NVML_FI_DEV_REMAPPED_UNC"),
    ("row_remap_pending", "NVML_FI_DEV_REMAPPED_PENDING"),
    ("row_remap_failure", "NVML_FI_DEV_REMAPPED_FAILURE"),
)
""":class:`~gpuwatchd.model.GpuHealth` field -> ``nvmlDeviceGetFieldValues`` field id name
(NVML API reference, "Field Value Enums"), read in one batched call."""

_GPM_FIELDS: Final = (
    ("sm_active_pct", "NVML_GPM_METRIC_SM_UTIL"),
    ("sm_occupancy_pct", "NVML_GPM_METRIC_SM_OCCUPANCY"),
    ("tensor_active_pct", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
    ("dram_active_pct", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
)
""":class:`~gpuwatchd.model.GpuSample` field -> GPM metric id name (NVML API reference,
"GPM"; each metric is a percentage over the interval between two GPM samples)."""

_GPM_WAITING: Final = "waiting for a second GPM sample"


class _CallFailed(Exception):
    """An NVML call failed with a code other than NOT_SUPPORTED (internal)."""

    def __init__(self, code: int | None, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(message)


class _Worker:
    """One daemon thread running one device's NVML calls in order (a single-thread
    executor whose thread never keeps the process from exiting: a driver call blocked
    in D-state cannot be cancelled, and must not hang the daemon's shutdown)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn``; its result or exception arrives in the returned future."""
        future: Future[Any] = Future()
        self._jobs.put((future, fn))
        return future

    def stop(self) -> None:
        """Let the thread end after the job it runs (if any); does not wait."""
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiting side
                future.set_exception(exc)


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
    worker: _Worker | None = None
    pending: Future[GpuSample] | None = None
    """The read in flight on :attr:`worker` (never two at once on one device)."""
    call: str | None = None
    """The NVML function the worker is in now (what ``stale`` names)."""
    last: GpuSample | None = None
    """The last sample read completely (what a stale tick repeats)."""
    slow_due_s: float | None = None
    """``now_s`` from which the expensive groups are read again (None: next read)."""
    gpm_supported: bool | None = None
    gpm_unavailable: str | None = None
    gpm_samples: list[Any] = field(default_factory=list)
    """The two allocated GPM sample buffers: ``[previous, spare]``."""
    gpm_have_previous: bool = False
    gpm: dict[str, MaybeFloat] = field(default_factory=dict)
    health: GpuHealth = field(default_factory=GpuHealth)
    sm_util: dict[int, float] = field(default_factory=dict)
    """pid -> mean ``smUtil`` of the samples since the previous read (percent)."""
    last_seen_us: int = 0
    """``lastSeenTimeStamp`` for ``nvmlDeviceGetProcessUtilization`` (µs, NVML's clock)."""
    mig: tuple[MigDevice, ...] = ()


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
    :meth:`open`; a tick makes six NVML calls per device
    (``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetMemoryInfo``,
    ``nvmlDeviceGetTemperature``, ``nvmlDeviceGetPowerUsage``,
    ``nvmlDeviceGetComputeRunningProcesses``, ``nvmlDeviceGetCurrentClocksEventReasons``),
    and every ``slow_interval_s`` (:data:`SLOW_READ_INTERVAL_S`, the measured costs are
    there) the expensive groups: GPM (one ``nvmlGpmSampleGet`` and one
    ``nvmlGpmMetricsGet`` between it and the previous read's sample; no sleeping), the
    health counters in one ``nvmlDeviceGetFieldValues`` (:data:`HEALTH_FIELDS`),
    ``nvmlDeviceGetProcessUtilization`` since the device's ``lastSeenTimeStamp`` and the
    MIG instances. :meth:`poll_xid_events` makes one ``nvmlEventSetWait_v2`` for all
    devices when no Xid is pending.

    **Deadlines.** Each device's calls run on its own worker thread, never on the
    caller's (the daemon's event loop); :meth:`sample` waits at most ``deadline_s``
    (:data:`CALL_DEADLINE_S`) for all of them together. A device whose call has not
    returned by then is reported ``stale`` with that call's name (its last complete
    sample, or NA values) and no second call is started on it while the first is
    blocked; the first tick after the call returns reads it afresh. Xid polling runs on
    a worker of its own with the same deadline.
    """

    def __init__(
        self,
        nvml: object | None = None,
        *,
        deadline_s: float = CALL_DEADLINE_S,
        slow_interval_s: float = SLOW_READ_INTERVAL_S,
    ) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self._deadline_s = float(deadline_s)
        self._slow_interval_s = float(slow_interval_s)
        self._local = threading.local()
        self._xid_worker: _Worker | None = None
        self._xid_pending: Future[tuple[XidEvent, ...]] | None = None
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
        message) for every other NVML error. On a device's worker thread it records
        ``fn``'s name as the device's call in flight until ``fn`` returns.
        """
        device: _Device | None = getattr(self._local, "device", None)
        if device is not None:
            device.call = getattr(fn, "__name__", None) or repr(fn)
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
        finally:
            if device is not None:
                device.call = None

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
        for device in devices:
            device.worker = _Worker(f"nvml-gpu{device.index}")
        self._devices = devices
        self._opened = True
        self._open_xid_events()
        self._xid_worker = _Worker("nvml-xid")

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
        """Free the GPM samples and the Xid event set and shut NVML down
        (``nvmlGpmSampleFree``, ``nvmlEventSetFree``, ``nvmlShutdown``), and end the
        worker threads. A device whose call is still blocked keeps its GPM samples (its
        thread may be using them; a daemon thread, it does not keep the process alive).
        Idempotent; errors on the way are ignored."""
        if not self._opened:
            return
        self._opened = False
        for device in self._devices:
            busy = device.pending is not None and not device.pending.done()
            if not busy:
                self._free_gpm(device)
            if device.worker is not None:
                device.worker.stop()
        if self._xid_worker is not None:
            self._xid_worker.stop()
            self._xid_worker = None
        self._xid_pending = None
        self._free_event_set()
        self._xid_devices = ()
        self._devices = []
        self._shutdown_quietly()

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until no device has an NVML call in flight;
        True when none has. For tests and shutdown: :meth:`sample` never waits longer
        than its deadline."""
        pending = [d.pending for d in self._devices if d.pending is not None]
        if self._xid_pending is not None:
            pending.append(self._xid_pending)  # type: ignore[arg-type]
        _, not_done = wait_futures(pending, timeout=timeout_s)
        return not not_done

    def _free_gpm(self, device: _Device) -> None:
        samples, device.gpm_samples = device.gpm_samples, []
        device.gpm_have_previous = False
        free = getattr(self._nvml, "nvmlGpmSampleFree", None)
        for sample in samples:
            with contextlib.suppress(Exception):
                self._call(free, sample)

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
        """Drain the pending Xid events on the Xid worker thread, waiting at most the
        sampler's deadline; each event stamped ``now_s`` of the poll that drained it.

        A wait that does not return in time (a hung driver) returns ``()``; its events
        are returned by the first poll after it returns, and no second wait starts
        while it is blocked. See :meth:`_poll_xid_now` for what one poll does. Never
        raises. Returns ``()`` when polling is off or the sampler is closed.
        """
        if not self._opened or self._event_set is None or self._xid_worker is None:
            return ()
        future = self._xid_pending
        if future is None:
            future = self._xid_worker.submit(lambda: self._poll_xid_now(now_s))
        wait_futures([future], timeout=self._deadline_s)
        if not future.done():
            self._xid_pending = future
            return ()
        self._xid_pending = None
        try:
            return future.result()
        except Exception as exc:  # _poll_xid_now never raises; a bug must not stop the tick
            self._disable_xid(f"nvmlEventSetWait failed ({type(exc).__name__}: {exc})")
            return ()

    def _poll_xid_now(self, now_s: float) -> tuple[XidEvent, ...]:
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
        ``power.draw`` W (milliwatts / 1000), processes with ``usedGpuMemory`` bytes and
        ``sm_util_pct`` percent; GPM fields percent; health counters as counts (see
        :class:`~gpuwatchd.model.GpuHealth`).

        Each device is read on its worker thread; this waits at most the deadline
        (wall-clock seconds) for all of them. A device still in an NVML call after it
        comes back ``stale`` (see the class docstring). Never raises for a device
        failure. Raises ``RuntimeError`` when the sampler is not open.
        """
        if not self._opened:
            raise RuntimeError("NvmlSampler.sample() called before open() or after close()")
        started: list[Future[GpuSample]] = []
        for device in self._devices:
            if device.pending is not None and not device.pending.done():
                continue  # blocked in the driver: never a second call on it
            assert device.worker is not None
            device.pending = device.worker.submit(
                lambda device=device: self._sample_on_worker(device, now_s)  # type: ignore[misc]
            )
            started.append(device.pending)
        if started:
            wait_futures(started, timeout=self._deadline_s)
        samples = []
        for device in self._devices:
            future = device.pending
            if future is None or not future.done():
                samples.append(self._stale_sample(device, now_s))
                continue
            device.pending = None
            try:
                samples.append(future.result())
            except Exception as exc:  # _sample_device never raises; a bug must not stop the tick
                samples.append(self._fail(device, f"{type(exc).__name__}: {exc}", now_s))
        return tuple(samples)

    def _sample_on_worker(self, device: _Device, now_s: float) -> GpuSample:
        """:meth:`_sample_device` on ``device``'s worker thread (names its calls)."""
        self._local.device = device
        try:
            return self._sample_device(device, now_s)
        finally:
            self._local.device = None
            device.call = None

    def _stale_sample(self, device: _Device, now_s: float) -> GpuSample:
        """The sample of a device whose call ``device.call`` is past its deadline: the
        last complete one restamped, or NA values, with ``stale`` set."""
        call = device.call or "NVML call"
        if device.last is not None:
            return dataclasses.replace(device.last, timestamp_s=now_s, stale=call)
        return dataclasses.replace(self._failed_sample(device, now_s), stale=call)

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
        device.last = sample
        return sample

    def _read(self, device: _Device, now_s: float) -> GpuSample:
        """The per-tick NVML reads of one device, and the expensive groups when due;
        raises :class:`_CallFailed`."""
        nvml = self._nvml
        call = self._call
        handle = device.handle
        rates = call(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = self._memory_info(handle)
        temperature = call(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
        power_mw = call(nvml.nvmlDeviceGetPowerUsage, handle)
        processes = call(nvml.nvmlDeviceGetComputeRunningProcesses, handle)
        reasons = call(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
        if device.slow_due_s is None or now_s >= device.slow_due_s:
            self._read_slow(device)
            device.slow_due_s = now_s + self._slow_interval_s
        procs: tuple[GpuProcess, ...] = ()
        if processes is not NA:
            procs = tuple(
                [
                    GpuProcess(
                        int(p.pid),
                        NA if p.usedGpuMemory is None else int(p.usedGpuMemory),
                        device.sm_util.get(int(p.pid), NA),
                    )
                    for p in processes
                ]
            )
        gpm = device.gpm
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
            sm_active_pct=gpm.get("sm_active_pct", NA),
            sm_occupancy_pct=gpm.get("sm_occupancy_pct", NA),
            tensor_active_pct=gpm.get("tensor_active_pct", NA),
            dram_active_pct=gpm.get("dram_active_pct", NA),
            gpm_unavailable=device.gpm_unavailable,
            health=dataclasses.replace(
                device.health, clocks_event_reasons=NA if reasons is NA else int(reasons)
            ),
            mig_devices=device.mig,
        )

    # -- the expensive groups (every slow_interval_s) ----------------------------------

    def _read_slow(self, device: _Device) -> None:
        """GPM, health fields, per-process utilization and MIG of ``device``.

        A group that fails leaves its fields NA and does not fail the device, except
        ``NVML_ERROR_GPU_IS_LOST`` (raised as :class:`_CallFailed`: the device is gone).
        """
        gpu_lost = getattr(self._nvml, "NVML_ERROR_GPU_IS_LOST", None)
        for read in (self._read_gpm, self._read_health, self._read_process_util, self._read_mig):
            try:
                read(device)
            except _CallFailed as exc:
                if exc.code is not None and exc.code == gpu_lost:
                    raise
                self._group_failed(read, device, exc.message)

    def _group_failed(self, read: Callable[[_Device], None], device: _Device, why: str) -> None:
        if read == self._read_gpm:
            device.gpm = {}
            device.gpm_unavailable = f"GPM read failed (NVML: {why})"
        elif read == self._read_health:
            device.health = GpuHealth()
        elif read == self._read_process_util:
            device.sm_util = {}
        else:
            device.mig = ()

    def _read_gpm(self, device: _Device) -> None:
        """SM activity/occupancy, tensor and DRAM activity between the previous GPM sample
        and one taken now (``nvmlGpmSampleGet`` then ``nvmlGpmMetricsGet``; NVML API
        reference, "GPM"). The first read only takes a sample (``gpm_unavailable`` says
        so). Support is asked once (``nvmlGpmQueryDeviceSupport().isSupportedDevice``:
        Hopper and later); two sample buffers are allocated once and swapped."""
        nvml = self._nvml
        if device.gpm_supported is None:
            needed = ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet")
            if any(getattr(nvml, name, None) is None for name in needed) or (
                getattr(nvml, "c_nvmlGpmMetricsGet_t", None) is None
            ):
                device.gpm_supported = False
                device.gpm_unavailable = "the NVML bindings have no GPM (nvidia-ml-py >= 12.535)"
                return
            support = self._call(nvml.nvmlGpmQueryDeviceSupport, device.handle)
            device.gpm_supported = support is not NA and bool(int(support.isSupportedDevice))
            if not device.gpm_supported:
                device.gpm_unavailable = "GPM not supported on this GPU (needs Hopper or later)"
                return
        if not device.gpm_supported:
            return
        if not device.gpm_samples:
            device.gpm_samples = [
                self._call(nvml.nvmlGpmSampleAlloc),
                self._call(nvml.nvmlGpmSampleAlloc),
            ]
            device.gpm_have_previous = False
        previous, current = device.gpm_samples
        self._call(nvml.nvmlGpmSampleGet, device.handle, current)
        device.gpm_samples = [current, previous]
        if not device.gpm_have_previous:
            device.gpm_have_previous = True
            device.gpm = {}
            device.gpm_unavailable = _GPM_WAITING
            return
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_GPM_FIELDS)
        request.sample1 = previous
        request.sample2 = current
        ids = (
            nvml.NVML_GPM_METRIC_SM_UTIL,
            nvml.NVML_GPM_METRIC_SM_OCCUPANCY,
            nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
            nvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
        )
        for i, metric_id in enumerate(ids):
            request.metrics[i].metricId = metric_id
        answer = self._call(nvml.nvmlGpmMetricsGet, request)
        if answer is NA:
            device.gpm, device.gpm_unavailable = {}, "nvmlGpmMetricsGet: Not Supported"
            return
        success = nvml.NVML_SUCCESS
        device.gpm = {
            name: float(answer.metrics[i].value)
            if int(answer.metrics[i].nvmlReturn) == success
            else NA
            for i, (name, _) in enumerate(_GPM_FIELDS)
        }
        device.gpm_unavailable = None

    def _read_health(self, device: _Device) -> None:
        """:data:`HEALTH_FIELDS` in one ``nvmlDeviceGetFieldValues``; a field whose
        ``nvmlReturn`` is not ``NVML_SUCCESS`` is NA (the others are kept)."""
        nvml = self._nvml
        ids = [
            nvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL,
            nvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
            nvml.NVML_FI_DEV_REMAPPED_COR,
            nvml.NVML_FI_DEV_REMAPPED_UNC,
            nvml.NVML_FI_DEV_REMAPPED_PENDING,
            nvml.NVML_FI_DEV_REMAPPED_FAILURE,
        ]
        values = self._call(nvml.nvmlDeviceGetFieldValues, device.handle, ids)
        if values is NA:
            device.health = GpuHealth()
            return
        got: dict[str, MaybeInt] = {}
        for (name, _), entry in zip(HEALTH_FIELDS, values, strict=False):
            value = self._field_value(entry)
            got[name] = NA if value is NA else int(value)
        device.health = GpuHealth(**got)

    def _field_value(self, entry: Any) -> MaybeFloat:
        """The value of one ``c_nvmlFieldValue_t`` by its ``valueType``
        (``NVML_VALUE_TYPE_*``), or NA when its ``nvmlReturn`` is not success."""
        nvml = self._nvml
        if int(entry.nvmlReturn) != nvml.NVML_SUCCESS:
            return NA
        member = {
            nvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
            nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
            nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
            nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
            nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
            nvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
            nvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
        }.get(int(entry.valueType))
        if member is None:
            return NA
        return float(getattr(entry.value, member))

    def _read_process_util(self, device: _Device) -> None:
        """Per-process SM use: ``nvmlDeviceGetProcessUtilization(handle,
        lastSeenTimeStamp)`` returns the driver's samples newer than the device's last
        seen one (µs); each pid gets the mean ``smUtil`` of its samples.
        ``NVML_ERROR_NOT_FOUND`` means no process ran since (no sample: NA), not a
        device failure."""
        nvml = self._nvml
        try:
            samples = self._call(
                nvml.nvmlDeviceGetProcessUtilization, device.handle, device.last_seen_us
            )
        except _CallFailed as exc:
            if exc.code is not None and exc.code == nvml.NVML_ERROR_NOT_FOUND:
                device.sm_util = {}
                return
            raise
        if samples is NA:
            device.sm_util = {}
            return
        sums: dict[int, list[float]] = {}
        for entry in samples:
            sums.setdefault(int(entry.pid), []).append(float(entry.smUtil))
            device.last_seen_us = max(device.last_seen_us, int(entry.timeStamp))
        device.sm_util = {pid: sum(v) / len(v) for pid, v in sums.items()}

    def _read_mig(self, device: _Device) -> None:
        """MIG instances with their memory when ``nvmlDeviceGetMigMode`` says current
        mode is ``NVML_DEVICE_MIG_ENABLE``: for each of ``nvmlDeviceGetMaxMigDeviceCount``
        slots ``nvmlDeviceGetMigDeviceHandleByIndex`` (``NOT_FOUND``: an empty slot),
        its UUID, ``nvmlDeviceGetGpuInstanceId`` and ``nvmlDeviceGetMemoryInfo``
        (bytes). Not Supported (a GPU without MIG) gives none."""
        nvml = self._nvml
        mode = self._call(nvml.nvmlDeviceGetMigMode, device.handle)
        if mode is NA or int(mode[0]) != nvml.NVML_DEVICE_MIG_ENABLE:
            device.mig = ()
            return
        count = self._call(nvml.nvmlDeviceGetMaxMigDeviceCount, device.handle)
        instances = []
        for slot in range(0 if count is NA else int(count)):
            try:
                handle = self._call(nvml.nvmlDeviceGetMigDeviceHandleByIndex, device.handle, slot)
            except _CallFailed as exc:
                if exc.code is not None and exc.code == nvml.NVML_ERROR_NOT_FOUND:
                    continue
                raise
            if handle is NA:
                continue
            uuid = self._call(nvml.nvmlDeviceGetUUID, handle)
            instance = self._call(nvml.nvmlDeviceGetGpuInstanceId, handle)
            memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
            instances.append(
                MigDevice(
                    uuid=f"{device.uuid}/mig{slot}" if uuid is NA else _text(uuid),
                    gpu_instance_id=NA if instance is NA else int(instance),
                    memory_used_bytes=NA if memory is NA else int(memory.used),
                    memory_total_bytes=NA if memory is NA else int(memory.total),
                )
            )
        device.mig = tuple(instances)

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
