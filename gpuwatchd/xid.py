"""NVIDIA Xid errors: what the common codes mean, and which ones lie near a worker's crash.

Specification: docs/modules.md#gpuwatchdxid
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "XID_AFTER_CRASH_S",
    "XID_BEFORE_CRASH_S",
    "XID_LOG_SIZE",
    "XID_TABLE",
    "XidCause",
    "XidEvent",
    "XidInfo",
    "XidLog",
    "cause_of",
    "describe",
    "summary",
]

XidCause = Literal["application", "hardware", "driver", "unknown"]
"""Who usually causes an Xid: the GPU application (a bug in the job: a bad address, an
out-of-bounds index), the hardware (memory ECC, NVLink, PCIe bus), or the driver and
its firmware (GSP, micro-controllers); ``unknown`` for a code not in the table."""


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One row of :data:`XID_TABLE`: the Xid number, NVIDIA's name for it, its usual cause."""

    xid: int
    description: str
    cause: XidCause


def _table(*rows: tuple[int, str, XidCause]) -> Mapping[int, XidInfo]:
    return {xid: XidInfo(xid, text, cause) for xid, text, cause in rows}


XID_TABLE: Final[Mapping[int, XidInfo]] = _table(
    # The application's fault: the job is to blame, the GPU stays healthy.
    (13, "Graphics Engine Exception (e.g. out-of-bounds access in a kernel)", "application"),
    (31, "GPU memory page fault (usually an illegal address access)", "application"),
    (43, "GPU stopped processing (an application fault; the GPU is healthy)", "application"),
    (45, "Preemptive cleanup (the driver ended the application's work)", "application"),
    # The hardware: memory, interconnect, bus.
    (32, "Invalid or corrupted push buffer stream (DMA fault, PCIe quality)", "hardware"),
    (48, "Double Bit ECC Error (uncorrectable; reset the GPU)", "hardware"),
    (63, "ECC page retirement or row remapping recording event", "hardware"),
    (64, "ECC page retirement or row remapper recording failure", "hardware"),
    (74, "NVLink error (link or peer fault; reset the GPU)", "hardware"),
    (79, "GPU has fallen off the bus (reset or reboot)", "hardware"),
    (92, "High single-bit ECC error rate", "hardware"),
    (94, "Contained ECC error (the application using the memory is stopped)", "hardware"),
    (95, "Uncontained ECC error (all applications on the GPU; reset it)", "hardware"),
    # The driver and its firmware.
    (38, "Driver firmware error", "driver"),
    (61, "Internal micro-controller breakpoint/warning", "driver"),
    (62, "Internal micro-controller halt", "driver"),
    (68, "NVDEC0 Exception (video decoder engine)", "driver"),
    (69, "Graphics Engine class error", "driver"),
    (119, "GSP RPC Timeout (the GPU System Processor did not answer)", "driver"),
    (120, "GSP Error (GPU System Processor firmware)", "driver"),
)
"""Xid number -> :class:`XidInfo` for the codes seen on data-centre GPUs (sources above)."""

XID_BEFORE_CRASH_S: Final = 30.0
"""How long before a crash an Xid on the worker's GPU still counts as its evidence.

The Xid comes first: the fault stops the CUDA context, the runtime reports it at the
next synchronisation, the application unwinds (exception, logging, DataLoader and NCCL
teardown) and exits, and the supervisor sees the exit when it reaps the process. That
can take seconds to tens of seconds; 30 s covers a slow unwind while an older Xid on the
same GPU more likely belongs to something else."""

XID_AFTER_CRASH_S: Final = 5.0
"""How long after a crash an Xid on the worker's GPU still counts as its evidence.

NVML events carry no timestamp: :attr:`XidEvent.timestamp_s` is when the daemon drained
the event (each tick, default every 1 s), so an Xid is stamped up to an interval late;
and Xid 45 (the driver's cleanup of the dead process's channels) comes as the process
exits. 5 s covers a few ticks of that lag."""

XID_LOG_SIZE: Final = 256
"""Xid events an :class:`XidLog` keeps (the oldest are dropped first)."""


def describe(xid: int) -> str:
    """NVIDIA's one-line meaning of ``xid`` (see :data:`XID_TABLE`), or a pointer to the doc."""
    info = XID_TABLE.get(xid)
    if info is None:
        return "not in gpuwatchd's table; see NVIDIA's Xid catalog"
    return info.description


def cause_of(xid: int) -> XidCause:
    """The usual cause of ``xid`` (``"unknown"`` for a code not in :data:`XID_TABLE`)."""
    info = XID_TABLE.get(xid)
    return "unknown" if info is None else info.cause


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One Xid error NVML reported for one GPU.

    ``timestamp_s``: when the daemon drained the event from NVML (seconds on its clock;
    NVML's ``c_nvmlEventData_t`` carries no time of its own). ``gpu_index``/``gpu_uuid``:
    the GPU whose handle the event named (``-1``/``""`` when it matched no GPU the sampler
    knows). ``xid``: the Xid number (the event's ``eventData``). ``description``:
    :func:`describe` of it.
    """

    timestamp_s: float
    gpu_index: int
    gpu_uuid: str
    xid: int
    description: str

    @property
    def cause(self) -> XidCause:
        """:func:`cause_of` this Xid."""
        return cause_of(self.xid)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: the fields, plus ``cause``."""
        return {
            "timestamp_s": self.timestamp_s,
            "gpu_index": self.gpu_index,
            "gpu_uuid": self.gpu_uuid,
            "xid": self.xid,
            "description": self.description,
            "cause": self.cause,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> XidEvent:
        """Inverse of :meth:`to_dict`; raises KeyError/TypeError/ValueError for a bad one."""
        xid = int(d["xid"])
        return cls(
            timestamp_s=float(d["timestamp_s"]),
            gpu_index=int(d["gpu_index"]),
            gpu_uuid=str(d.get("gpu_uuid", "")),
            xid=xid,
            description=str(d.get("description") or describe(xid)),
        )


def summary(events: Iterable[XidEvent]) -> str:
    """One line naming each distinct Xid per GPU, first seen first, e.g.
    ``"Xid 31 on GPU 0: GPU memory page fault (...); Xid 45 on GPU 0: ..."``
    (``""`` for no events). The description is cut at its first `` (``."""
    seen: dict[tuple[int, int], XidEvent] = {}
    for event in events:
        seen.setdefault((event.gpu_index, event.xid), event)
    return "; ".join(
        f"Xid {e.xid} on GPU {e.gpu_index}: {e.description.split(' (', 1)[0]}"
        for e in seen.values()
    )


class XidLog:
    """The recent :class:`XidEvent` objects, oldest first, at most ``maxlen`` of them.

    Fed by the daemon's tick (:meth:`add`); asked for a crash's evidence (:meth:`near`)
    and for ``gpuwatchctl status`` (:meth:`recent`). Not thread-safe: the daemon uses it
    on its event-loop thread only.
    """

    def __init__(self, maxlen: int = XID_LOG_SIZE) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self._events: deque[XidEvent] = deque(maxlen=maxlen)
        self.totals: dict[tuple[int, str, int], int] = {}
        """(GPU index, GPU UUID, Xid) -> events added since the start (for the
        ``gpuwatchd_xid_errors_total`` counter; bounded by GPUs times Xid codes)."""

    def __len__(self) -> int:
        return len(self._events)

    def add(self, events: Iterable[XidEvent]) -> None:
        """Append ``events`` (in the order NVML delivered them) and count them."""
        for event in events:
            self._events.append(event)
            key = (event.gpu_index, event.gpu_uuid, event.xid)
            self.totals[key] = self.totals.get(key, 0) + 1

    def recent(self, limit: int | None = None) -> tuple[XidEvent, ...]:
        """The last ``limit`` events (all kept ones for ``None``), oldest first."""
        events = tuple(self._events)
        if limit is None:
            return events
        return events[-limit:] if limit > 0 else ()

    def near(
        self,
        gpu_index: int,
        at_s: float,
        before_s: float = XID_BEFORE_CRASH_S,
        after_s: float = XID_AFTER_CRASH_S,
    ) -> tuple[XidEvent, ...]:
        """The events on GPU ``gpu_index`` stamped within ``[at_s - before_s, at_s + after_s]``.

        ``at_s`` is the crash time (on the same clock as the events); see
        :data:`XID_BEFORE_CRASH_S` and :data:`XID_AFTER_CRASH_S` for the defaults.
        """
        low, high = at_s - before_s, at_s + after_s
        return tuple(
            e for e in self._events if e.gpu_index == gpu_index and low <= e.timestamp_s <= high
        )
