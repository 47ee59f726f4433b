"""``gpuwatchd``: run the daemon, check policy files, backtest them on traces, record traces.

Each command lives in its own module under :mod:`gpuwatchd.cli.daemon_commands`; this module
assembles them. Commands and options: docs/cli.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from gpuwatchd import __version__
from gpuwatchd.cli.daemon_commands import COMMANDS
from gpuwatchd.cli.errors import (
    RaisingParser,
    UsageError,
    error_code,
    json_requested,
    report_error,
)
from gpuwatchd.errors import GpuwatchError

__all__ = ["build_parser", "entry", "main"]


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"gpuwatchd.cli.daemon_commands.{name}")


def build_parser(completion: bool = True) -> argparse.ArgumentParser:
    """The ``gpuwatchd`` argument parser: each command of
    :data:`~gpuwatchd.cli.daemon_commands.COMMANDS` adds its own subparser (docs/cli.md);
    ``completion`` adds shtab's ``--print-completion SHELL`` (left out by :func:`main` unless
    asked for)."""
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
    for name in COMMANDS:
        module = _load(name)
        command = module.add_parser(sub)
        # SUPPRESS: `gpuwatchd --json CMD` keeps working; `CMD --json` sets it too.
        command.add_argument(
            "--json",
            action="store_true",
            default=argparse.SUPPRESS,
            help="one JSON object per line (replay) or per result; errors as JSON",
        )
        command.set_defaults(command_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpuwatchd`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Exit status: 0 success, 1 a runtime or validation error (printed), 2 bad usage.
    """
    return _dispatch(sys.argv[1:] if argv is None else list(argv))[0]


def _dispatch(words: list[str]) -> tuple[int, ModuleType | None]:
    """:func:`main` of ``words``, and the module of the command it ran (None on bad usage)."""
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
        return 2, None
    module: ModuleType = args.command_module
    try:
        status: int = module.run(args)
        return status, module
    except GpuwatchError as exc:
        if args.json:
            report_error("gpuwatchd", True, error_code(exc), str(exc), exc)
        else:
            print(f"gpuwatchd: error: {exc}", file=sys.stderr)
        return 1, module


def entry() -> None:
    """Console-script entry point.

    A command whose module sets ``EXIT_WITHOUT_TEARDOWN = True`` (``replay``) ends with
    ``os._exit`` once stdout and stderr are flushed, skipping the interpreter's teardown
    (freeing numpy's and pyarrow's modules: 60-80 ms of each replay, docs/benchmarks.md);
    such a command closes its files itself and leaves nothing to ``atexit``. The module
    contract: gpuwatchd/cli/daemon_commands/__init__.py.
    """
    status, module = _dispatch(sys.argv[1:])
    if module is not None and getattr(module, "EXIT_WITHOUT_TEARDOWN", False):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BrokenPipeError:  # a closed pipe (`| head`): what was not written is lost
                status = status or 1
        os._exit(status)
    sys.exit(status)
