"""``gpuwatchd``: run the daemon, check policy files, backtest them on traces, record traces.

Commands and options: docs/cli.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from gpuwatchd import __version__
from gpuwatchd.cli.errors import (
    RaisingParser,
    UsageError,
    error_code,
    json_requested,
    report_error,
)
from gpuwatchd.config import DEFAULT_CONFIG_PATH, Settings, parse_config, parse_devices
from gpuwatchd.errors import ConfigError, GpuwatchError
from gpuwatchd.units import parse_duration

if TYPE_CHECKING:
    from gpuwatchd.sampling.parquet import ParquetTraceWriter

__all__ = ["entry", "main"]


def _devices(value: str) -> str:
    try:
        return parse_devices(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _listen(value: str) -> str:
    from gpuwatchd.metrics.serve import parse_listen

    try:
        parse_listen(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _duration(value: str) -> float:
    try:
        seconds = parse_duration(value)
    except GpuwatchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return seconds


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return number


def _non_negative_duration(value: str) -> float:
    try:
        seconds = parse_duration(value)
    except GpuwatchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return seconds


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def _count(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return number


def build_parser(completion: bool = True) -> argparse.ArgumentParser:
    """The ``gpuwatchd`` argument parser (design.md, "Command line"); ``completion`` adds
    shtab's ``--print-completion SHELL`` (left out by :func:`main` unless asked for)."""
    parser = RaisingParser(
        prog="gpuwatchd",
        description="Watch NVIDIA GPUs and the host; detect and fix GPU-hour-wasting patterns.",
    )
    if completion:
        import shtab  # ~40 ms to import: only when completion or help is asked for

        shtab.add_argument_to(parser, ["--print-completion"])  # bash, zsh, tcsh
    parser.add_argument("--version", action="version", version=f"gpuwatchd {__version__}")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print results and errors as JSON (also accepted after the command)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the daemon in the foreground (systemd Type=notify)")
    run.add_argument("--config", help=f"config file (default {DEFAULT_CONFIG_PATH} if it exists)")
    run.add_argument(
        "--policies",
        action="append",
        metavar="PATH",
        help="policy file or directory (repeatable; default /etc/gpuwatchd/policies.d "
        "or the packaged default.yaml)",
    )
    run.add_argument(
        "--socket", help="control socket (default $GPUWATCHD_SOCKET or /run/gpuwatchd/control.sock)"
    )
    run.add_argument("--state-dir", help="state directory (default /var/lib/gpuwatchd)")
    run.add_argument("--devices", type=_devices, help="auto | nvml | none | replay:TRACE.csv")
    run.add_argument(
        "--interval",
        type=_duration,
        metavar="SECONDS",
        help="tick period, e.g. 1, 0.5s, 2s (default 1s)",
    )
    run.add_argument(
        "--replay-speed",
        type=_positive_float,
        metavar="FACTOR",
        help="with --devices replay:…, play the trace FACTOR times faster than real time",
    )
    run.add_argument(
        "--dry-run", action="store_true", default=None, help="decide and log, never act"
    )
    run.add_argument(
        "--admin-group", help="group allowed to run admin ops (default gpuwatch-admin)"
    )
    run.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    run.add_argument(
        "--metrics-listen",
        type=_listen,
        metavar="HOST:PORT",
        help="serve Prometheus metrics over HTTP there, e.g. 127.0.0.1:9879 (docs/metrics.md)",
    )
    run.add_argument(
        "--metrics-textfile", metavar="PATH", help="write metrics for node_exporter's textfile"
    )
    run.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: JSON lines under systemd or without a terminal, console otherwise",
    )

    check = sub.add_parser("check-policy", help="validate policy files; exit 1 on the first error")
    check.add_argument("paths", nargs="+", metavar="PATH")

    check_config = sub.add_parser(
        "check-config",
        help="check a gpuwatchd config file and its jobs; exit 1 with file:line per mistake",
    )
    check_config.add_argument("path", metavar="FILE", help="the config file (gpuwatchd.yaml)")
    check_config.add_argument(
        "--policies",
        action="append",
        metavar="PATH",
        help="policy files or directories to check against the jobs (default: the config's)",
    )

    replay = sub.add_parser(
        "replay",
        help="backtest policies on nvidia-smi CSV traces: every finding and decision",
        description="Feed every sample of each trace through the policies as fast as "
        "possible and print each finding's start and clearing and each decision, with the "
        "trace's own timestamps, then a summary. Traces are replayed independently, in order.",
    )
    replay.add_argument("traces", nargs="+", metavar="TRACE.csv")
    replay.add_argument(
        "--policies",
        action="append",
        metavar="PATH",
        help="policy file or directory (repeatable; default the packaged default.yaml)",
    )
    replay.add_argument(
        "--gpus",
        type=_positive_int,
        metavar="N",
        help="GPUs whose rows are interleaved (when the trace has no index column and "
        "the count cannot be inferred)",
    )
    replay.add_argument(
        "--max-gap",
        type=_non_negative_duration,
        metavar="SECONDS",
        help="a longer pause between samples resets every streak (default 10s; 0: off)",
    )
    replay.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the trace: FILE.png/.svg (matplotlib) or .html (plotly), one panel "
        "per GPU with finding spans and decisions (the 'plot' extra; one trace only)",
    )

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
        type=_duration,
        default=1.0,
        metavar="SECONDS",
        help="time between samples, e.g. 1, 100ms, 5s (default 1s)",
    )
    record.add_argument(
        "--out",
        metavar="FILE.csv|FILE.parquet",
        help="write here (must not exist; default stdout); .parquet: row groups",
    )
    record.add_argument("--count", type=_count, metavar="N", help="stop after N samples")
    record.add_argument(
        "--dcgm",
        action="store_true",
        help="append DCGM-named columns: SM active/occupancy, tensor and DRAM activity "
        "(GPM ratios 0..1), ECC, remapped rows, row remap pending/failure, clock event "
        "reasons (gpuwatchd replay reads them)",
    )
    record.add_argument(
        "--duration",
        type=_non_negative_duration,
        metavar="D",
        help="stop after D (e.g. 10m, 1h); samples due before D are taken",
    )
    unit = sub.add_parser(
        "install-unit",
        help="install the systemd unit, sysusers and tmpfiles files (root; docs/systemd.md)",
        description="Write /etc/systemd/system/gpuwatchd.service with ExecStart= naming this "
        "installation's gpuwatchd, /etc/sysusers.d/gpuwatchd.conf and "
        "/etc/tmpfiles.d/gpuwatchd.conf, then run systemd-sysusers, systemd-tmpfiles --create "
        "and systemctl daemon-reload. Enable it with: systemctl enable --now gpuwatchd.",
    )
    unit.add_argument(
        "--uninstall",
        action="store_true",
        help="systemctl disable --now, remove the three files, daemon-reload "
        "(groups, state, config and drop-ins stay)",
    )
    unit.add_argument(
        "--config",
        help=f"the daemon's config (default {DEFAULT_CONFIG_PATH} if it exists): its jobs' "
        "cwd and SQLite directories become ReadWritePaths=, TCP storages IPAddressAllow= "
        "(a generated drop-in); a non-default path is passed to gpuwatchd run",
    )
    unit.add_argument(
        "--notify",
        action="append",
        default=[],
        metavar="URL",
        help="an apprise URL the notify action sends to (repeatable; also the notify URLs of "
        "the config's policies): a drop-in allows its host's addresses (docs/systemd.md)",
    )
    unit.add_argument(
        "--root",
        default="/",
        metavar="DIR",
        help="write the files under DIR (e.g. a package's staging directory) and run nothing",
    )
    for command in sub.choices.values():
        # SUPPRESS: `gpuwatchd --json CMD` keeps working; `CMD --json` sets it too.
        command.add_argument(
            "--json",
            action="store_true",
            default=argparse.SUPPRESS,
            help="one JSON object per line (replay) or per result; errors as JSON",
        )
    return parser


def _config_path(args: argparse.Namespace) -> str | None:
    if args.config is None and Path(DEFAULT_CONFIG_PATH).is_file():
        return DEFAULT_CONFIG_PATH
    return str(args.config) if args.config is not None else None


def _install_unit(args: argparse.Namespace) -> int:
    from gpuwatchd import install

    root = Path(args.root)
    activate = root.resolve() == Path("/")
    settings = None
    config_path = _config_path(args)
    if config_path is not None:
        settings = _file_settings(config_path)
        if args.config is None:
            settings = dataclasses.replace(settings, config_path=None)
    p = install.plan(root, settings=settings, notify=args.notify)
    try:
        done = install.uninstall(p, activate) if args.uninstall else install.install(p, activate)
    except OSError as exc:
        report_error("gpuwatchd", args.json, "install", str(exc))
        return 1
    if args.json:
        print(json.dumps({"done": list(done)}))
        return 0
    for line in done:
        print(line)
    if not args.uninstall and activate:
        print(f"next: systemctl enable --now {install.UNIT_NAME}")
    return 0


def _file_settings(config_path: str | None) -> Settings:
    """The settings of the config file at ``config_path`` (defaults when None).

    Raises:
        ConfigError: the file cannot be read or is not a valid config (file:line).
    """
    if config_path is None:
        return Settings()
    try:
        text = Path(config_path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", path=config_path) from None
    return parse_config(text, config_path)


def _settings(args: argparse.Namespace) -> Settings:
    """``gpuwatchd run``'s settings: the config file, then the flags over it."""
    settings = _file_settings(_config_path(args))
    # design.md: --socket, else $GPUWATCHD_SOCKET, else the config file, else /run/gpuwatchd.
    socket = args.socket or os.environ.get("GPUWATCHD_SOCKET") or None
    return settings.with_overrides(
        policies=tuple(args.policies) if args.policies else None,
        socket=socket,
        state_dir=args.state_dir,
        devices=args.devices,
        interval_s=args.interval,
        replay_speed=args.replay_speed,
        dry_run=args.dry_run,
        admin_group=args.admin_group,
        log_level=args.log_level,
        metrics_listen=args.metrics_listen,
        metrics_textfile=args.metrics_textfile,
    )


def _run(args: argparse.Namespace) -> int:
    from gpuwatchd.daemon import Daemon
    from gpuwatchd.logs import configure_logging, get_logger

    settings = _settings(args)
    json_logs = {"auto": None, "json": True, "console": False}[args.log_format]
    if args.json and args.log_format == "auto":
        json_logs = True  # --json: the daemon's own output is JSON lines too
    configure_logging(json=json_logs, level=settings.log_level)
    config_path = _config_path(args)
    if settings.jobs and config_path is not None:
        # Mistakes a managed job would only show by crashing (issue 10 item 9): said at
        # start, file:line each, the daemon runs on (check-config exits 1 on them).
        from gpuwatchd.config_check import check_config

        for mistake in check_config(config_path, settings.policies)[1]:
            event = "config.job_check_warning" if mistake.warning else "config.job_check_failed"
            get_logger("gpuwatchd").warning(event, mistake=str(mistake))
    try:
        daemon = Daemon(settings)
    except GpuwatchError as exc:
        get_logger("gpuwatchd").error("daemon.start_failed", error=str(exc))
        return 1
    import asyncio  # here: `gpuwatchd replay`/`check-policy` start faster without it

    return asyncio.run(daemon.run())


def _check_config(args: argparse.Namespace) -> int:
    from gpuwatchd.config_check import run_check

    return run_check(args.path, args.policies or (), json_mode=args.json)


# -- gpuwatchd record ---------------------------------------------------------------------


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


def _record(args: argparse.Namespace) -> int:
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
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpuwatchd`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Exit status: 0 success, 1 a runtime or validation error (printed), 2 bad usage.
    """
    words = sys.argv[1:] if argv is None else list(argv)
    wants = any(w in ("--print-completion", "-h", "--help") for w in words)
    json_mode = json_requested(words)
    try:
        args = build_parser(completion=wants).parse_args(words)
    except UsageError as exc:
        if json_mode:
            report_error("gpuwatchd", True, "usage", exc.message)
        else:
            exc.parser.print_usage(sys.stderr)
            print(f"{exc.parser.prog}: error: {exc.message}", file=sys.stderr)
        return 2
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "replay":
            from gpuwatchd.cli.replay import replay

            return replay(args)
        if args.command == "record":
            return _record(args)
        if args.command == "check-config":
            return _check_config(args)
        if args.command == "install-unit":
            return _install_unit(args)
        from gpuwatchd.cli.check_policy import check_policy

        return check_policy(args.paths, json_mode=args.json)
    except GpuwatchError as exc:
        if args.json:
            report_error("gpuwatchd", True, error_code(exc), str(exc), exc)
        else:
            print(f"gpuwatchd: error: {exc}", file=sys.stderr)
        return 1


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
