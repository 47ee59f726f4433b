"""Columnar parsing of the common nvidia-smi CSV log with pyarrow (the ``replay`` extra).

:func:`parse_fast` reads the whole file as columns (pyarrow's multithreaded CSV reader),
converts timestamps and values per column and builds the frames in one pass; it returns
None for anything unusual (no pyarrow, an ``index`` column, incomplete samples, a bad or
``[N/A]`` cell, a repeated header, mixed units), and :func:`~.replay.parse_trace` then
uses the row parser, which reports the problem with its line. Same result either way.
"""

from __future__ import annotations

import gc
import os
from typing import Any, Final

from gpuwatchd.model import NA, GpuSample

__all__ = ["parse_fast"]

_METRICS: Final = ("utilization.gpu", "memory.used", "memory.total", "temperature.gpu",
                   "power.draw")  # fmt: skip


def _column_values(pc: Any, column: Any, factor_of: dict[str, float], default: str) -> Any:
    """Float values in base units of one metric column, or None to fall back.

    Every cell must carry the same unit as the first (``116.51 W``) or none; anything
    else ([N/A], a glued or second unit) falls back. Raises ArrowInvalid for a cell
    that is not a number (the caller falls back)."""
    text = pc.utf8_trim_whitespace(column)
    first = text[0].as_py()
    _, _, unit = first.partition(" ")
    unit = unit.strip()
    if unit:
        if not pc.all(pc.ends_with(text, " " + unit)).as_py():
            return None
        text = pc.utf8_slice_codeunits(text, 0, -(len(unit) + 1))
    factor = factor_of.get(unit or default)
    if factor is None:
        return None
    values = pc.cast(pc.utf8_trim_whitespace(text), "float64")
    if values.null_count or pc.any(pc.is_nan(values)).as_py():
        return None
    return values if factor == 1.0 else pc.multiply(values, factor)


def _timestamps(pc: Any, column: Any) -> Any:
    """UTC seconds (float64 array) of ``YYYY/MM/DD HH:MM:SS[.fff]`` (or ``-``/``T``
    separated) cells, or None. Raises ArrowInvalid for a malformed one."""
    text = pc.utf8_trim_whitespace(column)
    first = text[0].as_py()
    if len(first) < 19:
        return None
    date_sep, time_sep = first[4], first[10]
    if date_sep not in "/-" or time_sep not in " T":
        return None
    fmt = f"%Y{date_sep}%m{date_sep}%d{time_sep}%H:%M:%S"
    whole = pc.strptime(pc.utf8_slice_codeunits(text, 0, 19), format=fmt, unit="s")
    seconds = pc.cast(pc.cast(whole, "int64"), "float64")
    fraction = pc.utf8_slice_codeunits(text, 19, 40)
    if not pc.all(pc.or_(pc.equal(fraction, ""), pc.starts_with(fraction, "."))).as_py():
        return None
    frac_s = pc.cast(pc.binary_join_element_wise("0", fraction, ""), "float64")
    return pc.add(seconds, frac_s)


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
    stamps_array = _timestamps(pc, stamps_column)
    if stamps_array is None or stamps_array.null_count:
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
        if unit and unit not in replay._UNITS[metric]:
            return None
        got = _column_values(
            pc, column, replay._UNITS[metric], unit or replay._DEFAULT_UNIT[metric]
        )
        if got is None:
            return None
        if metric.startswith("memory."):
            got = pc.cast(pc.floor(got), "int64")
        values.append(got.to_pylist())
    # Rows within SAME_SAMPLE_S of the previous one are one sample; every sample must
    # have the same number of rows (else the row parser sorts out incomplete ones).
    gaps = pc.pairwise_diff(stamps_array)
    if pc.any(pc.less(gaps, 0.0)).as_py():
        return None  # backwards: the row parser names the line
    new_sample = pc.or_(pc.less(gaps, 0.0), pc.greater(gaps, replay.SAME_SAMPLE_S))
    starts = pc.indices_nonzero(pc.fill_null(new_sample, False)).to_pylist()
    count = starts[0] if starts else rows
    if count < 1 or rows % count or starts != list(range(count, rows, count)):
        return None
    if gpus is not None and gpus != count:
        return None
    stamps = stamps_array.to_pylist()
    # 691,200 samples of a day of 8 GPUs are allocated here and nothing is garbage:
    # without the collector's passes over them this takes about half the time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _build(replay, name, count, rows, stamps, values)
    finally:
        if enabled:
            gc.enable()


def _build(
    replay: Any, name: str, count: int, rows: int, stamps: list[float], values: list[Any]
) -> Any:
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
    return replay.Trace(name, count, tuple(frames))
