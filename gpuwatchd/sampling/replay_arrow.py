"""Columnar reading of GPU traces with pyarrow and numpy (the ``replay`` extra), in chunks.

:func:`read_columns` streams an ``nvidia-smi --query-gpu=... --format=csv`` log (with or
without ``index``, ``uuid``, ``name``; ``[N/A]`` cells; the interleaved form, incomplete
samples included) or Parquet files (:mod:`gpuwatchd.sampling.parquet`) block by block
into a :class:`~gpuwatchd.sampling.columns.TraceColumns`: the text of one block is held
at a time, the trace itself as float64 arrays (about 60 bytes per GPU-sample). It gives
what the row parser (:func:`~gpuwatchd.sampling.replay.parse_trace`) gives, and returns
None for what it does not take (no pyarrow or numpy, a malformed cell, a repeated header,
a second unit in a column, DCGM columns, timestamps going backwards), which the row
parser then reads or reports with its line. Specification: docs/backtests.md.
"""

from __future__ import annotations

import itertools
import os
import re
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gpuwatchd.sampling import trace as csv_format
from gpuwatchd.sampling.trace import Trace

__all__ = [
    "BLOCK_BYTES",
    "FirstCells",
    "NotColumnar",
    "RowBlock",
    "csv_blocks",
    "parse_fast",
    "read_columns",
    "rows_to_columns",
    "stream_columns",
]

BLOCK_BYTES: Final = 8 << 20
"""Bytes of CSV text pyarrow reads per block (its default is 1 MiB; 8 MiB halves the
per-block overhead on a day of 8 GPUs and bounds the text held at once)."""

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
    """UTC seconds (numpy float64) of ``YYYY/MM/DD HH:MM:SS[.fff]`` (or ``-``/``T``
    separated) cells, or None (then the row parser reads the file). Raises ArrowInvalid
    for a malformed one."""
    fixed = _fixed_width_seconds(column)
    if fixed is not None:
        return fixed
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
    stamps = pc.add(seconds, frac_s)
    return None if stamps.null_count else stamps.to_numpy(zero_copy_only=False)


@dataclass(frozen=True, slots=True)
class RowBlock:
    """One block of rows (one row per GPU-sample), as numpy arrays of equal length.

    ``timestamps_s``: float64 UTC seconds. ``indexes``: int64 GPU index, or None where
    the trace has no ``index`` column. ``uuids``, ``names``: object arrays of str or
    None (NA) per row, for a trace without ``index`` that has such a column; else None.
    ``first_cells``: with ``index``, ``{"uuid"/"name": {GPU index: its first non-NA
    cell in the block}}``. ``metrics``: five float64 arrays in
    :data:`~gpuwatchd.sampling.trace.METRIC_COLUMNS` order, in GpuSample's units (%, B,
    °C, W; memory whole bytes), NaN for NA; None for a column the trace lacks.
    """

    timestamps_s: Any
    indexes: Any
    uuids: Any
    names: Any
    first_cells: dict[str, dict[int, str]]
    metrics: tuple[Any, ...]


@dataclass(slots=True)
class _Rows:
    """The blocks read so far, concatenated at the end."""

    blocks: list[RowBlock] = field(default_factory=list)

    def column(self, np: Any, name: str) -> Any:
        parts = [getattr(b, name) for b in self.blocks]
        if any(p is None for p in parts):
            return None
        return np.concatenate(parts)


def read_columns(path: str | os.PathLike[str], gpus: int | None) -> Any:
    """The :class:`~gpuwatchd.sampling.columns.TraceColumns` of the CSV log at ``path``
    (``gpus`` as in :func:`~gpuwatchd.sampling.replay.parse_trace`), read in blocks of
    :data:`BLOCK_BYTES`, or None for what the row parser must read (module docstring).
    Never raises for a malformed file."""
    blocks = csv_blocks(path)
    if blocks is None:
        return None
    import pyarrow as pa  # type: ignore[import-untyped]

    try:
        return rows_to_columns(os.fspath(path), blocks, gpus)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError, UnicodeDecodeError,
            ValueError, KeyError, TypeError, NotColumnar):  # fmt: skip
        return None


def csv_blocks(
    path: str | os.PathLike[str],
    block_bytes: int = BLOCK_BYTES,
    metrics: Collection[str] | None = None,
) -> Iterator[RowBlock] | None:
    """The :class:`RowBlock` of each ``block_bytes`` of the CSV log at ``path``, read
    as they are consumed; None when the header is not one the columnar reader takes (or
    no pyarrow). ``metrics``: the :data:`~gpuwatchd.sampling.columns.METRICS` to read
    (default all); the others are not parsed and read as absent (None), a malformed
    cell there unseen. With ``index``, ``uuid`` and ``name`` are parsed until every GPU
    seen has a cell of each (:class:`_BlockReader`). Iterating raises
    ``pyarrow.ArrowInvalid``, OSError, ValueError or :class:`NotColumnar` for what the
    row parser must read."""
    try:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc  # type: ignore[import-untyped]
        import pyarrow.csv as pacsv  # type: ignore[import-untyped]
    except ImportError:
        return None
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8", newline="") as stream:
            header = stream.readline()
    except (OSError, UnicodeDecodeError):
        return None
    columns = _header_columns(header.rstrip("\r\n").split(","))
    if columns is None:
        return None
    if metrics is not None:
        from gpuwatchd.sampling.columns import METRICS

        skipped = {csv for field, csv in zip(METRICS, csv_format.METRIC_COLUMNS, strict=True)
                   if field not in metrics}  # fmt: skip
        columns = {c: where for c, where in columns.items() if c not in skipped}
    reader = _BlockReader(np, pa, pc, pacsv, len(header.split(",")), columns)
    # Each block of whole lines is parsed on its own (pyarrow.csv.read_csv): pyarrow's
    # streaming reader (open_csv) keeps memory growing with the file (measured: 204 MiB
    # for a day of 8 GPUs, 480 MiB for a week, iterating its batches and nothing else).
    return (
        block
        for text in _line_blocks(name, len(header.encode()), block_bytes)
        for block in reader.blocks(text)
    )


class FirstCells:
    """Which GPUs of a trace being read have their first ``uuid`` / ``name`` cell, so
    that a reader parses those text columns only while a GPU lacks one (rows_to_columns
    and stream_columns keep a GPU's first cell, and it never changes after). A GPU is
    a key of the reader's choosing: its index (CSV), or (host, index) (Parquet).
    ``columns``: the text columns the trace has."""

    def __init__(self, columns: Iterable[str]) -> None:
        self.seen: set[Any] = set()
        """The GPUs of the rows read so far."""
        self._named: dict[str, set[Any]] = {c: set() for c in columns}

    def lacking(self) -> list[str]:
        """The columns some GPU seen has no cell of yet (all of them before any row)."""
        if not self.seen:
            return list(self._named)
        return [c for c, named in self._named.items() if not named >= self.seen]

    def has(self, column: str, gpus: set[Any]) -> bool:
        """True when every one of ``gpus`` has a cell of ``column``."""
        return gpus <= self._named[column]

    def add(self, gpus: set[Any], cells: Mapping[str, Mapping[Any, str]]) -> None:
        """Note the ``gpus`` of a block of rows and the GPUs given a first cell there
        (``{column: {gpu: cell}}``)."""
        self.seen |= gpus
        for column, found in cells.items():
            self._named[column].update(found)


class _BlockReader:
    """Parses blocks of whole lines of one CSV log into :class:`RowBlock` (columns as
    in :func:`_header_columns`); with ``index``, it skips ``uuid`` and ``name`` once
    every GPU seen has a cell of each (rows_to_columns and stream_columns keep a GPU's
    first cell), and parses a block again with them when it brings a new GPU."""

    def __init__(
        self, np: Any, pa: Any, pc: Any, pacsv: Any, width: int, columns: dict[str, Any]
    ) -> None:
        self._np, self._pa, self._pc, self._pacsv = np, pa, pc, pacsv
        self._names = [f"c{k}" for k in range(width)]
        self._columns = columns
        self._texts = [c for c in ("uuid", "name") if c in columns and "index" in columns]
        self._firsts = FirstCells(self._texts)  # by GPU index

    def blocks(self, text: bytes | memoryview) -> Iterator[RowBlock]:
        """The rows of ``text`` (whole lines) as a RowBlock; none for no rows."""
        firsts = self._firsts
        if self._texts and not firsts.lacking():
            block = self._parse(text, [c for c in self._columns if c not in self._texts])
            if block is None:
                return
            if self._indexes(block) <= firsts.seen:
                yield block
                return
        block = self._parse(text, list(self._columns))
        if block is None:
            return
        if self._texts:
            firsts.add(self._indexes(block), block.first_cells)
        yield block

    def _indexes(self, block: RowBlock) -> set[int]:
        return set(self._np.unique(block.indexes).tolist())

    def _parse(self, text: bytes | memoryview, include: list[str]) -> RowBlock | None:
        pa, pacsv = self._pa, self._pacsv
        wanted = {f"c{self._columns[c][0]}": c for c in include}
        table = pacsv.read_csv(
            pa.py_buffer(text),
            pacsv.ReadOptions(
                encoding="utf8",
                column_names=self._names,
                use_threads=False,
                block_size=len(text) + 1,  # one record batch
            ),
            pacsv.ParseOptions(delimiter=","),
            pacsv.ConvertOptions(
                column_types=dict.fromkeys(self._names, pa.string()),
                include_columns=list(wanted),
                strings_can_be_null=False,
                auto_dict_encode=False,
            ),
        )
        if not table.num_rows:
            return None
        (batch,) = table.combine_chunks().to_batches()
        return _csv_block(self._np, pa, self._pc, batch, wanted, self._columns)


_NOT_BLANK: Final = re.compile(rb"\S")


def _line_blocks(path: str, offset: int, block_bytes: int) -> Iterator[bytes | memoryview]:
    """The bytes of ``path`` from ``offset`` on, ``block_bytes`` or so at a time, each
    ending at the end of a line (the last one at the end of the file), blank ones left
    out; a block is read once and not copied (the file is read again from the start
    of the line it cuts)."""
    with open(path, "rb") as stream:
        stream.seek(offset)
        rest = b""  # the start of a line longer than a block
        while True:
            chunk = stream.read(block_bytes)
            if len(chunk) < block_bytes:  # the end of the file
                text = rest + chunk
                if _NOT_BLANK.search(text):
                    yield text
                return
            end = chunk.rfind(b"\n") + 1
            if end == 0:
                rest += chunk
                continue
            stream.seek(end - len(chunk), os.SEEK_CUR)
            if rest:
                text, rest = rest + chunk[:end], b""
                if _NOT_BLANK.search(text):
                    yield text
            elif _NOT_BLANK.search(chunk, 0, end):
                yield memoryview(chunk)[:end]


class NotColumnar(Exception):
    """A block the columnar reader does not take (the row parser reads the file)."""


def _header_columns(cells: list[str]) -> dict[str, tuple[int, str]] | None:
    """Known column -> (position, unit) of a CSV header; None where the row parser must
    read the file (a bad or repeated cell, no timestamp, DCGM columns, an unknown unit)."""
    columns: dict[str, tuple[int, str]] = {}
    for position, cell in enumerate(cells):
        match = csv_format.HEADER_CELL.match(cell)
        if match is None:
            return None
        column = csv_format.HEADER_ALIASES.get(match.group(1), match.group(1))
        if column in csv_format.DCGM_COLUMNS:
            return None  # the row parser reads the optional DCGM columns
        if column not in csv_format.KNOWN_COLUMNS:
            continue
        if column in columns:
            return None
        unit = (match.group(2) or "").strip()
        if (
            column in csv_format.METRIC_UNITS
            and unit
            and unit not in csv_format.METRIC_UNITS[column]
        ):
            return None
        columns[column] = (position, unit)
    if "timestamp" not in columns:
        return None
    return columns


def _na_mask(pc: Any, text: Any) -> Any:
    """True where a trimmed cell means NA (:data:`~gpuwatchd.sampling.trace.NA_CELL_TEXTS` or
    any ``[...]``)."""
    import pyarrow as pa

    na_text = pa.array(sorted(csv_format.NA_CELL_TEXTS), type=pa.string())
    return pc.or_(pc.is_in(text, value_set=na_text), pc.starts_with(text, "["))


def _text_column(np: Any, pc: Any, column: Any) -> Any:
    """An object array of the trimmed cells, None where NA."""
    text = pc.utf8_trim_whitespace(column)
    na = _na_mask(pc, text).to_numpy(zero_copy_only=False)
    out = np.array(text.to_pylist(), dtype=object)
    out[na] = None
    return out


def _bare(pa: Any, pc: Any, column: Any, suffix: str) -> Any:
    """``column`` (strings) as binary cells without the leading spaces of its first
    cell and without ``suffix``, or None unless every cell has both (the usual CSV:
    ``, 116.51 W``); what is left is cast, which takes no whitespace."""
    first = column[0].as_py()
    lead = len(first) - len(first.lstrip(" "))
    raw = column.view(pa.binary())
    if lead and not pc.all(pc.starts_with(raw, " " * lead)).as_py():
        return None
    if suffix and not pc.all(pc.ends_with(raw, suffix)).as_py():
        return None
    if suffix:
        return pc.binary_slice(raw, lead, -len(suffix))
    # an explicit end: pyarrow 26's binary_slice overflows sizing its output without one
    return pc.binary_slice(raw, lead, pc.max(pc.binary_length(raw)).as_py())


def _plain_metric(np: Any, pa: Any, pc: Any, column: Any, metric: str, header_unit: str) -> Any:
    """:func:`_metric_values` of a column whose every cell is a number with the first
    cell's spacing and unit, in one cast; None for any other (``[N/A]`` cells)."""
    _, _, unit = column[0].as_py().strip().partition(" ")
    unit = unit.strip()
    factor = csv_format.METRIC_UNITS[metric].get(
        unit or header_unit or csv_format.DEFAULT_UNITS[metric]
    )
    bare = _bare(pa, pc, column, " " + unit if unit else "")
    if factor is None or bare is None:
        return None
    try:
        values = pc.cast(bare, "float64")
    except pa.ArrowInvalid:
        return None
    if values.null_count:
        return None
    out = values.to_numpy()  # read-only: the callers copy into their matrices
    if factor != 1.0:
        out = out * factor
    if metric.startswith("memory."):
        out = np.trunc(out)  # the row parser's int(): whole bytes
    return out


def _metric_values(np: Any, pc: Any, column: Any, metric: str, header_unit: str) -> Any:
    """float64 values of one metric column in GpuSample's units, NaN for NA. Every value
    cell carries the unit of the first one (``116.51 W``) or none; raises NotColumnar
    otherwise and ArrowInvalid for a cell that is not a number."""
    import pyarrow as pa

    plain = _plain_metric(np, pa, pc, column, metric, header_unit)
    if plain is not None:
        return plain

    text = pc.utf8_trim_whitespace(column)
    na = _na_mask(pc, text)
    values_text = pc.if_else(na, pa.scalar(None, pa.string()), text)
    present = pc.drop_null(values_text)
    units = csv_format.METRIC_UNITS[metric]
    unit = ""
    if len(present):
        _, _, unit = present[0].as_py().partition(" ")
        unit = unit.strip()
    if unit:
        if not pc.all(pc.ends_with(present, " " + unit)).as_py():
            raise NotColumnar(metric)
        values_text = pc.utf8_slice_codeunits(values_text, 0, -(len(unit) + 1))
    factor = units.get(unit or header_unit or csv_format.DEFAULT_UNITS[metric])
    if factor is None:
        raise NotColumnar(metric)
    values = pc.cast(pc.utf8_trim_whitespace(values_text), "float64")
    out = values.to_numpy(zero_copy_only=False).astype(np.float64, copy=True)
    out[np.asarray(na.to_numpy(zero_copy_only=False), dtype=bool)] = np.nan
    if factor != 1.0:
        out *= factor
    if metric.startswith("memory."):
        out = np.trunc(out)  # the row parser's int(): whole bytes
    return out


def _csv_block(
    np: Any, pa: Any, pc: Any, batch: Any, wanted: dict[str, str], columns: dict[str, Any]
) -> RowBlock:
    by_column = {wanted[n]: batch.column(n) for n in batch.schema.names}
    stamps = _timestamps(pc, by_column["timestamp"])
    if stamps is None:
        raise NotColumnar("timestamp")
    indexes = None
    if "index" in by_column:
        text = _bare(pa, pc, by_column["index"], "")  # ", 3" as record writes it
        if text is None or not pc.all(pc.utf8_is_digit(text.view(pa.string()))).as_py():
            text = pc.utf8_trim_whitespace(by_column["index"])
            if not pc.all(pc.utf8_is_digit(text)).as_py():
                raise NotColumnar("index")
        indexes = pc.cast(text, "int64").to_numpy()  # digits only: no nulls, no copy
    metrics = tuple(
        _metric_values(np, pc, by_column[m], m, columns[m][1]) if m in by_column else None
        for m in csv_format.METRIC_COLUMNS
    )
    texts: dict[str, Any] = {c: by_column[c] for c in ("uuid", "name") if c in by_column}
    if indexes is not None:
        firsts = {c: _first_per_index(np, pc, text, indexes) for c, text in texts.items()}
        return RowBlock(stamps, indexes, None, None, firsts, metrics)
    return RowBlock(
        stamps,
        None,
        _text_column(np, pc, texts["uuid"]) if "uuid" in texts else None,
        _text_column(np, pc, texts["name"]) if "name" in texts else None,
        {},
        metrics,
    )


def _first_per_index(np: Any, pc: Any, column: Any, indexes: Any) -> dict[int, str]:
    """``{GPU index: its first non-NA trimmed cell}`` of one block's text column."""
    text = pc.utf8_trim_whitespace(column)
    valid = ~np.asarray(_na_mask(pc, text).to_numpy(zero_copy_only=False), dtype=bool)
    rows = np.flatnonzero(valid)
    _, first = np.unique(indexes[rows], return_index=True)
    picked = rows[first]
    cells = text.take(picked).to_pylist()
    return {int(indexes[r]): cell for r, cell in zip(picked.tolist(), cells, strict=True)}


def rows_to_columns(name: str, blocks: Iterable[RowBlock], gpus: int | None) -> Any:
    """A :class:`~gpuwatchd.sampling.columns.TraceColumns` named ``name`` of the rows of
    ``blocks`` (one row per GPU-sample, in file order), framed as the row parser frames
    them: by ``index`` (a repeated index starts a sample; a GPU without a row in a sample
    is NA there) or, without one, interleaved (``gpus`` rows per sample, incomplete
    samples skipped and listed). Returns None where the row parser must decide (it
    raises): no rows, a GPU count that cannot be inferred or disagrees with ``gpus``,
    timestamps going backwards; also where the columns cannot hold the trace (a GPU whose
    uuid or name changes, a repeated uuid). Raises what reading a block raises."""
    import numpy as np

    rows = _Rows()
    for block in blocks:
        if len(block.timestamps_s):
            rows.blocks.append(block)
    if not rows.blocks:
        return None
    stamps = rows.column(np, "timestamps_s")
    uuids = rows.column(np, "uuids")
    names = rows.column(np, "names")
    indexes = rows.column(np, "indexes")
    firsts: dict[str, dict[int, str]] = {}
    for block in rows.blocks:
        for column, cells in block.first_cells.items():
            for index, cell in cells.items():
                firsts.setdefault(column, {}).setdefault(index, cell)
    if indexes is not None:
        uuids, names = firsts.get("uuid", {}), firsts.get("name", {})
    return _framed(np, name, stamps, indexes, uuids, names, rows.blocks, gpus)


def _framed(
    np: Any,
    name: str,
    stamps: Any,
    indexes: Any,
    uuids: Any,
    names: Any,
    blocks: list[RowBlock],
    gpus: int | None,
) -> Any:
    """The TraceColumns of the rows (see :func:`rows_to_columns`); ``blocks`` is emptied
    as their values are moved into the matrices."""
    from gpuwatchd.sampling.columns import TraceColumns

    if indexes is not None:
        got = _by_index(np, stamps, indexes, gpus)
    else:
        got = _interleaved(np, stamps, gpus)
    if got is None:
        return None
    frame_of, column_of, first_rows, gpu_indexes, skipped = got
    frames, count = first_rows.shape[0], len(gpu_indexes)
    times = stamps[first_rows]
    if frames == 0 or bool(np.any(np.diff(times) < 0)):
        return None  # backwards: the row parser names the line
    arrays = [np.full((frames, count), np.nan) for _ in csv_format.METRIC_COLUMNS]
    begin = 0
    while blocks:  # each block is dropped once its rows are in the matrices
        block = blocks.pop(0)
        end = begin + block.timestamps_s.shape[0]
        at_frame, at_column = frame_of[begin:end], column_of[begin:end]
        kept = at_frame >= 0
        if not bool(kept.all()):
            at_frame, at_column = at_frame[kept], at_column[kept]
        every = at_frame.shape[0] == kept.shape[0]
        for matrix, values in zip(arrays, block.metrics, strict=True):
            if values is not None:
                matrix[at_frame, at_column] = values if every else values[kept]
        begin = end
    if indexes is not None:  # {index: first cell}
        gpu_uuids = [uuids.get(i, f"GPU-replay-{i}") for i in gpu_indexes]
        gpu_names = [names.get(i, csv_format.DEFAULT_GPU_NAME) for i in gpu_indexes]
    else:
        gpu_uuids = _per_gpu(uuids, column_of, count, [f"GPU-replay-{i}" for i in gpu_indexes])
        gpu_names = _per_gpu(names, column_of, count, [csv_format.DEFAULT_GPU_NAME] * count)
    if indexes is None and not (
        _constant(uuids, column_of, frame_of, gpu_uuids, count)
        and _constant(names, column_of, frame_of, gpu_names, count)
    ):
        return None  # a GPU whose uuid or name changes: the per-sample engine's
    if len(set(gpu_uuids)) != count:
        return None
    util, used, total, temperature, power = arrays
    return TraceColumns(
        name,
        tuple(gpu_uuids),
        tuple(gpu_indexes),
        tuple(gpu_names),
        times,
        util,
        used,
        total,
        temperature,
        power,
        np.zeros((frames, count)),
        skipped_lines=skipped,
    )


def _per_gpu(cells: Any, column_of: Any, count: int, default: list[str]) -> list[str]:
    """Each GPU column's first non-NA cell (file order), else its default."""
    if cells is None:
        return default
    out: list[str | None] = [None] * count
    missing = count
    for cell, column in zip(cells.tolist(), column_of.tolist(), strict=True):
        if cell is not None and out[column] is None:
            out[column] = cell
            missing -= 1
            if not missing:
                break
    return [o if o is not None else d for o, d in zip(out, default, strict=True)]


def _constant(cells: Any, column_of: Any, frame_of: Any, per_gpu: Any, count: int) -> bool:
    """True when every kept row's cell is NA or its GPU column's value (interleaved
    traces take the row's own uuid and name per sample)."""
    if cells is None or per_gpu is None:
        return True
    import numpy as np

    kept = frame_of >= 0
    expected = np.array(per_gpu, dtype=object)[column_of[kept]]
    got = cells[kept]
    return bool(np.all((got == None) | (got == expected)))  # noqa: E711


def _by_index(np: Any, stamps: Any, indexes: Any, gpus: int | None) -> Any:
    """``(frame of each row, GPU column of each row, first row of each frame, GPU
    indexes, ())`` of a trace with an ``index`` column, or None."""
    gpu_indexes = np.unique(indexes)
    if gpus is not None and gpus != gpu_indexes.shape[0]:
        return None
    column_of = np.searchsorted(gpu_indexes, indexes)
    # A sample's rows in ascending index order (nvidia-smi's and record's): an index not
    # above the one before starts a sample. The row parser starts one where an index
    # repeats: the same where each new sample's first index was in the sample before.
    new = np.empty(indexes.shape[0], dtype=bool)
    new[0] = True
    new[1:] = indexes[1:] <= indexes[:-1]
    frame_of = np.cumsum(new) - 1
    first_rows = np.flatnonzero(new)
    present = np.zeros((first_rows.shape[0], gpu_indexes.shape[0]), dtype=bool)
    present[frame_of, column_of] = True
    if first_rows.shape[0] > 1 and not bool(
        np.all(present[np.arange(1, first_rows.shape[0]) - 1, column_of[first_rows[1:]]])
    ):
        return None
    return frame_of, column_of, first_rows, [int(i) for i in gpu_indexes], ()


def _interleaved(np: Any, stamps: Any, gpus: int | None) -> Any:
    """``(frame of each row (-1: skipped), GPU column of each row, first row of each
    frame, GPU indexes, skipped row numbers)`` of an interleaved trace: the row parser's
    grouping (replay._frames_interleaved), run per group of rows close in time."""
    n = stamps.shape[0]
    gaps = np.diff(stamps)
    breaks = np.flatnonzero((gaps < 0.0) | (gaps > csv_format.SAME_SAMPLE_S)) + 1
    starts = np.concatenate(([0], breaks))
    sizes = np.diff(np.concatenate((starts, [n])))
    if gpus is not None:
        count = gpus
    else:
        common, how_often = Counter(sizes.tolist()).most_common(1)[0]
        if 2 * common * how_often < n:
            return None  # the row parser says why
        count = common
    if bool(np.all(sizes == count)):
        first_rows = starts
        skipped: list[int] = []
    else:
        first_rows_list: list[int] = []
        skipped = []
        pending_start, pending = 0, 0
        for start, size in zip(starts.tolist(), sizes.tolist(), strict=True):
            if pending and size == count:  # a whole sample starts: the rows before are cut
                skipped.extend(range(pending_start, pending_start + pending))
                pending = 0
            if not pending:
                pending_start = start
            pending += size
            while pending >= count:
                first_rows_list.append(pending_start)
                pending_start += count
                pending -= count
        skipped.extend(range(pending_start, pending_start + pending))
        first_rows = np.array(first_rows_list, dtype=np.int64)
    frame_of = np.full(n, -1, dtype=np.int64)
    column_of = np.zeros(n, dtype=np.int64)
    if first_rows.shape[0]:
        rows = (first_rows[:, None] + np.arange(count)).ravel()
        frame_of[rows] = np.repeat(np.arange(first_rows.shape[0]), count)
        column_of[rows] = np.tile(np.arange(count), first_rows.shape[0])
    # rows are numbered from the line after the header (blank lines are not counted)
    lines = tuple(r + 2 for r in skipped)
    return frame_of, column_of, first_rows, list(range(count)), lines


def parse_fast(path: str | os.PathLike[str], gpus: int | None) -> Trace | None:
    """The :class:`~gpuwatchd.sampling.trace.Trace` of ``path`` read by
    :func:`read_columns`, or None where it returns None. Never raises for a malformed
    file."""
    columns = read_columns(path, gpus)
    return None if columns is None else columns.to_trace()


def stream_columns(name: str, blocks: Iterable[RowBlock], gpus: int | None) -> Iterator[Any]:
    """The rows of ``blocks`` as consecutive chunks of frames
    (:class:`~gpuwatchd.sampling.columns.TraceColumns`, about one block each), framed
    as :func:`rows_to_columns` frames them, holding one block at a time; for a trace
    that needs no look at its whole: with ``index``, every GPU of the trace in the first
    block; without, every sample whole (``gpus`` or the first block's rows per sample).
    Raises :class:`NotColumnar` where it cannot tell (the caller reads the trace whole),
    and what reading a block raises."""
    import numpy as np

    from gpuwatchd.sampling.columns import TraceColumns

    held: RowBlock | None = None  # rows of a sample that may go on in the next block
    layout: tuple[list[int], tuple[str, ...], tuple[str, ...]] | None = None
    named: dict[str, set[int]] = {}
    group_sizes: Counter[int] = Counter()
    open_start, open_size, total_rows, last_s = 0, 0, 0, None
    count = gpus
    last_present: Any = None
    for block in itertools.chain(blocks, [None]):  # one block read at a time
        if block is not None:
            if not len(block.timestamps_s):
                continue
            rows = block if held is None else _concat(np, held, block)
        elif held is None:
            _close_groups(np, group_sizes, [open_start], [open_size], count)
            _check_count(group_sizes, total_rows, count, gpus)
            return
        else:
            rows = held
        stamps, indexes = rows.timestamps_s, rows.indexes
        n = stamps.shape[0]
        if indexes is not None:
            if layout is None:
                found = sorted(int(i) for i in np.unique(indexes))
                if gpus is not None and gpus != len(found):
                    raise NotColumnar("--gpus")
                firsts = rows.first_cells
                uuids = tuple(firsts.get("uuid", {}).get(i, f"GPU-replay-{i}") for i in found)
                names = tuple(
                    firsts.get("name", {}).get(i, csv_format.DEFAULT_GPU_NAME) for i in found
                )
                if len(set(uuids)) != len(uuids):
                    raise NotColumnar("uuid")
                layout = (found, uuids, names)
                named = {column: set(cells) for column, cells in firsts.items()}
            gpu_indexes = np.array(layout[0])
            column_of = np.searchsorted(gpu_indexes, indexes)
            if bool(np.any(column_of >= gpu_indexes.shape[0])) or bool(
                np.any(gpu_indexes[np.minimum(column_of, gpu_indexes.shape[0] - 1)] != indexes)
            ):
                raise NotColumnar("a GPU index not in the first block")
            for column, cells in rows.first_cells.items():
                if set(cells) - named.get(column, set()):
                    raise NotColumnar("a uuid or name first seen after the first block")
            new = np.empty(n, dtype=bool)
            new[0] = True
            new[1:] = indexes[1:] <= indexes[:-1]
            starts = np.flatnonzero(new)
            cut = n if block is None else int(starts[-1])  # the last sample may go on
            if cut == 0:
                held = rows
                continue
            frame_of = np.cumsum(new[:cut]) - 1
            frames = int(frame_of[-1]) + 1
            present = np.zeros((frames, gpu_indexes.shape[0]), dtype=bool)
            present[frame_of, column_of[:cut]] = True
            firsts_at = starts[starts < cut]
            # a sample starts where an index repeats (the row parser's rule): the first
            # index of each sample was in the sample before
            before = np.zeros_like(present)
            before[1:] = present[:-1]
            if last_present is not None:
                before[0] = last_present
            check = np.arange(0 if last_present is not None else 1, frames)
            if not bool(np.all(before[check, column_of[firsts_at[check]]])):
                raise NotColumnar("an index that does not repeat starts a sample")
            last_present = present[-1]
            first_rows = firsts_at
        else:
            if count is None:
                gaps = np.diff(stamps)
                breaks = np.flatnonzero((gaps < 0.0) | (gaps > csv_format.SAME_SAMPLE_S)) + 1
                sizes = np.diff(np.concatenate(([0], breaks, [n])))
                common, how_often = Counter(sizes.tolist()).most_common(1)[0]
                if 2 * common * how_often < n:
                    raise NotColumnar("GPU count")
                count = common
            if rows.uuids is not None or rows.names is not None:
                raise NotColumnar("uuid or name without index")
            if block is None and n % count:
                raise NotColumnar("an incomplete last sample")
            cut = n if block is None else n - n % count
            if block is not None and cut == n:
                cut = n - count  # the last sample's rows may not all be here
            if cut <= 0:
                held = rows
                continue
            first_rows = np.arange(0, cut, count)
            # The row parser groups rows close in time and skips the rows before a group
            # of exactly ``count`` rows that starts inside a sample: none may here.
            gaps = np.diff(stamps[:cut])
            breaks = np.flatnonzero((gaps < 0.0) | (gaps > csv_format.SAME_SAMPLE_S)) + 1
            if last_s is not None and not 0.0 <= stamps[0] - last_s <= csv_format.SAME_SAMPLE_S:
                breaks = np.concatenate(([0], breaks))
            edges = np.concatenate((breaks, [cut]))
            open_size += int(edges[0])
            if edges.shape[0] > 1:  # the open group and each one between breaks close
                starts = np.concatenate(([open_start], total_rows + edges[:-2]))
                sizes = np.concatenate(([open_size], np.diff(edges[:-1])))
                _close_groups(np, group_sizes, starts, sizes, count)
                open_start, open_size = total_rows + int(edges[-2]), int(edges[-1] - edges[-2])
            last_s = float(stamps[cut - 1])
            total_rows += cut
            frame_of = np.repeat(np.arange(first_rows.shape[0]), count)
            column_of = np.tile(np.arange(count), first_rows.shape[0])
            layout = layout or (list(range(count)), tuple(f"GPU-replay-{k}" for k in range(count)),
                                (csv_format.DEFAULT_GPU_NAME,) * count)  # fmt: skip
        frames, width = first_rows.shape[0], len(layout[0])
        matrices = []
        for values in rows.metrics:
            matrix = np.full((frames, width), np.nan)
            if values is not None:
                matrix[frame_of, column_of[:cut]] = values[:cut]
            matrices.append(matrix)
        held = None if cut == n else _slice(rows, cut)
        if block is None:
            _close_groups(np, group_sizes, [open_start], [open_size], count)
            _check_count(group_sizes, total_rows, count, gpus)
        util, used, total, temperature, power = matrices
        yield TraceColumns(
            name,
            layout[1],
            tuple(layout[0]),
            layout[2],
            stamps[first_rows].copy(),
            util,
            used,
            total,
            temperature,
            power,
            np.zeros((frames, width)),
        )


def _close_groups(
    np: Any, counts: Counter[int], starts: Any, sizes: Any, count: int | None
) -> None:
    """Count the groups of rows close in time of ``sizes`` rows from rows ``starts``
    (empty ones left out); raise NotColumnar for one of exactly ``count`` rows inside a
    sample (the row parser then skips the rows before it as an incomplete sample)."""
    starts, sizes = np.asarray(starts), np.asarray(sizes)
    kept = sizes > 0
    found, how_often = np.unique(sizes[kept], return_counts=True)
    counts.update(dict(zip(found.tolist(), how_often.tolist(), strict=True)))
    if count is not None and bool(np.any((sizes == count) & (starts % count != 0))):
        raise NotColumnar("an incomplete sample")


def _check_count(sizes: Counter[int], rows: int, count: int | None, gpus: int | None) -> None:
    """Raise NotColumnar unless the whole trace gives the GPU count taken from its first
    block (the row parser's rule: the most common size of groups of rows close in time,
    when such groups hold half the rows); nothing to check with ``gpus`` or ``index``."""
    if gpus is not None or count is None or not rows:
        return
    common, how_often = sizes.most_common(1)[0]
    if common != count or 2 * common * how_often < rows:
        raise NotColumnar("GPU count")


def _slice(rows: RowBlock, first: int) -> RowBlock:
    """The rows of ``rows`` from ``first`` on."""

    def cut(array: Any) -> Any:
        return None if array is None else array[first:]

    return RowBlock(
        rows.timestamps_s[first:],
        cut(rows.indexes),
        cut(rows.uuids),
        cut(rows.names),
        rows.first_cells,
        tuple(cut(m) for m in rows.metrics),
    )


def _concat(np: Any, before: RowBlock, after: RowBlock) -> RowBlock:
    """The rows of ``before`` then ``after``."""

    def join(a: Any, b: Any) -> Any:
        return None if a is None or b is None else np.concatenate((a, b))

    return RowBlock(
        join(before.timestamps_s, after.timestamps_s),
        join(before.indexes, after.indexes),
        join(before.uuids, after.uuids),
        join(before.names, after.names),
        after.first_cells,
        tuple(join(a, b) for a, b in zip(before.metrics, after.metrics, strict=True)),
    )
