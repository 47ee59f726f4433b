"""``gpuwatchd``: run the daemon, or check policy files.

gpuwatchd run [--config PATH] [--policies PATH] [--socket PATH] [--state-dir PATH]
              [--devices auto|nvml|none|replay:TRACE.csv] [--interval SECONDS] [--dry-run]
gpuwatchd check-policy PATH...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuwatchd import __version__
from gpuwatchd.config import DEFAULT_CONFIG_PATH, Settings, parse_config, parse_devices
from gpuwatchd.errors import ConfigError, GpuwatchError, PolicyError
from gpuwatchd.units import parse_duration

__all__ = ["entry", "main"]


def _devices(value: str) -> str:
    try:
        return parse_devices(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def build_parser() -> argparse.ArgumentParser:
    """The ``gpuwatchd`` argument parser (design.md, "Command line")."""
    parser = argparse.ArgumentParser(
        prog="gpuwatchd",
        description="Watch NVIDIA GPUs and the host; detect and fix GPU-hour-wasting patterns.",
    )
    parser.add_argument("--version", action="version", version=f"gpuwatchd {__version__}")
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
    run.add_argument("--admin-group", help="group allowed to run admin ops (default gpuwatch)")
    run.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    run.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: JSON lines under systemd or without a terminal, console otherwise",
    )

    check = sub.add_parser("check-policy", help="validate policy files; exit 1 on the first error")
    check.add_argument("paths", nargs="+", metavar="PATH")
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    config_path = args.config
    if config_path is None and Path(DEFAULT_CONFIG_PATH).is_file():
        config_path = DEFAULT_CONFIG_PATH
    settings = Settings()
    if config_path is not None:
        try:
            text = Path(config_path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"cannot read config file: {exc.strerror}", path=config_path
            ) from None
        settings = parse_config(text, config_path)
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
    )


def _run(args: argparse.Namespace) -> int:
    from gpuwatchd.daemon import Daemon
    from gpuwatchd.logs import configure_logging, get_logger

    settings = _settings(args)
    json_logs = {"auto": None, "json": True, "console": False}[args.log_format]
    configure_logging(json=json_logs, level=settings.log_level)
    try:
        daemon = Daemon(settings)
    except GpuwatchError as exc:
        get_logger("gpuwatchd").error("cannot start", error=str(exc))
        return 1
    return asyncio.run(daemon.run())


def _check_policy(args: argparse.Namespace) -> int:
    from gpuwatchd.policy.schema import load_policies

    status = 0
    for path in args.paths:
        try:
            policies = load_policies([path])
        except PolicyError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
            continue
        names = ", ".join(p.name for p in policies.policies) or "no policies"
        print(f"{path}: OK ({len(policies.policies)} policies: {names})")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpuwatchd`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Exit status: 0 success, 1 a runtime or validation error (printed), 2 bad usage.
    """
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        return _check_policy(args)
    except GpuwatchError as exc:
        print(f"gpuwatchd: error: {exc}", file=sys.stderr)
        return 1


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
