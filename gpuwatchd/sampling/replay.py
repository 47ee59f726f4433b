"""Replay of ``nvidia-smi --query-gpu=... --format=csv`` logs.

Specification: docs/modules.md#gpuwatchdsamplingreplay
"""

from __future__ import annotations

import bisect
import calendar
import csv
import dataclasses
import gc
import math
import os
import re
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import Final

from gpuwatchd.errors import ReplayError
from gpuwatchd.model import NA, GpuHealth, GpuSample, MaybeFloat, MaybeInt
from gpuwatchd.sampling.trace import (
    DCGM_COLUMNS,
    DEFAULT_GPU_NAME,
    DEFAULT_UNITS,
    GLUED_UNIT,
    HEADER_ALIASES,
    HEADER_CELL,
    KNOWN_COLUMNS,
    METRIC_COLUMNS,
    METRIC_UNITS,
    NA_CELL_TEXTS,
    SAME_SAMPLE_S,
    Frame,
    Trace,
)

__all__ = [
    "DCGM_COLUMNS",
    "SAME_SAMPLE_S",
    "Frame",
    "ReplaySampler",
    "Trace",
    "iter_samples",
    "parse_trace",
]

_CACHE_MAX: Final = 65536
_TIMESTAMP = re.compile(
    r"^(\d{4})[/-](\d{1,2})[/-](\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2}(?:\.\d*)?)$"
)


@dataclass(slots=True)
class _Row:
    line: int
    timestamp_s: float
    index: int | None
    uuid: str | None
    name: str | None
    values: tuple[MaybeFloat, MaybeFloat, MaybeFloat, MaybeFloat, MaybeFloat]
    """utilization.gpu %, memory.used B, memory.total B, temperature.gpu °C, power.draw W."""
    extra: tuple[tuple[str, MaybeFloat], ...] = ()
    """:data:`DCGM_COLUMNS` read from this row: (target field, value)."""


class _BadValue(Exception):
    pass


_days_cache: dict[tuple[str, str, str], int] = {}
_midnight_cache: dict[str, int] = {}
"""``"2025/07/26"`` -> UTC seconds at midnight, for the fast path of well-formed stamps."""


def _parse_timestamp(text: str) -> float:
    """``2025/07/26 23:53:30.945`` (nvidia-smi) or ISO ``2025-07-26T23:53:30.945`` -> UTC s."""
    if len(text) >= 19 and text[13] == ":" and text[16] == ":":  # fast path, fixed widths
        midnight = _midnight_cache.get(text[:10])
        if midnight is not None:
            try:
                hh, mm, ss = int(text[11:13]), int(text[14:16]), float(text[17:])
            except ValueError:
                pass
            else:
                if 0 <= hh < 24 and 0 <= mm < 60 and 0 <= ss < 61:
                    return midnight + hh * 3600 + mm * 60 + ss
    match = _TIMESTAMP.match(text)
    if match is None:
        try:
            return float(text)  # already seconds
        except ValueError:
            raise _BadValue(f"bad timestamp {text!r} (expected YYYY/MM/DD HH:MM:SS.mmm)") from None
    year, month, day, hour, minute, second = match.groups()
    key = (year, month, day)
    midnight = _days_cache.get(key)
    if midnight is None:
        try:
            midnight = calendar.timegm((int(year), int(month), int(day), 0, 0, 0, 0, 0, 0))
        except (ValueError, OverflowError):
            raise _BadValue(f"bad date in timestamp {text!r}") from None
        if not (1 <= int(month) <= 12 and 1 <= int(day) <= 31):
            raise _BadValue(f"bad date in timestamp {text!r}")
        _days_cache[key] = midnight
        if len(year) == 4 and len(month) == 2 and len(day) == 2 and text[10] in " T":
            _midnight_cache[text[:10]] = midnight
    if int(hour) > 23 or int(minute) > 59 or float(second) >= 61:
        raise _BadValue(f"bad time in timestamp {text!r}")
    return midnight + int(hour) * 3600 + int(minute) * 60 + float(second)


def _value_parser(column: str, header_unit: str) -> Callable[[str], MaybeFloat]:
    """A parser of one metric column's cells: text -> value in base units or NA."""
    units = METRIC_UNITS[column]
    default_unit = header_unit or DEFAULT_UNITS[column]
    if default_unit not in units:
        raise _BadValue(
            f"unknown unit [{header_unit}] for {column} (expected one of {', '.join(units)})"
        )
    default_factor = units[default_unit]

    cache: dict[str, MaybeFloat] = {}  # nvidia-smi logs repeat values ("0 %", "17 MiB")

    def parse(text: str) -> MaybeFloat:
        known = cache.get(text)
        if known is not None:
            return known
        value = parse_uncached(text)
        if len(cache) < _CACHE_MAX:
            cache[text] = value
        return value

    def parse_uncached(text: str) -> MaybeFloat:
        text = text.strip()
        if text in NA_CELL_TEXTS or text[0] == "[":
            return NA
        number, _, unit = text.partition(" ")
        if not unit and not number[-1].isdigit():  # "116.51W": unit glued to the number
            glued = GLUED_UNIT.match(text)
            if glued is not None:
                number, unit = glued.groups()
        factor = default_factor
        if unit:
            unit = unit.strip()
            got = units.get(unit)
            if got is None:
                raise _BadValue(
                    f"{column} value {text!r} has unit {unit!r}, expected {default_unit}"
                )
            factor = got
        try:
            value = float(number)
        except ValueError:
            raise _BadValue(f"{column} value {text!r} is not a number") from None
        if math.isnan(value):
            return NA
        return value * factor

    return parse


def _text_cell(text: str) -> str | None:
    text = text.strip()
    return None if text in NA_CELL_TEXTS or text.startswith("[") else text


def parse_trace(
    path: str | os.PathLike[str], *, gpus: int | None = None, columnar: bool = False
) -> Trace:
    """Parse an ``nvidia-smi --format=csv`` log into frames of one sample per GPU.

    ``gpus`` is the number of GPUs whose rows are interleaved (needed only when it
    cannot be inferred; with an ``index`` column it must agree with it). Rows of
    incomplete samples are listed in :attr:`Trace.skipped_lines`. Memory is returned
    in bytes (MiB x 2**20), power in W, utilization in %.

    Raises :class:`~gpuwatchd.errors.ReplayError` (``path:line: message``) for an
    unreadable file, a missing ``timestamp`` column, a malformed value, a row with
    the wrong number of cells, timestamps that go backwards, or a GPU count that
    cannot be inferred.

    With ``columnar`` (backtests), a plain interleaved log is read as columns with
    pyarrow when it is installed (:mod:`.replay_arrow`, the ``replay`` extra; several
    times faster); anything it does not take goes through the row parser, same result.
    """
    name = os.fspath(path)
    if gpus is not None and gpus < 1:
        raise ReplayError(f"{name}: gpus must be >= 1, got {gpus}")
    if columnar:
        from gpuwatchd.sampling.replay_arrow import parse_fast

        fast: Trace | None = parse_fast(path, gpus)
        if fast is not None:
            return fast
    # Every object made from here on lives on in the trace: no collector passes over
    # them while they are made (a day of 8 GPUs parses in 2/3 of the time).
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _parse_rows(name, path, gpus)
    finally:
        if enabled:
            gc.enable()


def _parse_rows(name: str, path: str | os.PathLike[str], gpus: int | None) -> Trace:
    try:
        with open(path, newline="", encoding="utf-8") as stream:
            rows = _read_rows(name, stream)
    except OSError as exc:
        raise ReplayError(f"{name}: cannot read trace: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ReplayError(f"{name}: not a text (UTF-8) file: {exc.reason}") from None
    if not rows:
        raise ReplayError(f"{name}: the trace has a header but no rows")
    if rows[0].index is not None:
        return _frames_by_index(name, rows, gpus)
    return _frames_interleaved(name, rows, gpus)


def _groups(rows: list[_Row]) -> list[tuple[int, int]]:
    """``(first row, size)`` of runs of rows with consecutive gaps <= :data:`SAME_SAMPLE_S`."""
    groups = []
    start = 0
    previous_s = rows[0].timestamp_s
    for i, row in enumerate(rows):
        if not 0.0 <= row.timestamp_s - previous_s <= SAME_SAMPLE_S:
            groups.append((start, i - start))
            start = i
        previous_s = row.timestamp_s
    groups.append((start, len(rows) - start))
    return groups


def _infer_gpu_count(name: str, groups: list[tuple[int, int]], n_rows: int) -> int:
    """The most common group size, when groups of that size hold at least half the rows."""
    sizes = Counter(size for _, size in groups)
    count, how_often = sizes.most_common(1)[0]
    if 2 * count * how_often < n_rows:
        raise ReplayError(
            f"{name}: cannot tell how many GPUs the trace has: rows come in groups of "
            f"{count} most often, but such groups hold only {count * how_often} of "
            f"{n_rows} rows; pass the number of GPUs (--gpus N)"
        )
    return count


def _frames_interleaved(name: str, rows: list[_Row], gpus: int | None) -> Trace:
    """Frames from rows of ``N`` GPUs in index order: row ``i`` of a sample is GPU ``i``.

    nvidia-smi sometimes writes an incomplete sample when NVML is slow (a row or a
    few, then a gap of seconds; the H100 trace has several near its end). A run of
    exactly ``N`` rows close in time always is one whole sample, so when such a run
    starts in the middle of a sample, the rows before it are an incomplete sample:
    they are skipped (their GPU is unknown) and listed in :attr:`Trace.skipped_lines`
    instead of shifting every later row onto the wrong GPU.
    """
    groups = _groups(rows)
    count = gpus if gpus is not None else _infer_gpu_count(name, groups, len(rows))
    whole_sample_starts = {start for start, size in groups if size == count}
    uuids = [f"GPU-replay-{i}" for i in range(count)]
    frames: list[Frame] = []
    skipped: list[int] = []
    current: list[_Row] = []
    previous_s = -math.inf
    for i, row in enumerate(rows):
        if current and i in whole_sample_starts:
            skipped.extend(r.line for r in current)
            current = []
        current.append(row)
        if len(current) == count:
            timestamp_s = current[0].timestamp_s
            if timestamp_s < previous_s:
                raise ReplayError(f"{name}:{current[0].line}: timestamp goes backwards")
            previous_s = timestamp_s
            samples = tuple(
                [_sample(r, k, r.uuid or uuids[k], timestamp_s) for k, r in enumerate(current)]
            )
            frames.append(Frame(timestamp_s, samples))
            current = []
    skipped.extend(r.line for r in current)  # a last sample cut off by the end of the log
    if not frames:
        raise ReplayError(f"{name}: no complete sample of {count} GPUs in the trace")
    return Trace(name, count, tuple(frames), tuple(skipped))


def _sample(row: _Row, index: int, uuid: str, timestamp_s: float) -> GpuSample:
    util, used, total, temperature, power = row.values
    sample = GpuSample(
        uuid,
        index,
        row.name or DEFAULT_GPU_NAME,
        timestamp_s,
        util,
        NA if used is NA else int(used),
        NA if total is NA else int(total),
        temperature,
        power,
    )
    if not row.extra:
        return sample
    top: dict[str, MaybeFloat] = {}
    health: dict[str, MaybeInt] = {}
    for target, value in row.extra:
        if target.startswith("health."):
            health[target[len("health.") :]] = NA if value is NA else int(value)
        else:
            top[target] = value
    return dataclasses.replace(sample, health=GpuHealth(**health), **top)  # type: ignore[arg-type]


def _dcgm_cell(text: str, factor: float) -> MaybeFloat:
    """A :data:`DCGM_COLUMNS` cell: a number (x ``factor``) or NA."""
    text = text.strip()
    if not text or text in NA_CELL_TEXTS or text[0] == "[":
        return NA
    try:
        return float(text) * factor
    except ValueError:
        raise _BadValue(f"bad value {text!r} (a number or [N/A])") from None


def _read_rows(name: str, stream: Iterator[str]) -> list[_Row]:
    reader = csv.reader(stream, skipinitialspace=True)
    header: list[str] | None = None
    for cells in reader:
        if cells and any(c.strip() for c in cells):
            header = cells
            break
    if header is None:
        raise ReplayError(f"{name}: empty trace (expected an nvidia-smi --format=csv header)")
    header_line = reader.line_num
    columns: dict[str, tuple[int, str]] = {}
    for position, cell in enumerate(header):
        match = HEADER_CELL.match(cell)
        if match is None:
            raise ReplayError(f"{name}:{header_line}: bad header cell {cell!r}")
        column, unit = match.group(1), (match.group(2) or "").strip()
        column = HEADER_ALIASES.get(column, column)
        if column in KNOWN_COLUMNS or column in DCGM_COLUMNS:
            if column in columns:
                raise ReplayError(f"{name}:{header_line}: column {column!r} appears twice")
            columns[column] = (position, unit)
    if "timestamp" not in columns:
        raise ReplayError(
            f"{name}:{header_line}: no 'timestamp' column in header {', '.join(header)!r} "
            "(record with nvidia-smi --query-gpu=timestamp,... --format=csv)"
        )
    parsers: list[tuple[int, Callable[[str], MaybeFloat]] | None] = []
    for column in METRIC_COLUMNS:
        if column not in columns:
            parsers.append(None)
            continue
        position, unit = columns[column]
        try:
            parsers.append((position, _value_parser(column, unit)))
        except _BadValue as exc:
            raise ReplayError(f"{name}:{header_line}: {exc}") from None
    dcgm = [
        (columns[column][0], *DCGM_COLUMNS[column]) for column in DCGM_COLUMNS if column in columns
    ]
    ts_col = columns["timestamp"][0]
    index_col = columns["index"][0] if "index" in columns else None
    uuid_col = columns["uuid"][0] if "uuid" in columns else None
    name_col = columns["name"][0] if "name" in columns else None
    width = len(header)
    header_key = [c.strip() for c in header]
    rows: list[_Row] = []
    append = rows.append
    for cells in reader:
        line = reader.line_num
        if len(cells) != width:
            if not cells or not any(c.strip() for c in cells):
                continue  # blank line
            raise ReplayError(
                f"{name}:{line}: expected {width} comma-separated values as in the header, "
                f"got {len(cells)}"
            )
        try:
            timestamp_s = _parse_timestamp(cells[ts_col].strip())
        except _BadValue as exc:
            if [c.strip() for c in cells] == header_key:
                continue  # a repeated header (logs appended to one file)
            raise ReplayError(f"{name}:{line}: {exc}") from None
        try:
            values = tuple([NA if p is None else p[1](cells[p[0]]) for p in parsers])
            extra = tuple([(target, _dcgm_cell(cells[at], factor)) for at, target, factor in dcgm])
            index = None
            if index_col is not None:
                text = cells[index_col].strip()
                if not text.isdigit():
                    raise _BadValue(f"index {text!r} is not a GPU index")
                index = int(text)
        except _BadValue as exc:
            raise ReplayError(f"{name}:{line}: {exc}") from None
        append(
            _Row(
                line,
                timestamp_s,
                index,
                None if uuid_col is None else _text_cell(cells[uuid_col]),
                None if name_col is None else _text_cell(cells[name_col]),
                values,  # type: ignore[arg-type]
                extra,
            )
        )
    return rows


def _frames_by_index(name: str, rows: list[_Row], gpus: int | None) -> Trace:
    """Frames from a trace with an ``index`` column: a repeated index starts a new sample."""
    indices = sorted({row.index for row in rows if row.index is not None})
    if gpus is not None and gpus != len(indices):
        raise ReplayError(
            f"{name}: --gpus {gpus} given but the index column names {len(indices)} GPUs "
            f"({', '.join(map(str, indices))})"
        )
    uuids: dict[int, str] = {}
    names: dict[int, str] = {}
    for row in rows:
        assert row.index is not None
        if row.uuid and row.index not in uuids:
            uuids[row.index] = row.uuid
        if row.name and row.index not in names:
            names[row.index] = row.name
    groups: list[dict[int, _Row]] = []
    current: dict[int, _Row] = {}
    for row in rows:
        assert row.index is not None
        if row.index in current:
            groups.append(current)
            current = {}
        current[row.index] = row
    groups.append(current)
    frames = []
    previous_s = -math.inf
    for group in groups:
        first = min(group.values(), key=lambda r: r.line)
        timestamp_s = first.timestamp_s
        if timestamp_s < previous_s:
            raise ReplayError(f"{name}:{first.line}: timestamp goes backwards")
        previous_s = timestamp_s
        samples = []
        for index in indices:
            uuid = uuids.get(index, f"GPU-replay-{index}")
            found = group.get(index)
            if found is None:  # this GPU has no row in this sample: not sampled, not idle
                samples.append(
                    GpuSample(uuid, index, names.get(index, DEFAULT_GPU_NAME), timestamp_s)
                )
            else:
                samples.append(_sample(found, index, uuid, timestamp_s))
        frames.append(Frame(timestamp_s, tuple(samples)))
    return Trace(name, len(indices), tuple(frames))


def iter_samples(trace: Trace) -> Iterator[Frame]:
    """Yield the frames of ``trace`` in time order, stamped with the trace's own times.

    For backtests: feed each frame's ``samples`` to the windows/detectors with
    ``frame.timestamp_s`` as the clock.
    """
    yield from trace.frames


_SAMPLED_NUMBERS: Final = (
    ("utilization_gpu_pct", float),
    ("memory_used_bytes", int),
    ("memory_total_bytes", int),
    ("temperature_gpu_c", float),
    ("power_draw_w", float),
    ("sm_active_pct", float),
    ("sm_occupancy_pct", float),
    ("tensor_active_pct", float),
    ("dram_active_pct", float),
)
"""The numeric :class:`GpuSample` fields a trace fills (:data:`METRIC_COLUMNS` and the
:data:`DCGM_COLUMNS` outside ``health``), with their type: what :class:`ReplaySampler`
keeps as columns of doubles."""
_EXACT_INT_MAX: Final = 2**53
"""Integers up to this size survive a double (IEEE 754's 53-bit significand)."""


def _as_double(value: object, kind: type) -> float | None:
    """``value`` of a :data:`_SAMPLED_NUMBERS` field as a double (NA as NaN), or None when
    a double cannot give it back as it was (a NaN, a bool, a huge int, another type)."""
    if value is NA:
        return math.nan
    if isinstance(value, float) and type(value) is kind:
        return None if math.isnan(value) else value
    if isinstance(value, int) and type(value) is kind:  # not a bool
        return float(value) if -_EXACT_INT_MAX <= value <= _EXACT_INT_MAX else None
    return None


class ReplaySampler:
    """Play a :class:`Trace` as if it were live GPUs (a :class:`~gpuwatchd.sampling.GpuSampler`).

    The first :meth:`sample` call anchors the trace's start at ``now_s``; a call at
    ``now_s`` returns the latest frame at trace time
    ``start + (now_s - anchor) * speed``, re-stamped ``timestamp_s=now_s``.
    ``speed=math.inf`` returns the next frame on every call (as fast as the caller
    asks). Past the end, :attr:`finished` is True and the last frame repeats.

    The sampler does not keep ``trace``: each GPU's first sample stays as a template and
    the numbers that change (:data:`_SAMPLED_NUMBERS`) as columns of doubles, 8 bytes a
    value instead of a :class:`GpuSample` object a GPU and frame (the daemon replaying
    tests/data/traces/h100x8_gpt350m_ckpt10_100ms.csv held 18 MiB of them, bench/control.py).
    A frame whose other fields differ from the templates' (health counters, a
    NaN) is kept whole. Raises :class:`~gpuwatchd.errors.ReplayError` for ``speed <= 0``.
    """

    def __init__(self, trace: Trace, *, speed: float = 1.0) -> None:
        if not speed > 0:
            raise ReplayError(f"replay speed must be > 0, got {speed}")
        self._path = trace.path
        self._speed = speed
        self._times = array("d", [frame.timestamp_s for frame in trace.frames])
        self._anchor_s: float | None = None
        self._position = -1
        self._templates = trace.frames[0].samples
        gpus = len(self._templates)
        numbers = attrgetter(*[name for name, _ in _SAMPLED_NUMBERS])
        others = attrgetter(
            *[
                f.name
                for f in dataclasses.fields(GpuSample)
                if f.name != "timestamp_s" and f.name not in dict(_SAMPLED_NUMBERS)
            ]
        )
        template_others = [others(sample) for sample in self._templates]
        columns = [array("d") for _ in _SAMPLED_NUMBERS]
        self._whole: dict[int, tuple[GpuSample, ...]] = {}
        """Frames kept as they are (their position -> samples): see the class docstring."""
        for position, frame in enumerate(trace.frames):
            doubles = None
            if len(frame.samples) == gpus and all(
                others(sample) == kept
                for sample, kept in zip(frame.samples, template_others, strict=True)
            ):
                doubles = [
                    [_as_double(value, kind) for value in values]
                    for values, (_, kind) in zip(
                        zip(*[numbers(sample) for sample in frame.samples], strict=True),
                        _SAMPLED_NUMBERS,
                        strict=True,
                    )
                ]
            if doubles is None or any(None in values for values in doubles):
                self._whole[position] = frame.samples
                doubles = [[math.nan] * gpus for _ in _SAMPLED_NUMBERS]
            for column, values in zip(columns, doubles, strict=True):
                column.extend(values)  # type: ignore[arg-type]
        first = [columns[j][:gpus] for j in range(len(columns))]
        self._columns = [
            (name, kind, column)
            for (name, kind), column, start in zip(_SAMPLED_NUMBERS, columns, first, strict=True)
            if column.tobytes() != start.tobytes() * len(trace.frames)
        ]
        """The fields that change, as (name, type, one double a frame and GPU)."""

    @property
    def status(self) -> str:
        """``"replay: <path>"``."""
        return f"replay: {self._path}"

    @property
    def position(self) -> int:
        """Index of the frame returned last (-1 before the first call)."""
        return self._position

    @property
    def finished(self) -> bool:
        """True once the last frame has been returned."""
        return self._position >= len(self._times) - 1

    def sample(self, now_s: float) -> tuple[GpuSample, ...]:
        """Return the frame due at ``now_s`` (see the class docstring), stamped ``now_s``."""
        last = len(self._times) - 1
        if math.isinf(self._speed):
            position = min(self._position + 1, last)
        else:
            if self._anchor_s is None:
                self._anchor_s = now_s
            trace_s = self._times[0] + (now_s - self._anchor_s) * self._speed
            position = max(bisect.bisect_right(self._times, trace_s) - 1, 0)
            position = max(position, self._position)  # a clock step back does not rewind
        self._position = position
        whole = self._whole.get(position)
        if whole is not None:
            return tuple([dataclasses.replace(s, timestamp_s=now_s) for s in whole])
        at = position * len(self._templates)
        out = []
        for k, template in enumerate(self._templates):
            changes: dict[str, object] = {}
            for name, kind, column in self._columns:
                value = column[at + k]
                changes[name] = NA if math.isnan(value) else (int(value) if kind is int else value)
            out.append(dataclasses.replace(template, timestamp_s=now_s, **changes))  # type: ignore[arg-type]
        return tuple(out)

    def close(self) -> None:
        """Nothing to release."""
