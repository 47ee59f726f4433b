"""``gpuwatchd record``: record the GPUs through NVML as ``nvidia-smi --format=csv`` prints
them, until SIGINT/SIGTERM, ``--count`` or ``--duration``; ``gpuwatchd replay`` reads it back.

Writes to stdout or a new file (``--out``: never overwritten); a reader that goes away
(``| head``) ends it quietly. Exit status: 0, or 1 with the reason (no NVML, the file
exists or cannot be written). docs/backtests.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any, TextIO

from gpuwatchd.cli.daemon_commands import (
    Subparsers,
    count_arg,
    non_negative_duration_arg,
    positive_duration_arg,
)
from gpuwatchd.cli.errors import stdout_to_devnull
from gpuwatchd.errors import GpuwatchError

if TYPE_CHECKING:
    from gpuwatchd.sampling.parquet import ParquetTraceWriter

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """Add ``record`` and its options to ``sub`` (the ``gpuwatchd`` subparsers)."""
    record = sub.add_parser(
        "record",
        help="record the GPUs through NVML as nvidia-smi --format=csv (replayable)",
        description="Write timestamp, index, uuid, name, utilization.gpu, memory.used, "
        "memory.total, temperature.gpu and power.draw of every GPU, as nvidia-smi "
        "--query-gpu=... --format=csv prints them, until SIGINT/SIGTERM, --count or "
        "--duration.",
    )
    record.add_argument(
        "--interval",
        type=positive_duration_arg,
        default=1.0,
        metavar="SECONDS",
        help="time between samples, e.g. 1, 100ms, 5s (default 1s)",
    )
    record.add_argument(
        "--out",
        metavar="FILE.csv|FILE.parquet",
        help="write here (must not exist; default stdout); .parquet: row groups",
    )
    record.add_argument("--count", type=count_arg, metavar="N", help="stop after N samples")
    record.add_argument(
        "--dcgm",
        action="store_true",
        help="append DCGM-named columns: SM active/occupancy, tensor and DRAM activity "
        "(GPM ratios 0..1), ECC, remapped rows, row remap pending/failure, clock event "
        "reasons (gpuwatchd replay reads them)",
    )
    record.add_argument(
        "--duration",
        type=non_negative_duration_arg,
        metavar="D",
        help="stop after D (e.g. 10m, 1h); samples due before D are taken",
    )
    return record


def _open_out(path: str | None) -> TextIO:
    if path is None:
        return sys.stdout
    try:
        return open(path, "x", encoding="utf-8", newline="")  # closed by the caller
    except FileExistsError:
        raise GpuwatchError(
            f"{path}: already exists; record to a new file (nothing was overwritten)"
        ) from None
    except OSError as exc:
        raise GpuwatchError(f"{path}: cannot create: {exc.strerror or exc}") from None


def _open_parquet(path: str, dcgm: bool) -> ParquetTraceWriter:
    """A :class:`ParquetTraceWriter` on the new file ``path``, ``host`` this machine's
    name. Raises GpuwatchError for ``--dcgm``, an existing file, no pyarrow."""
    from gpuwatchd.sampling.parquet import ParquetTraceWriter

    if dcgm:
        raise GpuwatchError("--dcgm columns are written to CSV only; record to FILE.csv")
    _open_out(path).close()  # refuses an existing file, as for CSV
    try:
        return ParquetTraceWriter(path, socket.gethostname())
    except ImportError:
        os.unlink(path)
        raise GpuwatchError("Parquet needs pyarrow: pip install 'gpuwatchd[replay]'") from None


def run(args: argparse.Namespace) -> int:
    """Record with parsed ``args``; 0.

    Raises:
        GpuwatchError: NVML cannot be opened, or the output cannot be created or written.
    """
    from gpuwatchd.record import Recorder
    from gpuwatchd.sampling.nvml import NvmlSampler

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    # With --dcgm the expensive groups (GPM, health fields) are read on every row.
    sampler = NvmlSampler(slow_interval_s=0.0) if args.dcgm else NvmlSampler()
    out: TextIO | None = None
    parquet: ParquetTraceWriter | None = None
    try:
        sampler.open()  # NvmlUnavailable (a GpuwatchError): exit 1 with the reason
        if args.out is not None and args.out.endswith(".parquet"):
            parquet = _open_parquet(args.out, args.dcgm)
            recorder = Recorder(sampler, parquet, interval_s=args.interval)
        else:
            out = _open_out(args.out)
            recorder = Recorder(sampler, out, interval_s=args.interval, dcgm=args.dcgm)
        try:
            recorder.run(count=args.count, duration_s=args.duration, stop=stop)
        except BrokenPipeError:  # `gpuwatchd record | head`: the reader is gone
            stdout_to_devnull()
            return 0
        except OSError as exc:
            where = args.out or "stdout"
            raise GpuwatchError(f"{where}: cannot write: {exc.strerror or exc}") from None
        if args.out is not None:
            print(
                f"gpuwatchd: recorded {recorder.samples} samples ({recorder.rows} rows) "
                f"to {args.out}",
                file=sys.stderr,
            )
        return 0
    finally:
        if out is not None and out is not sys.stdout:
            out.close()
        if parquet is not None:
            parquet.close()  # the last row group and the footer
        sampler.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
