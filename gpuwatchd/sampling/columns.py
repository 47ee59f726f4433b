"""A replayed trace as columns (numpy arrays): one row per frame, one column per GPU.

What :func:`gpuwatchd.backtest.backtest_file` backtests when the file reads as columns
(:func:`gpuwatchd.sampling.replay_arrow.read_columns`), without building a
:class:`~gpuwatchd.model.GpuSample` per GPU and frame; :meth:`TraceColumns.from_trace`
and :meth:`TraceColumns.to_trace` convert from and to the frames of
:class:`~gpuwatchd.sampling.trace.Trace`. Specification: docs/backtests.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuwatchd.model import NA, GpuHealth, GpuSample, MaybeFloat, MaybeInt
from gpuwatchd.sampling.trace import Frame, Trace

__all__ = ["METRICS", "TraceColumns"]

METRICS = (
    "utilization_gpu_pct",
    "memory_used_bytes",
    "memory_total_bytes",
    "temperature_gpu_c",
    "power_draw_w",
)
"""The metric columns, named as :class:`~gpuwatchd.model.GpuSample`'s fields."""

_NO_HEALTH = GpuHealth()


@dataclass(frozen=True, eq=False)
class TraceColumns:
    """A trace of ``len(uuids)`` GPUs as arrays.

    ``timestamps_s``: float64 ``(frames,)``, UTC seconds, never empty. Each metric of
    :data:`METRICS`: float64 ``(frames, gpus)`` in GpuSample's units (%, bytes, °C, W),
    NaN where the sample is NA. ``compute_processes``: float64 ``(frames, gpus)``, the
    length of each sample's process list (NaN where NVML failed for it). ``uuids``,
    ``indexes``, ``names``: per GPU column, the same in every frame.
    """

    path: str
    uuids: tuple[str, ...]
    indexes: tuple[int, ...]
    names: tuple[str, ...]
    timestamps_s: Any
    utilization_gpu_pct: Any
    memory_used_bytes: Any
    memory_total_bytes: Any
    temperature_gpu_c: Any
    power_draw_w: Any
    compute_processes: Any
    skipped_lines: tuple[int, ...] = ()

    @property
    def gpu_count(self) -> int:
        """GPUs (columns)."""
        return len(self.uuids)

    @property
    def frame_count(self) -> int:
        """Frames (rows)."""
        return int(self.timestamps_s.shape[0])

    @property
    def start_s(self) -> float:
        """Trace time of the first frame (UTC seconds)."""
        return float(self.timestamps_s[0])

    @property
    def duration_s(self) -> float:
        """Seconds from the first to the last frame."""
        return float(self.timestamps_s[-1]) - float(self.timestamps_s[0])

    def samples(self, step: int) -> tuple[GpuSample, ...]:
        """The GPU samples of frame ``step``, as the row parser makes them."""
        t = float(self.timestamps_s[step])
        rows = [getattr(self, m)[step].tolist() for m in METRICS]
        return tuple(
            GpuSample(
                uuid,
                index,
                name,
                t,
                _maybe(rows[0][k]),
                _maybe_int(rows[1][k]),
                _maybe_int(rows[2][k]),
                _maybe(rows[3][k]),
                _maybe(rows[4][k]),
            )
            for k, (uuid, index, name) in enumerate(
                zip(self.uuids, self.indexes, self.names, strict=True)
            )
        )

    def frames_between(self, first: int, stop: int) -> TraceColumns:
        """Frames ``first`` to ``stop - 1`` as their own TraceColumns (views, not copies;
        the same GPUs, no skipped lines): a chunk of the trace."""
        rows = slice(first, stop)
        return TraceColumns(
            self.path,
            self.uuids,
            self.indexes,
            self.names,
            self.timestamps_s[rows],
            self.utilization_gpu_pct[rows],
            self.memory_used_bytes[rows],
            self.memory_total_bytes[rows],
            self.temperature_gpu_c[rows],
            self.power_draw_w[rows],
            self.compute_processes[rows],
        )

    def to_trace(self) -> Trace:
        """The same trace as frames of :class:`~gpuwatchd.model.GpuSample`."""
        frames = tuple(
            Frame(float(self.timestamps_s[i]), self.samples(i)) for i in range(self.frame_count)
        )
        return Trace(self.path, self.gpu_count, frames, self.skipped_lines)

    @classmethod
    def from_trace(cls, trace: Trace) -> TraceColumns | None:
        """The columns of ``trace``, or None when it does not fit them: a GPU whose
        uuid, index or name changes between frames, a repeated uuid, a value that is
        a float NaN (not NA), or a sample with a field the columns do not carry (SM
        activity or health counters from ``gpuwatchd record --dcgm``: the per-sample
        engine judges those). Each sample takes its frame's time (as the windows do)."""
        first = trace.frames[0].samples
        uuids = tuple(s.uuid for s in first)
        indexes = tuple(s.index for s in first)
        names = tuple(s.name for s in first)
        if len(set(uuids)) != len(uuids):
            return None
        nan = math.nan
        stamps: list[float] = []
        columns: list[list[float]] = [[] for _ in METRICS]
        processes: list[float] = []
        for frame in trace.frames:
            stamps.append(frame.timestamp_s)
            samples = frame.samples
            if len(samples) != len(uuids):
                return None
            for k, s in enumerate(samples):
                if s.uuid != uuids[k] or s.index != indexes[k] or s.name != names[k]:
                    return None
                if s.sm_active_pct is not NA or s.health != _NO_HEALTH:
                    return None
                processes.append(nan if s.error is not None else float(len(s.processes)))
            for column, metric in zip(columns, METRICS, strict=True):
                column.extend(
                    [nan if (v := getattr(s, metric)) is NA else float(v) for s in samples]
                )
        shape = (len(stamps), len(uuids))
        arrays = [np.array(c, dtype=np.float64).reshape(shape) for c in columns]
        for array, metric in zip(arrays, METRICS, strict=True):
            gaps = int(np.isnan(array).sum())
            if gaps and gaps != sum(
                1 for f in trace.frames for s in f.samples if getattr(s, metric) is NA
            ):
                return None  # a float NaN, which windows take as a value, not a gap
        util, used, total, temperature, power = arrays
        return cls(
            trace.path,
            uuids,
            indexes,
            names,
            np.array(stamps, dtype=np.float64),
            util,
            used,
            total,
            temperature,
            power,
            np.array(processes, dtype=np.float64).reshape(shape),
            skipped_lines=trace.skipped_lines,
        )


def _maybe(value: float) -> MaybeFloat:
    return NA if math.isnan(value) else value


def _maybe_int(value: float) -> MaybeInt:
    return NA if math.isnan(value) else int(value)
