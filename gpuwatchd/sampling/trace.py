"""A replayed trace (:class:`Trace` of :class:`Frame`) and the nvidia-smi CSV log format its
readers share: the row parser (gpuwatchd/sampling/replay.py) and the columnar one
(gpuwatchd/sampling/replay_arrow.py). Specification: docs/modules.md#gpuwatchdsamplingreplay
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gpuwatchd.model import GpuSample

__all__ = [
    "DCGM_COLUMNS",
    "DEFAULT_GPU_NAME",
    "DEFAULT_UNITS",
    "GLUED_UNIT",
    "HEADER_ALIASES",
    "HEADER_CELL",
    "KNOWN_COLUMNS",
    "MEMORY_UNITS_BYTES",
    "METRIC_COLUMNS",
    "METRIC_UNITS",
    "NA_CELL_TEXTS",
    "SAME_SAMPLE_S",
    "Frame",
    "Trace",
]

SAME_SAMPLE_S: Final = 0.05
"""Rows within 50 ms of each other are one sample of several GPUs (nvidia-smi writes
the GPUs of one sample a few ms apart; ``-lms`` intervals are >= 100 ms in practice)."""

DEFAULT_GPU_NAME: Final = "replay"
"""A replayed GPU's name where the trace has no ``name`` column."""
KNOWN_COLUMNS: Final = (
    "timestamp",
    "index",
    "uuid",
    "name",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "power.draw",
)
"""The columns of nvidia-smi's query read (``--query-gpu=`` names), in record's order."""
DCGM_COLUMNS: Final[Mapping[str, tuple[str, float]]] = {
    "DCGM_FI_PROF_SM_ACTIVE": ("sm_active_pct", 100.0),
    "DCGM_FI_PROF_SM_OCCUPANCY": ("sm_occupancy_pct", 100.0),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": ("tensor_active_pct", 100.0),
    "DCGM_FI_PROF_DRAM_ACTIVE": ("dram_active_pct", 100.0),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("health.ecc_sbe_volatile_total", 1.0),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("health.ecc_dbe_volatile_total", 1.0),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("health.remapped_rows_correctable", 1.0),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("health.remapped_rows_uncorrectable", 1.0),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": ("health.row_remap_pending", 1.0),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("health.row_remap_failure", 1.0),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": ("health.clocks_event_reasons", 1.0),
}
"""Optional columns named as dcgm-exporter's fields (``gpuwatchd record --dcgm`` writes
them; nvidia-smi has none): column -> (:class:`GpuSample` field, ``health.<GpuHealth
field>``, and the factor from the cell to it). The ``DCGM_FI_PROF_*`` cells are ratios
0..1 as in DCGM (x 100: percent); the ``DCGM_FI_DEV_*`` cells are counts or, for clock
event reasons, the ``nvmlClocksEventReason*`` bit mask. A trace without them replays
as before (the fields stay NA); cells ``[N/A]`` are NA."""

HEADER_ALIASES: Final = {"gpu_name": "name", "gpu_uuid": "uuid", "temperature.gpu.tlimit": ""}
"""Other names of columns (nvidia-smi's older or longer spellings) -> the name read."""
MEMORY_UNITS_BYTES: Final = {
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
    "kB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
}
"""Memory units nvidia-smi and other loggers write -> bytes."""
METRIC_UNITS: Final[dict[str, dict[str, float]]] = {
    "utilization.gpu": {"%": 1.0},
    "power.draw": {"W": 1.0, "mW": 0.001, "kW": 1000.0},
    "temperature.gpu": {"C": 1.0, "°C": 1.0},
    "memory.used": {k: float(v) for k, v in MEMORY_UNITS_BYTES.items()},
    "memory.total": {k: float(v) for k, v in MEMORY_UNITS_BYTES.items()},
}
"""Per metric column, the units it may carry -> the factor to GpuSample's units (%, B, °C, W)."""
DEFAULT_UNITS: Final = {"utilization.gpu": "%", "power.draw": "W", "temperature.gpu": "C",
                 "memory.used": "MiB", "memory.total": "MiB"}  # fmt: skip
"""The unit of a metric cell without one, in a column whose header names none."""
NA_CELL_TEXTS: Final = frozenset({"", "N/A", "NA", "Not Supported", "Unknown Error", "GPU is lost"})
"""Cells that mean no value (NA), besides any cell in brackets (``[N/A]``, ``[Not Supported]``)."""
HEADER_CELL: Final = re.compile(r"^\s*([^\[\]]*?)\s*(?:\[([^\]]*)\])?\s*$")
"""A header cell: group 1 the column's name, group 2 its unit (``power.draw [W]``)."""
GLUED_UNIT: Final = re.compile(r"^([-+0-9.eE]+?)([A-Za-z%°]+)$")
"""A value with its unit glued on (``116.51W``): group 1 the number, group 2 the unit."""
METRIC_COLUMNS: Final = ("utilization.gpu", "memory.used", "memory.total", "temperature.gpu",
                         "power.draw")  # fmt: skip
"""The metric columns, in the order of GpuSample's fields they fill."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One sample of every GPU of a trace: ``samples[i]`` is GPU ``i`` (by NVML index order).

    ``timestamp_s`` is the trace's time of the sample (its first row), UTC seconds;
    each sample carries the same ``timestamp_s``.
    """

    timestamp_s: float
    samples: tuple[GpuSample, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    """A parsed trace: ``gpu_count`` GPUs, ``frames`` in time order (never empty).

    A frame whose GPU had no row (``index`` column traces) carries NA metrics for it.
    """

    path: str
    gpu_count: int
    frames: tuple[Frame, ...]
    skipped_lines: tuple[int, ...] = ()
    """Line numbers of rows of incomplete samples that could not be tied to a GPU."""

    @property
    def start_s(self) -> float:
        """Trace time of the first frame (UTC seconds)."""
        return self.frames[0].timestamp_s

    @property
    def duration_s(self) -> float:
        """Seconds from the first to the last frame."""
        return self.frames[-1].timestamp_s - self.frames[0].timestamp_s
