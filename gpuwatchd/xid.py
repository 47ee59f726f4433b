"""NVIDIA Xid errors: what the common codes mean, who causes them, what to do, and which
ones lie near a worker's crash.

Sources of :data:`XID_TABLE`: NVIDIA's Xid catalog for Ampere and newer GPUs,
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html (the mnemonic,
the description and the "Resolution Bucket (Immediate Action)": ``RESTART_APP``,
``RESET_GPU``, ``RESTART_BM``, ``CONTACT_SUPPORT``), NVIDIA's Xid messages page
(https://docs.nvidia.com/deploy/xid-errors/index.html, "Xid Error Listing": the
possible causes, application / driver / hardware), the dynamic page retirement and row
remapping guides (https://docs.nvidia.com/deploy/dynamic-page-retirement/,
https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/: Xid 48, 63, 64, 94, 95), and
gpud's table (github.com/leptonai/gpud, ``components/accelerator/nvidia/xid/xid.go``),
which was read to cross-check the classes. The class is the usual cause; the action is
what the catalog recommends first. An operator reclassifies a code or adds one with the
``table:`` param of the ``xid`` detector (:func:`parse_overrides`).

Specification: docs/modules.md#gpuwatchdxid
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "XID_ACTIONS",
    "XID_AFTER_CRASH_S",
    "XID_BEFORE_CRASH_S",
    "XID_CLASSES",
    "XID_LOG_SIZE",
    "XID_MAX",
    "XID_OVERRIDES_MAX",
    "XID_TABLE",
    "XidAction",
    "XidCause",
    "XidEvent",
    "XidInfo",
    "XidLog",
    "cause_of",
    "describe",
    "info_of",
    "merged_table",
    "parse_overrides",
    "summary",
]

XidCause = Literal["application", "hardware", "driver", "unknown"]
"""Who usually causes an Xid: the GPU application (a bug in the job: a bad address, an
out-of-bounds index), the hardware (memory ECC, NVLink, PCIe bus), or the driver and
its firmware (GSP, micro-controllers); ``unknown`` for a code not in the table."""

XID_CLASSES: Final = ("application", "hardware", "driver")
"""The classes a table row may have (``unknown`` is only for a code not in the table)."""

XidAction = Literal["none", "restart_app", "reset_gpu", "reboot_node", "rma"]
"""What NVIDIA's catalog recommends first: nothing (informational), restart the
application (``RESTART_APP``), reset the GPU (``RESET_GPU``: ``nvidia-smi -r``; drain
the GPU first), drain and reboot the node (``RESTART_BM``), or service / RMA
(``CONTACT_SUPPORT`` for a fault that persists)."""

XID_ACTIONS: Final = ("none", "restart_app", "reset_gpu", "reboot_node", "rma")
"""Every :data:`XidAction`, mildest first."""

XID_MAX: Final = 1023
"""The largest Xid code a table row or a policy may name (NVIDIA's are below 200)."""

XID_OVERRIDES_MAX: Final = 64
"""Rows one ``table:`` override may hold at most."""


@dataclass(frozen=True, slots=True)
class XidInfo:
    """One row of :data:`XID_TABLE`: the Xid number, NVIDIA's name for it, its usual cause
    (:data:`XidCause`) and the recommended first action (:data:`XidAction`)."""

    xid: int
    description: str
    cause: XidCause
    action: XidAction = "none"


def _table(*rows: tuple[int, str, XidCause, XidAction]) -> Mapping[int, XidInfo]:
    return {xid: XidInfo(xid, text, cause, action) for xid, text, cause, action in rows}


XID_TABLE: Final[Mapping[int, XidInfo]] = _table(
    # The application's fault: the job is to blame, the GPU stays healthy (RESTART_APP).
    (8, "GPU stopped processing (channel idle timeout)", "application", "restart_app"),
    (
        13,
        "Graphics Engine Exception (e.g. out-of-bounds access in a kernel)",
        "application",
        "restart_app",
    ),
    (31, "GPU memory page fault (usually an illegal address access)", "application", "restart_app"),
    (
        43,
        "GPU stopped processing (an application fault; the GPU is healthy)",
        "application",
        "restart_app",
    ),
    (45, "Preemptive cleanup (the driver ended the application's work)", "application", "none"),
    (
        109,
        "Context switch timeout (usually the application's kernel)",
        "application",
        "restart_app",
    ),
    # The hardware: memory, interconnect, bus.
    (
        32,
        "Invalid or corrupted push buffer stream (DMA fault, PCIe quality)",
        "hardware",
        "reset_gpu",
    ),
    (48, "Double Bit ECC Error (uncorrectable; reset the GPU)", "hardware", "reset_gpu"),
    (
        63,
        "ECC page retirement or row remapping recording event (reset to apply)",
        "hardware",
        "reset_gpu",
    ),
    (64, "ECC page retirement or row remapper recording failure (service)", "hardware", "rma"),
    (74, "NVLink error (link or peer fault; reset the GPU)", "hardware", "reset_gpu"),
    (79, "GPU has fallen off the bus (reset or reboot)", "hardware", "reboot_node"),
    # 92: corrected errors, informational only; 94: the application that hit the error
    # must restart, the others run on until the GPU is reset to apply the row remap; 95:
    # other applications are hit too, reboot at once when MIG is off (NVIDIA's GPU debug
    # guidelines, "Xid messages"; gpud's table agrees).
    (92, "High single-bit ECC error rate (corrected; informational)", "hardware", "none"),
    (
        94,
        "Contained ECC error (restart the application; reset the GPU when convenient)",
        "hardware",
        "restart_app",
    ),
    (
        95,
        "Uncontained ECC error (other applications affected; reboot or reset the GPU)",
        "hardware",
        "reboot_node",
    ),
    (140, "Unrecovered ECC error (reset the GPU)", "hardware", "reset_gpu"),
    # The driver and its firmware.
    (38, "Driver firmware error", "driver", "reset_gpu"),
    (61, "Internal micro-controller breakpoint/warning", "driver", "reset_gpu"),
    (62, "Internal micro-controller halt", "driver", "reset_gpu"),
    (68, "NVDEC0 Exception (video decoder engine)", "driver", "restart_app"),
    (69, "Graphics Engine class error", "driver", "restart_app"),
    (119, "GSP RPC Timeout (the GPU System Processor did not answer)", "driver", "reset_gpu"),
    (120, "GSP Error (GPU System Processor firmware)", "driver", "reset_gpu"),
    (
        154,
        "GPU recovery action changed (the driver asks for a reset or a reboot)",
        "driver",
        "reset_gpu",
    ),
)
"""Xid number -> :class:`XidInfo` for the codes seen on data-centre GPUs (sources above)."""


def info_of(xid: int, table: Mapping[int, XidInfo] | None = None) -> XidInfo | None:
    """The row of ``xid`` in ``table`` (default :data:`XID_TABLE`), None when absent."""
    return (XID_TABLE if table is None else table).get(xid)


def _parse_code(key: object) -> int:
    if isinstance(key, str) and key.strip().isdigit():
        key = int(key.strip())
    if isinstance(key, bool) or not isinstance(key, int) or not 1 <= key <= XID_MAX:
        raise ValueError(f"an Xid code must be an integer in 1..{XID_MAX}, got {key!r}")
    return key


def parse_overrides(value: object) -> tuple[XidInfo, ...]:
    """Validate a ``table:`` override (YAML): ``{'CODE': CLASS}`` or ``{'CODE': {class:
    CLASS, name: TEXT, action: ACTION}}``, at most :data:`XID_OVERRIDES_MAX` rows (a policy
    file's keys are strings, so the codes are quoted; an int key is taken too).

    A row for a code in :data:`XID_TABLE` keeps its name and action unless given; a new
    code needs ``class`` (its name defaults to ``"Xid N (operator's table)"``). Returns
    the rows sorted by code (hashable, for the detector's key). Raises ValueError naming
    the bad row.
    """
    if not isinstance(value, Mapping) or not value:
        raise ValueError(
            "expected a mapping of Xid code -> class or {class, name, action}, "
            f"e.g. {{13: hardware}}, got {value!r}"
        )
    if len(value) > XID_OVERRIDES_MAX:
        raise ValueError(f"at most {XID_OVERRIDES_MAX} rows, got {len(value)}")
    rows: dict[int, XidInfo] = {}
    for key, spec in value.items():
        code = _parse_code(key)
        known = XID_TABLE.get(code)
        fields: Mapping[str, object]
        if isinstance(spec, str):
            fields = {"class": spec}
        elif isinstance(spec, Mapping):
            unknown = sorted(str(k) for k in spec if k not in ("class", "name", "action"))
            if unknown:
                raise ValueError(
                    f"Xid {code}: unknown key {unknown[0]!r} (known: class, name, action)"
                )
            fields = spec
        else:
            raise ValueError(f"Xid {code}: expected a class or a mapping, got {spec!r}")
        cause = fields.get("class", None if known is None else known.cause)
        if cause not in XID_CLASSES:
            raise ValueError(
                f"Xid {code}: class must be one of {', '.join(XID_CLASSES)}, got {cause!r}"
            )
        name = fields.get(
            "name", f"Xid {code} (operator's table)" if known is None else known.description
        )
        if not isinstance(name, str) or not name.strip() or len(name) > 200 or "\n" in name:
            raise ValueError(f"Xid {code}: name must be one line of 1..200 characters")
        action = fields.get("action", "none" if known is None else known.action)
        if action not in XID_ACTIONS:
            raise ValueError(
                f"Xid {code}: action must be one of {', '.join(XID_ACTIONS)}, got {action!r}"
            )
        rows[code] = XidInfo(code, name, cause, action)
    return tuple(rows[c] for c in sorted(rows))


def merged_table(overrides: Iterable[XidInfo]) -> Mapping[int, XidInfo]:
    """:data:`XID_TABLE` with the rows of ``overrides`` (from :func:`parse_overrides`)."""
    table = dict(XID_TABLE)
    for row in overrides:
        table[row.xid] = row
    return table


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


def describe(xid: int, table: Mapping[int, XidInfo] | None = None) -> str:
    """NVIDIA's one-line meaning of ``xid`` in ``table`` (default :data:`XID_TABLE`), or a
    pointer to the doc."""
    info = info_of(xid, table)
    if info is None:
        return "not in gpuwatchd's table; see NVIDIA's Xid catalog"
    return info.description


def cause_of(xid: int, table: Mapping[int, XidInfo] | None = None) -> XidCause:
    """The usual cause of ``xid`` in ``table`` (default :data:`XID_TABLE`; ``"unknown"``
    for a code not in it)."""
    info = info_of(xid, table)
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
