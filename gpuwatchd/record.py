"""Record live GPUs as an nvidia-smi ``--format=csv`` log (``gpuwatchd record``).

Specification: docs/modules.md#gpuwatchdrecord
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Final, Protocol, TextIO

from gpuwatchd.model import NA, GpuSample, MaybeFloat, MaybeInt
from gpuwatchd.sampling.parquet import ParquetTraceWriter

__all__ = [
    "CSV_HEADER",
    "DCGM_HEADER_CELLS",
    "NA_TEXT",
    "Recorder",
    "format_dcgm_cells",
    "format_row",
    "format_timestamp",
]

CSV_HEADER: Final = (
    "timestamp, index, uuid, name, utilization.gpu [%], memory.used [MiB], "
    "memory.total [MiB], temperature.gpu, power.draw [W]"
)
"""The header nvidia-smi prints for ``--query-gpu=timestamp,index,uuid,name,utilization.gpu,
memory.used,memory.total,temperature.gpu,power.draw --format=csv``."""

DCGM_HEADER_CELLS: Final = (
    "DCGM_FI_PROF_SM_ACTIVE",
    "DCGM_FI_PROF_SM_OCCUPANCY",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "DCGM_FI_PROF_DRAM_ACTIVE",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_PENDING",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
)
"""Columns ``record --dcgm`` appends after :data:`CSV_HEADER`'s, named as dcgm-exporter's
fields with DCGM's units (``PROF`` ratios 0..1; counts; the clock event reasons bit
mask). ``gpuwatchd replay`` reads them (:data:`gpuwatchd.sampling.replay.DCGM_COLUMNS`);
readers of nvidia-smi's columns by position are unaffected."""

NA_TEXT: Final = "[N/A]"
"""What nvidia-smi prints for a value it cannot read."""

_MIB: Final = 2**20


class _Sampler(Protocol):
    def sample(self, now_s: float) -> tuple[GpuSample, ...]: ...


def format_timestamp(timestamp_s: float) -> str:
    """Unix seconds -> ``"2025/07/26 23:53:30.945"`` (UTC, milliseconds rounded down)."""
    millis = math.floor(timestamp_s * 1000.0)
    whole, ms = divmod(millis, 1000)
    return f"{time.strftime('%Y/%m/%d %H:%M:%S', time.gmtime(whole))}.{ms:03d}"


def _text(value: str) -> str:
    """A text cell: nvidia-smi never quotes; a comma would split the cell, so quote it."""
    if "," in value or '"' in value or "\n" in value:
        return '"' + value.replace('"', '""').replace("\n", " ") + '"'
    return value


def _whole(value: MaybeFloat, unit: str) -> str:
    return NA_TEXT if value is NA else f"{round(value)}{unit}"


def _mib(value: MaybeInt) -> str:
    return NA_TEXT if value is NA else f"{int(value) // _MIB} MiB"


def format_row(sample: GpuSample, timestamp: str) -> str:
    """One CSV row (no newline) of ``sample`` in :data:`CSV_HEADER`'s column order.

    ``timestamp`` is the already formatted time (:func:`format_timestamp`). A sample
    with ``error`` set has NA metrics, written ``[N/A]``.
    """
    power = sample.power_draw_w
    return ", ".join(
        (
            timestamp,
            str(sample.index),
            _text(sample.uuid),
            _text(sample.name),
            _whole(sample.utilization_gpu_pct, " %"),
            _mib(sample.memory_used_bytes),
            _mib(sample.memory_total_bytes),
            _whole(sample.temperature_gpu_c, ""),
            NA_TEXT if power is NA else f"{power:.2f} W",
        )
    )


def format_dcgm_cells(sample: GpuSample) -> str:
    """:data:`DCGM_HEADER_CELLS`' cells of ``sample`` (``", "``-joined, no leading comma)."""

    def ratio(value: MaybeFloat) -> str:
        return NA_TEXT if value is NA else f"{value / 100.0:.6f}"

    def count(value: MaybeInt) -> str:
        return NA_TEXT if value is NA else str(int(value))

    health = sample.health
    return ", ".join(
        (
            ratio(sample.sm_active_pct),
            ratio(sample.sm_occupancy_pct),
            ratio(sample.tensor_active_pct),
            ratio(sample.dram_active_pct),
            count(health.ecc_sbe_volatile_total),
            count(health.ecc_dbe_volatile_total),
            count(health.remapped_rows_correctable),
            count(health.remapped_rows_uncorrectable),
            count(health.row_remap_pending),
            count(health.row_remap_failure),
            count(health.clocks_event_reasons),
        )
    )


class Recorder:
    """Write one CSV row per GPU every ``interval_s`` seconds to ``out``.

    ``sampler`` is an open :class:`~gpuwatchd.sampling.nvml.NvmlSampler` (or anything
    with its ``sample(now_s)``). ``monotonic`` (default ``time.monotonic``) schedules
    the samples and times them: a row's timestamp is ``wall()`` (Unix seconds, default
    ``time.time``) read at the first sample plus the monotonic time since, so a step of
    the wall clock during a recording (NTP, a manual change) can never make the
    timestamps go backwards, which a replay would refuse. Samples are taken at fixed
    times ``start + k * interval_s``; when a sample is late (NVML slow, the machine
    suspended) the missed times are skipped, not caught up. ``dcgm=True`` appends the
    :data:`DCGM_HEADER_CELLS` columns (GPM activity and health counters).
    ``out`` may instead be a :class:`~gpuwatchd.sampling.parquet.ParquetTraceWriter`
    (``--out FILE.parquet``): the same values as rows of a row group, written when a
    group fills and at its ``close()``, which the caller owns (no ``dcgm`` columns).
    Raises ``ValueError`` for ``interval_s <= 0`` or ``dcgm`` with Parquet.
    """

    def __init__(
        self,
        sampler: _Sampler,
        out: TextIO | ParquetTraceWriter,
        *,
        interval_s: float = 1.0,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        dcgm: bool = False,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval_s}")
        if dcgm and isinstance(out, ParquetTraceWriter):
            raise ValueError("--dcgm columns are written to CSV only")
        self._sampler = sampler
        self._out = out
        self.interval_s = interval_s
        self._wall = wall
        self._monotonic = monotonic
        self.dcgm = dcgm
        self.samples = 0
        """Samples written so far (each one row per GPU)."""
        self.rows = 0
        """Rows written so far."""
        self._header_written = False
        self._origin: tuple[float, float] | None = None  # (wall, monotonic) at the first sample

    def write_header(self) -> None:
        """Write :data:`CSV_HEADER` (once) and flush (nothing for Parquet)."""
        if isinstance(self._out, ParquetTraceWriter):
            return
        if not self._header_written:
            extra = ", " + ", ".join(DCGM_HEADER_CELLS) if self.dcgm else ""
            self._out.write(CSV_HEADER + extra + "\n")
            self._out.flush()
            self._header_written = True

    def record_once(self) -> tuple[GpuSample, ...]:
        """Take one sample of every GPU now, write its rows and flush; return the samples.

        Raises ``OSError`` when ``out`` cannot be written (disk full, closed pipe).
        """
        self.write_header()
        if self._origin is None:
            self._origin = (self._wall(), self._monotonic())
        wall0, mono0 = self._origin
        now_s = wall0 + (self._monotonic() - mono0)
        samples = self._sampler.sample(now_s)
        if isinstance(self._out, ParquetTraceWriter):
            self._out.write(samples, now_s)
            self.samples += 1
            self.rows += len(samples)
            return samples
        stamp = format_timestamp(now_s)
        if self.dcgm:
            rows = [format_row(s, stamp) + ", " + format_dcgm_cells(s) + "\n" for s in samples]
        else:
            rows = [format_row(s, stamp) + "\n" for s in samples]
        self._out.write("".join(rows))
        self._out.flush()
        self.samples += 1
        self.rows += len(samples)
        return samples

    def run(
        self,
        *,
        count: int | None = None,
        duration_s: float | None = None,
        stop: threading.Event | None = None,
    ) -> int:
        """Record until ``count`` samples are written, ``duration_s`` has passed, or
        ``stop`` is set (e.g. by a SIGINT/SIGTERM handler); return the samples written.

        With ``duration_s`` the samples are those due at ``0, interval, ...`` strictly
        before ``duration_s`` (``--duration 10s --interval 1s``: 10 samples). Each
        sample is flushed as it is written, so a stop loses nothing. The header is
        written even when nothing is recorded. Raises ``ValueError`` for ``count < 0``
        or ``duration_s < 0``, ``OSError`` when ``out`` cannot be written.
        """
        if count is not None and count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if duration_s is not None and duration_s < 0:
            raise ValueError(f"duration must be >= 0 seconds, got {duration_s}")
        stop = stop or threading.Event()
        self.write_header()
        written = 0
        start = self._monotonic()
        due = start
        while not stop.is_set():
            if count is not None and written >= count:
                break
            if duration_s is not None and due - start >= duration_s - 1e-9:
                break
            self.record_once()
            written += 1
            due += self.interval_s
            now = self._monotonic()
            if now > due:  # late: skip the missed sample times
                due += math.ceil((now - due) / self.interval_s) * self.interval_s
            if count is not None and written >= count:
                break
            if duration_s is not None and due - start >= duration_s - 1e-9:
                break
            stop.wait(max(due - self._monotonic(), 0.0))
        return written
