"""Columnar parsing of the common nvidia-smi CSV log with pyarrow (the ``replay`` extra).

:func:`parse_fast` reads the whole file as columns (pyarrow's multithreaded CSV reader),
converts timestamps and values per column and builds the frames in one pass; it returns
None for anything unusual (no pyarrow, an ``index`` column, incomplete samples, a bad or
``[N/A]`` cell, a repeated header, mixed units), and :func:`~.replay.parse_trace` then
uses the row parser, which reports the problem with its line. Same result either way.
"""

from __future__ import annotations

import calendar
import itertools
import os
from typing import Any, Final

from gpuwatchd.model import NA, GpuSample

__all__ = ["parse_fast"]

_METRICS: Final = ("utilization.gpu", "memory.used", "memory.total", "temperature.gpu",
                   "power.draw")  # fmt: skip
_NUMBER: Final = r"^\s*(?P<number>[-+]?[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>\S*)\s*$"


def _column_values(pc: Any, column: Any, factor_of: dict[str, float], default: str) -> Any:
    """Float values in base units of one metric column, or None to fall back."""
    parts = pc.extract_regex(column, _NUMBER)
    if parts.null_count:
        return None  # [N/A], text, a glued unit: the row parser handles those
    units = set(pc.unique(parts.field("unit")).to_pylist())
    if len(units) != 1:
        return None
    unit = units.pop() or default
    factor = factor_of.get(unit)
    if factor is None:
        return None
    values = pc.cast(parts.field("number"), "float64")
    return values if factor == 1.0 else pc.multiply(values, factor)


def _timestamps(pc: Any, column: Any) -> list[float] | None:
    """UTC seconds of ``YYYY/MM/DD HH:MM:SS[.fff]`` (or ``-``/``T`` separated) cells."""
    text = pc.utf8_trim_whitespace(column)
    lengths = pc.utf8_length(text)
    if pc.min(lengths).as_py() < 19:
        return None
    date = pc.replace_substring(pc.utf8_slice_codeunits(text, 0, 10), "-", "/")
    clock = pc.utf8_slice_codeunits(text, 11, 19)
    fraction = pc.utf8_slice_codeunits(text, 19, 40)
    days = pc.unique(date).to_pylist()
    midnight: dict[str, int] = {}
    for day in days:
        year, month, dom = day.split("/")
        if not (1 <= int(month) <= 12 and 1 <= int(dom) <= 31):
            return None
        midnight[day] = calendar.timegm((int(year), int(month), int(dom), 0, 0, 0, 0, 0, 0))
    hms = pc.extract_regex(clock, r"^(?P<h>[0-2][0-9]):(?P<m>[0-5][0-9]):(?P<s>[0-6][0-9])$")
    if hms.null_count:
        return None
    seconds = pc.add(
        pc.add(
            pc.multiply(pc.cast(hms.field("h"), "int64"), 3600),
            pc.multiply(pc.cast(hms.field("m"), "int64"), 60),
        ),
        pc.cast(hms.field("s"), "int64"),
    )
    if pc.max(hms.field("h")).as_py() > "23":
        return None
    frac = pc.if_else(pc.equal(pc.utf8_length(fraction), 0), "0", pc.binary_join_element_wise(
        "0", fraction, ""))  # fmt: skip
    frac_s = pc.cast(frac, "float64")
    offsets = [midnight[d] for d in date.to_pylist()] if len(days) > 1 else None
    base = midnight[days[0]]
    clock_s = pc.add(pc.cast(seconds, "float64"), frac_s).to_pylist()
    if offsets is None:
        return [base + s for s in clock_s]
    return [o + s for o, s in zip(offsets, clock_s, strict=True)]


def parse_fast(path: str | os.PathLike[str], gpus: int | None) -> Any:
    """The :class:`~.replay.Trace` of ``path`` read as columns, or None to use the row
    parser (see the module docstring). Never raises for a malformed file."""
    try:
        import pyarrow as pa  # type: ignore[import-untyped]
        import pyarrow.compute as pc  # type: ignore[import-untyped]
        import pyarrow.csv as pacsv  # type: ignore[import-untyped]
    except ImportError:
        return None
    from gpuwatchd.sampling import replay

    name = os.fspath(path)
    try:
        table = pacsv.read_csv(
            name,
            read_options=pacsv.ReadOptions(encoding="utf8"),
            parse_options=pacsv.ParseOptions(delimiter=","),
            convert_options=pacsv.ConvertOptions(
                column_types={}, strings_can_be_null=False, auto_dict_encode=False
            ),
        )
    except (pa.ArrowInvalid, OSError, UnicodeDecodeError, ValueError):
        return None
    try:
        return _frames(pa, pc, table, name, gpus, replay)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, KeyError, TypeError):
        return None


def _frames(pa: Any, pc: Any, table: Any, name: str, gpus: int | None, replay: Any) -> Any:
    columns: dict[str, tuple[int, str]] = {}
    for position, cell in enumerate(table.column_names):
        match = replay._HEADER_CELL.match(cell)
        if match is None:
            return None
        column = replay._ALIASES.get(match.group(1), match.group(1))
        if column in columns:
            return None
        columns[column] = (position, (match.group(2) or "").strip())
    if "timestamp" not in columns or {"index", "uuid", "name"} & columns.keys():
        return None
    rows = table.num_rows
    if rows == 0:
        return None
    stamps_column = table.column(columns["timestamp"][0]).combine_chunks()
    if not pa.types.is_string(stamps_column.type):
        return None
    stamps = _timestamps(pc, stamps_column)
    if stamps is None:
        return None
    values: list[list[Any] | None] = []
    for metric in _METRICS:
        if metric not in columns:
            values.append(None)
            continue
        position, unit = columns[metric]
        column = table.column(position).combine_chunks()
        if not pa.types.is_string(column.type):
            column = pc.cast(column, "string")
        default = unit or replay._DEFAULT_UNIT[metric]
        got = _column_values(pc, column, replay._UNITS[metric], default)
        if got is None or (unit and unit not in replay._UNITS[metric]):
            return None
        if metric.startswith("memory."):
            got = pc.cast(pc.floor(got), "int64")
        values.append(got.to_pylist())
    # Group rows into samples: rows within SAME_SAMPLE_S of the previous are one sample.
    starts = [0]
    previous = stamps[0]
    same = replay.SAME_SAMPLE_S
    for i in range(1, rows):
        gap = stamps[i] - previous
        if not 0.0 <= gap <= same:
            starts.append(i)
        previous = stamps[i]
    starts.append(rows)
    sizes = {b - a for a, b in itertools.pairwise(starts)}
    if len(sizes) != 1:
        return None  # incomplete samples: the row parser skips and lists them
    count = sizes.pop()
    if gpus is not None and gpus != count:
        return None
    missing = [NA] * rows
    util, used, total, temperature, power = (col if col is not None else missing for col in values)
    uuids = [f"GPU-replay-{k}" for k in range(count)]
    default_name = replay._DEFAULT_NAME
    frames = []
    sample = GpuSample
    frame_type = replay.Frame
    for first in range(0, rows, count):
        t = stamps[first]
        frames.append(
            frame_type(
                t,
                tuple(
                    [
                        sample(
                            uuids[k],
                            k,
                            default_name,
                            t,
                            util[i],
                            used[i],
                            total[i],
                            temperature[i],
                            power[i],
                        )
                        for k, i in enumerate(range(first, first + count))
                    ]
                ),
            )
        )
    for a, b in itertools.pairwise(frames):
        if b.timestamp_s < a.timestamp_s:
            return None  # backwards: the row parser names the line
    return replay.Trace(name, count, tuple(frames))
