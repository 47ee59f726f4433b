"""``gpuwatchd run``: run the daemon in the foreground until SIGTERM (systemd ``Type=notify``).

Settings: the config file (``--config``, else /etc/gpuwatchd/gpuwatchd.yaml when it exists),
then the flags over it. A managed job's mistakes are logged at start
(``config.job_check_failed``/``config.job_check_warning``) and the daemon runs on. Exit
status: 0 after a clean stop, 1 when the daemon cannot start (``daemon.start_failed``; a bad
config file: the error, file:line). docs/configuration.md, docs/systemd.md.
"""

from __future__ import annotations

import argparse
import os

from gpuwatchd.cli.daemon_commands import (
    Subparsers,
    config_path,
    devices_arg,
    file_settings,
    positive_duration_arg,
)
from gpuwatchd.config import DEFAULT_CONFIG_PATH, Settings
from gpuwatchd.control.protocol import SOCKET_ENV
from gpuwatchd.errors import GpuwatchError

__all__ = ["add_parser", "run", "settings_of"]


def _listen(value: str) -> str:
    from gpuwatchd.metrics.sockets import parse_listen

    try:
        parse_listen(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return number


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """Add ``run`` and its options to ``sub`` (the ``gpuwatchd`` subparsers)."""
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
    run.add_argument("--devices", type=devices_arg, help="auto | nvml | none | replay:TRACE.csv")
    run.add_argument(
        "--interval",
        type=positive_duration_arg,
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
    return run


def settings_of(args: argparse.Namespace) -> Settings:
    """``gpuwatchd run``'s settings: the config file, then the flags over it.

    Raises:
        ConfigError: the config file cannot be read or is not valid (file:line).
    """
    settings = file_settings(config_path(args))
    # docs/design.md "Configuration": --socket, else $GPUWATCHD_SOCKET, else the config
    # file, else /run/gpuwatchd/control.sock.
    socket = args.socket or os.environ.get(SOCKET_ENV) or None
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


def run(args: argparse.Namespace) -> int:
    """Run the daemon with parsed ``args`` until it stops; its exit status."""
    from gpuwatchd.daemon import Daemon
    from gpuwatchd.logs import configure_logging, get_logger

    settings = settings_of(args)
    json_logs = {"auto": None, "json": True, "console": False}[args.log_format]
    if args.json and args.log_format == "auto":
        json_logs = True  # --json: the daemon's own output is JSON lines too
    configure_logging(json=json_logs, level=settings.log_level)
    path = config_path(args)
    if settings.jobs and path is not None:
        # Mistakes a managed job would only show by crashing (issue 10 item 9): said at
        # start, file:line each, the daemon runs on (check-config exits 1 on them).
        from gpuwatchd.config_check import check_config

        for mistake in check_config(path, settings.policies)[1]:
            event = "config.job_check_warning" if mistake.warning else "config.job_check_failed"
            get_logger("gpuwatchd").warning(event, mistake=str(mistake))
    try:
        daemon = Daemon(settings)
    except GpuwatchError as exc:
        get_logger("gpuwatchd").error("daemon.start_failed", error=str(exc))
        return 1
    import asyncio  # here: `gpuwatchd replay`/`check-policy` start faster without it

    return asyncio.run(daemon.run())
