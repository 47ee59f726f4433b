"""GPU traces as Parquet (``gpuwatchd record --out FILE.parquet``, ``gpuwatchd replay``).

One row per GPU-sample with record's CSV columns, typed (:data:`PARQUET_COLUMNS`), NA as
null, and the recording machine in ``host``; rows are written in row groups and read
back in record batches of the columns needed, as chunks of frames of one host
(:func:`stream_parquet`) or of each host (:class:`HostStreams`), or whole, one
:class:`~gpuwatchd.sampling.columns.TraceColumns` per host (:func:`read_parquet`).
Needs pyarrow (the ``replay`` extra). Specification: docs/backtests.md.
"""

from __future__ import annotations

import glob
import os
from collections import deque
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from typing import Any, Final

from gpuwatchd.errors import ReplayError
from gpuwatchd.model import NA, GpuSample

__all__ = [
    "PARQUET_COLUMNS",
    "ROW_GROUP_ROWS",
    "HostStreams",
    "ParquetTraceWriter",
    "host_row_groups",
    "parquet_files",
    "parquet_schema",
    "read_parquet",
    "stream_parquet",
]

PARQUET_COLUMNS: Final = (
    ("host", "string"),
    ("timestamp", "timestamp[ms, UTC]"),
    ("index", "int32"),
    ("uuid", "string"),
    ("name", "string"),
    ("utilization.gpu [%]", "float64"),
    ("memory.used [MiB]", "int64"),
    ("memory.total [MiB]", "int64"),
    ("temperature.gpu", "float64"),
    ("power.draw [W]", "float64"),
)
"""(column, Arrow type) of a Parquet trace: the CSV's columns and units
(gpuwatchd/record.py CSV_HEADER), null where the CSV says ``[N/A]``, plus ``host``."""

ROW_GROUP_ROWS: Final = 1 << 17
"""Rows per row group written (131,072: 4.5 hours of 8 GPUs at 1 Hz); a reader holds
about one group's rows at a time."""

READ_BATCH_ROWS: Final = 1 << 18
"""Rows read at a time (a record batch; a row group may hold more): 32,768 samples of 8
GPUs, 4,096 of 64, about 30 MiB as arrays: what a replay holds, whatever the file."""

_MIB: Final = 2**20

_METRIC_COLUMNS: Final = (
    ("utilization.gpu [%]", 1.0),
    ("memory.used [MiB]", float(_MIB)),
    ("memory.total [MiB]", float(_MIB)),
    ("temperature.gpu", 1.0),
    ("power.draw [W]", 1.0),
)
"""(column, factor to GpuSample's unit) of each of TraceColumns' METRICS, in order."""


def parquet_schema() -> Any:
    """The ``pyarrow.Schema`` of :data:`PARQUET_COLUMNS` (ImportError without pyarrow)."""
    import pyarrow as pa  # type: ignore[import-untyped]

    types = {
        "string": pa.string(),
        "timestamp[ms, UTC]": pa.timestamp("ms", tz="UTC"),
        "int32": pa.int32(),
        "int64": pa.int64(),
        "float64": pa.float64(),
    }
    return pa.schema([(name, types[kind]) for name, kind in PARQUET_COLUMNS])


class ParquetTraceWriter:
    """Write samples to a new Parquet file at ``path`` as rows of :data:`PARQUET_COLUMNS`,
    ``row_group_rows`` rows per row group (the last one at :meth:`close`).

    Values are rounded as the CSV writes them (utilization, temperature: whole; memory:
    whole MiB rounded down; power: 0.01 W; time: ms), so both replay alike. Raises
    ImportError without pyarrow, OSError when the file cannot be written.
    """

    def __init__(self, path: str, host: str, *, row_group_rows: int = ROW_GROUP_ROWS) -> None:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        self.path = path
        self.host = host
        self._rows_per_group = row_group_rows
        self._writer = pq.ParquetWriter(path, parquet_schema(), compression="zstd")
        self._columns: dict[str, list[Any]] = {name: [] for name, _ in PARQUET_COLUMNS}

    def write(self, samples: Sequence[GpuSample], timestamp_s: float) -> None:
        """Append one sample of every GPU taken at ``timestamp_s`` (UTC seconds)."""
        columns = self._columns
        stamp_ms = round(timestamp_s * 1000)
        for s in samples:
            columns["host"].append(self.host)
            columns["timestamp"].append(stamp_ms)
            columns["index"].append(s.index)
            columns["uuid"].append(s.uuid)
            columns["name"].append(s.name)
            util, temp, power = s.utilization_gpu_pct, s.temperature_gpu_c, s.power_draw_w
            used, total = s.memory_used_bytes, s.memory_total_bytes
            columns["utilization.gpu [%]"].append(None if util is NA else float(round(util)))
            columns["memory.used [MiB]"].append(None if used is NA else int(used) // _MIB)
            columns["memory.total [MiB]"].append(None if total is NA else int(total) // _MIB)
            columns["temperature.gpu"].append(None if temp is NA else float(round(temp)))
            columns["power.draw [W]"].append(None if power is NA else round(power, 2))
        if len(columns["host"]) >= self._rows_per_group:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as one row group (nothing if none)."""
        import pyarrow as pa

        if not self._columns["host"]:
            return
        table = pa.Table.from_pydict(self._columns, schema=parquet_schema())
        self._writer.write_table(table, row_group_size=len(table))
        for values in self._columns.values():
            values.clear()

    def close(self) -> None:
        """Write the last row group and the file's footer; the file is readable after."""
        self.flush()
        self._writer.close()


def parquet_files(source: str) -> list[str] | None:
    """The Parquet files ``source`` names: a ``.parquet`` file, a directory (its
    ``*.parquet``), or a glob pattern; None when it names none of those (a CSV trace).
    Raises :class:`~gpuwatchd.errors.ReplayError` for a directory or pattern without
    any Parquet file."""
    if os.path.isdir(source):
        found = sorted(glob.glob(os.path.join(glob.escape(source), "*.parquet")))
    elif glob.has_magic(source):
        found = sorted(glob.glob(source))
    elif source.endswith(".parquet"):
        return [source]
    else:
        return None
    if not found:
        raise ReplayError(f"{source}: no Parquet file (*.parquet) there")
    return found


def _first_per_gpu(np: Any, pc: Any, column: Any, hosts: Any, indexes: Any) -> dict[Any, str]:
    """``{(host, index): the first non-null cell of column}`` of a record batch."""
    valid = np.asarray(pc.is_valid(column).to_numpy(zero_copy_only=False), dtype=bool)
    rows = np.flatnonzero(valid)
    codes = hosts[0][rows] if hosts is not None else np.zeros(rows.shape[0], dtype=np.int64)
    keys = codes.astype(np.int64) * (1 << 32) + indexes[rows]
    _, first = np.unique(keys, return_index=True)
    picked = rows[first].tolist()
    cells = column.take(picked).to_pylist()
    return {
        (None if hosts is None else hosts[1][int(hosts[0][r])], int(indexes[r])): cell
        for r, cell in zip(picked, cells, strict=True)
    }


def _blocks(
    files: Sequence[str],
    np: Any,
    pc: Any,
    metrics: Collection[str] | None,
    hosts: bool,
    batch_rows: int = READ_BATCH_ROWS,
    row_groups: Mapping[str, Sequence[int]] | None = None,
) -> Iterator[tuple[Any, Any, Any]]:
    """``((host codes, host names) or None, RowBlock, {"uuid"/"name": {(host, index):
    cell}})`` of each record batch of ``files``, in order (the ``row_groups`` given of
    a file, default all), reading only the columns needed: the ``metrics`` of
    :data:`~gpuwatchd.sampling.columns.METRICS` (default all; the others None), ``host``
    with ``hosts`` (a file without it: every row of the host named after the file;
    without ``hosts`` the host is None: files of one host), and ``uuid``/``name`` until
    every GPU (host, index) seen has a cell of each (a GPU's first cell is the one kept).
    A batch holds at most ``batch_rows`` rows (pyarrow.parquet.ParquetFile.iter_batches,
    a row group at a time); what a row group used is given back before the next."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpuwatchd.sampling.columns import METRICS
    from gpuwatchd.sampling.replay_arrow import FirstCells, RowBlock

    wanted = [
        (column, factor) if metrics is None or field in metrics else None
        for field, (column, factor) in zip(METRICS, _METRIC_COLUMNS, strict=True)
    ]
    named = FirstCells(("uuid", "name"))  # by (host, index)
    for path in files:
        try:
            names = set(pq.read_schema(path).names)
            # text columns as dictionaries: a few distinct values in a million rows (the
            # columns the file has: pyarrow raises KeyError for another)
            texts_read = [c for c in ("host", "uuid", "name") if c in names]
            handle = pq.ParquetFile(path, read_dictionary=texts_read)
        except (OSError, ValueError) as exc:  # pyarrow.ArrowInvalid: not Parquet
            raise ReplayError(f"{path}: not a readable Parquet file: {exc}") from None
        missing = {"timestamp", "index"} - names
        if missing:
            raise ReplayError(f"{path}: no column {', '.join(sorted(missing))}")
        texts = [c for c in ("uuid", "name") if c in names]
        keyed = ["index", *(["host"] if hosts and "host" in names else [])]
        base = ["timestamp", *keyed, *(w[0] for w in wanted if w and w[0] in names)]
        own_host = None if "host" in names or not hosts else [os.path.basename(path)]
        groups = range(handle.num_row_groups) if row_groups is None else row_groups[path]
        for group in groups:
            lacking = named.lacking()
            reading = [c for c in texts if c in lacking]
            batches = handle.iter_batches(
                batch_rows, row_groups=[group], columns=base + reading, use_threads=False
            )
            first_row = 0
            for batch in batches:
                block, codes = _batch_block(np, pc, pa, batch, wanted, RowBlock)
                if own_host is not None:
                    codes = (np.zeros(batch.num_rows, dtype=np.int64), own_host)
                keys = _gpu_keys(np, pc, pa, codes, block.indexes)
                firsts: dict[str, dict[Any, str]] = {}
                for column in texts:
                    if named.has(column, keys):
                        continue
                    cells = batch.column(column) if column in reading else None
                    if cells is None:  # a GPU not seen before in a group read without it
                        extra = handle.read_row_group(group, columns=[column], use_threads=False)
                        cells = extra.column(0).slice(first_row, batch.num_rows)
                        cells = cells.combine_chunks()
                    firsts[column] = _first_per_gpu(np, pc, cells, codes, block.indexes)
                named.add(keys, firsts)
                first_row += batch.num_rows
                yield codes, block, firsts
            pa.default_memory_pool().release_unused()


def _batch_block(np: Any, pc: Any, pa: Any, batch: Any, wanted: Any, row_block: Any) -> Any:
    """``(RowBlock, (host codes, host names) or None)`` of a record batch (metrics of
    ``wanted`` not in it: None)."""
    names = batch.schema.names
    stamps_ms = pc.cast(batch.column("timestamp"), "int64").to_numpy(zero_copy_only=False)
    whole, ms = np.divmod(stamps_ms, 1000)
    # as the CSV reader computes "…:SS.mmm": whole seconds + the decimals / 10**3
    stamps = whole.astype(np.float64) + ms.astype(np.float64) / 1000.0
    metrics: list[Any] = []
    for column_factor in wanted:
        if column_factor is None or column_factor[0] not in names:
            metrics.append(None)
            continue
        column, factor = column_factor
        values = pc.cast(batch.column(column), "float64").to_numpy(zero_copy_only=False)
        metrics.append(values * factor if factor != 1.0 else values)  # read-only: not written
    hosts = None  # (codes, names)
    if "host" in names:
        encoded = batch.column("host")
        if not pa.types.is_dictionary(encoded.type):
            encoded = pc.dictionary_encode(encoded)
        codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        hosts = (codes, [str(h) for h in encoded.dictionary.to_pylist()])
    indexes = batch.column("index").to_numpy(zero_copy_only=False).astype(np.int64)
    return row_block(stamps, indexes, None, None, {}, tuple(metrics)), hosts


def _gpu_keys(np: Any, pc: Any, pa: Any, hosts: Any, indexes: Any) -> set[Any]:
    """The distinct ``(host name or None, index)`` of a batch's rows."""
    if hosts is None:
        return {(None, int(i)) for i in pc.unique(pa.array(indexes)).to_pylist()}
    codes, host_names = hosts
    out = set()
    for key in pc.unique(pa.array(codes * (1 << 32) + indexes)).to_pylist():
        index = (key + (1 << 31)) % (1 << 32) - (1 << 31)  # an int32
        out.add((host_names[(key - index) >> 32], index))
    return out


def read_parquet(
    files: Sequence[str],
    gpus: int | None = None,
    hosts: Collection[str] | None = None,
    row_groups: Mapping[str, Sequence[int]] | None = None,
) -> list[Any]:
    """One :class:`~gpuwatchd.sampling.columns.TraceColumns` per host of the Parquet
    ``files`` (rows of a host in time order across its files), in host order, holding
    the whole trace; only ``hosts`` (default all) and the ``row_groups`` given of a file
    (default all). Its path is the host's name (the file's when it has no ``host``
    column) and its GPUs are named ``host/index`` (:attr:`TraceColumns.names`). Raises
    :class:`~gpuwatchd.errors.ReplayError` for a file that is not Parquet, lacks
    ``timestamp`` or ``index``, or whose rows the columns cannot hold (a repeated uuid,
    time going backwards); ImportError without pyarrow and numpy."""
    import dataclasses

    import numpy as np
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    from gpuwatchd.sampling.replay_arrow import RowBlock, rows_to_columns

    per_host: dict[str, list[RowBlock]] = {}
    firsts: dict[str, dict[Any, str]] = {"uuid": {}, "name": {}}
    for path in files:
        for codes, block, found in _blocks([path], np, pc, None, True, row_groups=row_groups):
            for column, cells in found.items():
                for key, cell in cells.items():
                    firsts[column].setdefault(key, cell)
            for host, rows in _by_host(np, block, codes, RowBlock):
                if hosts is None or host in hosts:
                    per_host.setdefault(host, []).append(rows)
    out = []
    for host in sorted(per_host):
        blocks = per_host.pop(host)
        columns = rows_to_columns(host, blocks, gpus)
        if columns is None:
            raise ReplayError(
                f"{host}: its rows do not make a trace (time going backwards, a repeated "
                "GPU uuid, or a GPU count other than --gpus)"
            )
        uuids = tuple(
            firsts["uuid"].get((host, i), _default_uuid(host, i)) for i in columns.indexes
        )
        if len(set(uuids)) != len(uuids):
            raise ReplayError(f"{host}: two GPUs with one uuid")
        labels = tuple(f"{host}/{i}" for i in columns.indexes)
        out.append(dataclasses.replace(columns, uuids=uuids, names=labels))
    return out


def _default_uuid(host: str, index: int) -> str:
    """The uuid of a GPU of a trace without a ``uuid`` cell of it."""
    return f"GPU-replay-{host}-{index}"


def _by_host(np: Any, block: Any, hosts: Any, row_block: Any) -> list[tuple[str, Any]]:
    """``[(host, its rows of block)]`` in host code order (each host's rows in order)."""
    codes, names = hosts
    if not codes.shape[0] or bool(np.all(codes == codes[0])):
        return [(names[int(codes[0])], block)] if codes.shape[0] else []
    order = np.argsort(codes, kind="stable")
    counts = np.bincount(codes)
    out = []
    first = 0
    for code in np.flatnonzero(counts).tolist():
        last = first + int(counts[code])
        out.append((names[code], _take(block, order[first:last], row_block)))
        first = last
    return out


def _take(block: Any, keep: Any, row_block: Any) -> Any:
    """The rows of ``block`` at ``keep`` (an index array)."""

    def cut(array: Any) -> Any:
        return None if array is None else array[keep]

    return row_block(
        block.timestamps_s[keep],
        cut(block.indexes),
        cut(block.uuids),
        cut(block.names),
        {},
        tuple(cut(m) for m in block.metrics),
    )


def host_row_groups(files: Sequence[str]) -> dict[str, list[tuple[str, list[int]]]] | None:
    """Where each host's rows are in ``files``, from their footers only: ``{host: [(file,
    its row groups of that host)]}``, files in the order given, known from each row
    group's ``host`` statistics (min = max, no null; a file without that column is all
    the host named after the file); None when a row group holds several hosts or its
    statistics do not say (:class:`HostStreams` reads such files). Empty row groups
    are left out. Raises :class:`~gpuwatchd.errors.ReplayError` for a file that is not
    Parquet."""
    import pyarrow.parquet as pq

    out: dict[str, list[tuple[str, list[int]]]] = {}
    for path in files:
        try:
            meta = pq.ParquetFile(path).metadata
        except (OSError, ValueError) as exc:  # pyarrow.ArrowInvalid: not Parquet
            raise ReplayError(f"{path}: not a readable Parquet file: {exc}") from None
        names = [meta.schema.column(k).name for k in range(meta.num_columns)]
        groups: dict[str, list[int]] = {}
        for group in range(meta.num_row_groups):
            row_group = meta.row_group(group)
            if not row_group.num_rows:
                continue
            if "host" not in names:
                groups.setdefault(os.path.basename(path), []).append(group)
                continue
            stats = row_group.column(names.index("host")).statistics
            if (
                stats is None
                or not stats.has_min_max
                or not stats.has_null_count
                or stats.null_count
                or stats.min != stats.max
            ):
                return None
            groups.setdefault(str(stats.min), []).append(group)
        for host, kept in groups.items():
            out.setdefault(host, []).append((path, kept))
    return out


def stream_parquet(
    files: Sequence[str],
    host: str,
    gpus: int | None = None,
    metrics: Collection[str] | None = None,
    batch_rows: int = READ_BATCH_ROWS,
    row_groups: Mapping[str, Sequence[int]] | None = None,
) -> Iterator[Any]:
    """The rows of ``files`` (one host's: the ``row_groups`` given of a file, default
    all, :func:`host_row_groups`) as consecutive chunks of frames
    (:class:`~gpuwatchd.sampling.columns.TraceColumns` named ``host``, GPUs named
    ``host/index``, as :func:`read_parquet` gives them), a record batch of
    ``batch_rows`` rows at a time (gpuwatchd/sampling/replay_arrow.py
    ``stream_columns``), holding about one batch; ``metrics``: the
    :data:`~gpuwatchd.sampling.columns.METRICS` read (default all, the others NaN).
    Raises what it raises."""
    import dataclasses

    import numpy as np
    import pyarrow.compute as pc

    def blocks() -> Iterator[Any]:
        for _, block, found in _blocks(files, np, pc, metrics, False, batch_rows, row_groups):
            firsts = {
                c: {index: cell for (_, index), cell in cells.items()} for c, cells in found.items()
            }
            yield dataclasses.replace(block, first_cells=firsts)

    return _host_chunks(host, blocks(), gpus)


def _host_chunks(host: str, blocks: Iterator[Any], gpus: int | None) -> Generator[Any, None, None]:
    """``stream_columns`` of one host's ``blocks`` (first cells by GPU index), GPUs named
    ``host/index`` and without a uuid cell given :func:`read_parquet`'s default uuid
    (NotColumnar when that repeats a uuid: read_parquet then says so)."""
    import dataclasses

    from gpuwatchd.sampling.replay_arrow import NotColumnar, stream_columns

    given: set[int] | None = None  # GPUs with a uuid cell in the first block (the layout's)

    def noted() -> Iterator[Any]:
        nonlocal given
        for block in blocks:
            if given is None and len(block.timestamps_s):
                given = set(block.first_cells.get("uuid", {}))
            yield block

    labels: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    for chunk in stream_columns(host, noted(), gpus):
        if labels is None:
            known = given or set()
            uuids = tuple(
                uuid if index in known else _default_uuid(host, index)
                for uuid, index in zip(chunk.uuids, chunk.indexes, strict=True)
            )
            if len(set(uuids)) != len(uuids):
                raise NotColumnar("uuid")
            labels = (uuids, tuple(f"{host}/{i}" for i in chunk.indexes))
        yield dataclasses.replace(chunk, uuids=labels[0], names=labels[1])


class HostStreams:
    """The rows of Parquet ``files`` of any hosts (a host's rows in time order across the
    files, in the order given; rows of several hosts may share a row group) read once,
    a record batch of ``batch_rows`` rows at a time, each batch's rows routed to their
    host's own framing (gpuwatchd/sampling/replay_arrow.py ``stream_columns``, as
    :func:`stream_parquet` frames one host's files). Iterating gives ``(host, chunk)``:
    the host's next chunk of frames (:class:`~gpuwatchd.sampling.columns.TraceColumns`
    named as by :func:`read_parquet`) as soon as it is framed, or ``(host, None)`` once
    where the host's rows cannot be framed a batch at a time (``NotColumnar``: then read
    it whole, :func:`read_parquet` with ``hosts``); :meth:`drop` stops framing a host.
    It holds about one batch and each host's framing state, whatever the files' length;
    ``gpus``, ``metrics`` as in :func:`stream_parquet`. Raises ReplayError for a file
    that cannot be read, and what reading a batch raises (``pyarrow.ArrowInvalid``,
    OSError, ValueError)."""

    def __init__(
        self,
        files: Sequence[str],
        gpus: int | None = None,
        metrics: Collection[str] | None = None,
        batch_rows: int = READ_BATCH_ROWS,
    ) -> None:
        self._files = files
        self._gpus = gpus
        self._metrics = metrics
        self._batch_rows = batch_rows
        self._routed: Iterator[list[tuple[str, Any]]] | None = None
        self._read_all = False
        self._queues: dict[str, deque[Any]] = {}  # a host's blocks routed, not yet framed
        self._streams: dict[str, Generator[Any, None, None]] = {}  # a host's _host_chunks
        self._dropped: set[str] = set()

    def drop(self, host: str) -> None:
        """Frame no more of ``host``'s rows (its chunks are not wanted)."""
        self._dropped.add(host)
        self._queues.pop(host, None)
        stream = self._streams.pop(host, None)
        if stream is not None:
            stream.close()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        import numpy as np
        import pyarrow.compute as pc

        self._routed = self._route(np, pc)
        while self._advance():
            for host in [h for h, queue in self._queues.items() if queue]:
                yield from self._frame(host, False)
        for host in list(self._streams):  # every file read: each host's last frames
            yield from self._frame(host, True)

    def _route(self, np: Any, pc: Any) -> Iterator[list[tuple[str, Any]]]:
        """``[(host, its rows of the batch, first cells by GPU index)]`` per record batch."""
        import dataclasses

        from gpuwatchd.sampling.replay_arrow import RowBlock

        read = _blocks(self._files, np, pc, self._metrics, True, self._batch_rows)
        for codes, block, found in read:
            routed = []
            for host, rows in _by_host(np, block, codes, RowBlock):
                firsts = {
                    column: {index: cell for (h, index), cell in cells.items() if h == host}
                    for column, cells in found.items()
                }
                routed.append((host, dataclasses.replace(rows, first_cells=firsts)))
            yield routed

    def _advance(self) -> bool:
        """Read and route the next record batch; False once every file is read."""
        if self._routed is None or self._read_all:
            return False
        try:
            routed = next(self._routed, None)
        except BaseException:
            self._read_all = True  # a broken read ends every host: never a short trace
            raise
        if routed is None:
            self._read_all = True
            return False
        for host, rows in routed:
            if host in self._dropped:
                continue
            if host not in self._queues:
                self._queues[host] = deque()
                self._streams[host] = _host_chunks(host, self._pull(host), self._gpus)
            self._queues[host].append(rows)
        return True

    def _pull(self, host: str) -> Iterator[Any]:
        """``host``'s blocks as its framing asks for them, reading on when none is routed."""
        queue = self._queues[host]
        while True:
            while queue:
                yield queue.popleft()
            if not self._advance():
                return

    def _frame(self, host: str, last: bool) -> Iterator[tuple[str, Any]]:
        """``host``'s chunks framed of the blocks routed to it (``last``: to its end)."""
        from gpuwatchd.sampling.replay_arrow import NotColumnar

        while host in self._streams and (last or self._queues[host]):
            try:
                chunk = next(self._streams[host])
            except StopIteration:
                del self._streams[host]
                return
            except NotColumnar:
                self.drop(host)
                yield host, None
                return
            yield host, chunk
