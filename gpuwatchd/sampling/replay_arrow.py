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
from gpuwatchd.sampling import trace as csv_format
from gpuwatchd.sampling.trace import Frame, Trace

__all__ = ["parse_fast"]


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


_DIGITS: Final = (0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18)
"""Positions of the digits of ``YYYY/MM/DD HH:MM:SS`` (then ``.`` and the fraction's)."""
_MONTH_DAYS: Final = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _fixed_width_seconds(column: Any) -> Any:
    """UTC seconds (numpy float64) of cells that all read ``YYYY/MM/DD HH:MM:SS.f…`` with
    the same width, separators and number of decimals (as nvidia-smi writes them),
    computed from the bytes; None for anything else (:func:`_timestamps` then parses
    with pyarrow's strptime, same result for what this takes). The date and time are
    read once per distinct second (a sample's rows share it), the decimals per row."""
    try:
        import numpy as np
    except ImportError:
        return None
    n = len(column)
    if n == 0 or column.null_count or str(column.type) not in ("string", "utf8"):
        return None  # (large_string has 64-bit offsets)
    _, offsets_buffer, data_buffer = column.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32)[column.offset : column.offset + n + 1]
    width = int(offsets[1] - offsets[0])
    if not 21 <= width <= 29 or np.any(np.diff(offsets) != width):
        return None
    data = np.frombuffer(data_buffer, dtype=np.uint8)[offsets[0] : offsets[-1]]
    raw = data.reshape(n, width)
    date_sep, time_sep = int(raw[0, 4]), int(raw[0, 10])
    if date_sep not in b"/-" or time_sep not in b" T":
        return None
    for position, char in ((4, date_sep), (7, date_sep), (10, time_sep), (13, 58), (16, 58),
                           (19, 46)):  # fmt: skip
        if np.any(raw[:, position] != char):
            return None
    decimals = width - 20
    fraction = np.zeros(n, dtype=np.int64)
    for position in range(20, width):
        digit = raw[:, position]
        if np.any((digit < 48) | (digit > 57)):
            return None
        fraction *= 10
        fraction += digit
        fraction -= 48
    # rows whose first 19 bytes (date and time to the second) differ from the row before
    whole = np.ndarray((n,), dtype="S19", buffer=data, strides=(width,))
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.not_equal(whole[1:], whole[:-1], out=new[1:])
    rows = np.flatnonzero(new)
    distinct = _civil_seconds(np, raw[rows])
    if distinct is None:
        return None
    seconds = distinct[np.cumsum(new) - 1].astype(np.float64)
    # k decimals / 10**k is the double nearest the decimal, as parsing "0.fff" gives
    return seconds + fraction.astype(np.float64) / float(10**decimals)


def _civil_seconds(np: Any, raw: Any) -> Any:
    """int64 UTC seconds of ``YYYY?MM?DD?HH:MM:SS`` rows of bytes, or None for a digit
    that is not one or a date or time out of range."""
    digits = raw[:, list(_DIGITS)].astype(np.int64) - 48
    if np.any((digits < 0) | (digits > 9)):
        return None

    def number(first: int, count: int) -> Any:
        out = digits[:, first]
        for k in range(first + 1, first + count):
            out = out * 10 + digits[:, k]
        return out

    year, month, day = number(0, 4), number(4, 2), number(6, 2)
    hour, minute, second = number(8, 2), number(10, 2), number(12, 2)
    leap = ((year % 4 == 0) & (year % 100 != 0)) | (year % 400 == 0)
    month_days = np.array(_MONTH_DAYS)[np.clip(month, 1, 12) - 1] + ((month == 2) & leap)
    if np.any((month < 1) | (month > 12) | (day < 1) | (day > month_days)):
        return None
    if np.any((hour > 23) | (minute > 59) | (second > 59)):
        return None
    # days from 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil)
    y = year - (month <= 2)
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (month + np.where(month > 2, -3, 9)) + 2) // 5 + day - 1
    days = era * 146097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719468
    return days * 86400 + hour * 3600 + minute * 60 + second


def _timestamps(pc: Any, column: Any) -> Any:
    """UTC seconds (float64 array) of ``YYYY/MM/DD HH:MM:SS[.fff]`` (or ``-``/``T``
    separated) cells, or None. Raises ArrowInvalid for a malformed one."""
    fixed = _fixed_width_seconds(column)
    if fixed is not None:
        import pyarrow as pa  # type: ignore[import-untyped]

        return pa.array(fixed)
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
    """The :class:`~.trace.Trace` of ``path`` read as columns, or None to use the row
    parser (see the module docstring). Never raises for a malformed file."""
    read = _read(path, gpus)
    if read is None:
        return None
    _, name, count, rows, stamps_array, arrays = read
    stamps = stamps_array.to_pylist()
    values = [None if a is None else a.to_pylist() for a in arrays]
    # 691,200 samples of a day of 8 GPUs are allocated here and nothing is garbage:
    # without the collector's passes over them this takes about half the time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _build(name, count, rows, stamps, values)
    finally:
        if enabled:
            gc.enable()


def parse_columns(path: str | os.PathLike[str], gpus: int | None) -> Any:
    """The :class:`~.columns.TraceColumns` of ``path``, or None where :func:`parse_fast`
    would return None (or numpy is missing): the same trace, as arrays, without a
    :class:`~gpuwatchd.model.GpuSample` per GPU and frame. Never raises for a
    malformed file."""
    try:
        import numpy as np
    except ImportError:
        return None
    read = _read(path, gpus)
    if read is None:
        return None
    _, name, count, rows, stamps_array, arrays = read
    from gpuwatchd.sampling.columns import TraceColumns

    frames = rows // count
    shape = (frames, count)
    columns = []
    for array in arrays:
        if array is None:
            columns.append(np.full(shape, np.nan))
        else:
            columns.append(array.to_numpy(zero_copy_only=False).astype(np.float64).reshape(shape))
    stamps = stamps_array.to_numpy(zero_copy_only=False)[::count].copy()
    util, used, total, temperature, power = columns
    return TraceColumns(
        name,
        tuple(f"GPU-replay-{k}" for k in range(count)),
        tuple(range(count)),
        (csv_format.DEFAULT_GPU_NAME,) * count,
        stamps,
        util,
        used,
        total,
        temperature,
        power,
        np.zeros(shape),
    )


def _read(path: str | os.PathLike[str], gpus: int | None) -> Any:
    """``(pyarrow, name, gpus, rows, row stamps, [metric arrays or None])`` of a plain
    interleaved log, or None (see the module docstring)."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc  # type: ignore[import-untyped]
        import pyarrow.csv as pacsv  # type: ignore[import-untyped]
    except ImportError:
        return None
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
        got = _columns(pa, pc, table, gpus)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, KeyError, TypeError):
        return None
    if got is None:
        return None
    count, rows, stamps, arrays = got
    return pa, name, count, rows, stamps, arrays


def _columns(pa: Any, pc: Any, table: Any, gpus: int | None) -> Any:
    columns: dict[str, tuple[int, str]] = {}
    for position, cell in enumerate(table.column_names):
        match = csv_format.HEADER_CELL.match(cell)
        if match is None:
            return None
        column = csv_format.HEADER_ALIASES.get(match.group(1), match.group(1))
        if column in columns:
            return None
        columns[column] = (position, (match.group(2) or "").strip())
    if "timestamp" not in columns or {"index", "uuid", "name"} & columns.keys():
        return None
    if csv_format.DCGM_COLUMNS.keys() & columns.keys():
        return None  # the row parser reads the optional DCGM columns
    rows = table.num_rows
    if rows == 0:
        return None
    stamps_column = table.column(columns["timestamp"][0]).combine_chunks()
    if not pa.types.is_string(stamps_column.type):
        return None
    stamps_array = _timestamps(pc, stamps_column)
    if stamps_array is None or stamps_array.null_count:
        return None
    values: list[Any] = []
    for metric in csv_format.METRIC_COLUMNS:
        if metric not in columns:
            values.append(None)
            continue
        position, unit = columns[metric]
        column = table.column(position).combine_chunks()
        if not pa.types.is_string(column.type):
            column = pc.cast(column, "string")
        if unit and unit not in csv_format.METRIC_UNITS[metric]:
            return None
        got = _column_values(
            pc, column, csv_format.METRIC_UNITS[metric], unit or csv_format.DEFAULT_UNITS[metric]
        )
        if got is None:
            return None
        if metric.startswith("memory."):
            got = pc.cast(pc.floor(got), "int64")
        values.append(got)
    # Rows within SAME_SAMPLE_S of the previous one are one sample; every sample must
    # have the same number of rows (else the row parser sorts out incomplete ones).
    gaps = pc.pairwise_diff(stamps_array)
    if pc.any(pc.less(gaps, 0.0)).as_py():
        return None  # backwards: the row parser names the line
    new_sample = pc.or_(pc.less(gaps, 0.0), pc.greater(gaps, csv_format.SAME_SAMPLE_S))
    starts = pc.indices_nonzero(pc.fill_null(new_sample, False)).to_pylist()
    count = starts[0] if starts else rows
    if count < 1 or rows % count or starts != list(range(count, rows, count)):
        return None
    if gpus is not None and gpus != count:
        return None
    return count, rows, stamps_array, values


def _build(name: str, count: int, rows: int, stamps: list[float], values: list[Any]) -> Trace:
    missing = [NA] * rows
    util, used, total, temperature, power = (col if col is not None else missing for col in values)
    uuids = [f"GPU-replay-{k}" for k in range(count)]
    default_name = csv_format.DEFAULT_GPU_NAME
    frames = []
    sample = GpuSample
    frame_type = Frame
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
    return Trace(name, count, tuple(frames))
