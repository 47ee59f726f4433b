"""``gpuwatchctl``: the command-line client of the daemon's control socket.

Each command lives in its own module under :mod:`gpuwatchd.cli.commands`; the module's
docstring is its help text. Commands, exit statuses and permissions: docs/cli.md.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Final

from gpuwatchd import __version__
from gpuwatchd.cli.commands import COMMANDS, Output
from gpuwatchd.control.client import ControlClient, default_socket_path
from gpuwatchd.errors import ControlError

__all__ = ["EXIT_ERROR", "EXIT_UNAVAILABLE", "entry", "main"]

EXIT_ERROR = 1
EXIT_UNAVAILABLE = 3


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"gpuwatchd.cli.commands.{name}")


_GLOBAL_OPTIONS_WITH_VALUE: Final = frozenset({"--socket", "--timeout"})


def _command_of(argv: Sequence[str]) -> str | None:
    """The command named in ``argv`` (the first word that is not a global option or its
    value), or None when there is none or ``--help``/``--version`` is asked for."""
    words = iter(argv)
    for word in words:
        if word in ("-h", "--help", "--version"):
            return None
        if word in _GLOBAL_OPTIONS_WITH_VALUE:
            next(words, None)
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``gpuwatchctl`` parser; subcommands come from :data:`COMMANDS`.

    With ``only``, only that command's module is imported (the others get a bare
    subparser): ``gpuwatchctl status`` does not pay for importing every command.
    """
    parser = argparse.ArgumentParser(
        prog="gpuwatchctl", description="The command-line client of gpuwatchd's control socket."
    )
    parser.add_argument("--version", action="version", version=f"gpuwatchctl {__version__}")
    parser.add_argument(
        "--socket", help="control socket (default $GPUWATCHD_SOCKET or /run/gpuwatchd/control.sock)"
    )
    parser.add_argument("--json", action="store_true", help="print the daemon's JSON reply")
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the daemon (default 10)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        if only is not None and name != only:
            sub.add_parser(name)
            continue
        module = _load(name)
        doc = (module.__doc__ or "").strip()
        summary = doc.splitlines()[0] if doc else name
        command = sub.add_parser(
            name,
            help=summary,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpuwatchctl`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command_of(argv)).parse_args(argv)
    out = Output(json_mode=args.json)
    if not getattr(args._module, "NEEDS_DAEMON", True):
        local: int = args._module.execute(None, args, out)
        return local
    path = args.socket or default_socket_path()
    # A command that waits on the daemon (knob --wait) gets that long plus a margin.
    timeout_s = max(args.timeout, getattr(args, "wait", 0.0) + 5.0)
    try:
        with ControlClient(path, timeout_s=timeout_s) as client:
            status: int = args._module.execute(client, args, out)
            return status
    except ControlError as exc:
        print(f"gpuwatchctl: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_UNAVAILABLE if exc.code == "unavailable" else EXIT_ERROR


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
