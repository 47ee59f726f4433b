"""``gpuwatchctl``: the command-line client of the daemon's control socket.

Each command lives in its own module under :mod:`gpuwatchd.cli.commands`; the module's
docstring is its help text. Commands, exit statuses and permissions: docs/cli.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Final

from gpuwatchd import __version__
from gpuwatchd.cli.commands import COMMANDS, Output
from gpuwatchd.cli.errors import RaisingParser, UsageError, json_requested
from gpuwatchd.cli.errors import report_error as _report_error
from gpuwatchd.control.client import ControlClient, default_socket_path
from gpuwatchd.errors import ControlError

__all__ = ["EXIT_ERROR", "EXIT_UNAVAILABLE", "EXIT_USAGE", "UsageError", "entry", "main"]

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3


def report_error(json_mode: bool, code: str, message: str) -> None:
    """Print an error as :func:`gpuwatchd.cli.errors.report_error` does, for gpuwatchctl."""
    _report_error("gpuwatchctl", json_mode, code, message)


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"gpuwatchd.cli.commands.{name}")


_GLOBAL_OPTIONS_WITH_VALUE: Final = frozenset({"--socket", "--timeout", "--print-completion"})


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


def _wants_completion(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for ``--print-completion`` or for help (which lists it)."""
    return any(w in ("--print-completion", "-h", "--help") for w in argv)


class _Parser(RaisingParser):
    """gpuwatchctl's parsers (sub-commands' too: argparse makes them of the parent's
    class): each keeps what its ``add_subparsers()`` returned, as argparse gives no public
    way to read a built parser's sub-commands back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.subparsers: list[argparse.Action] = []
        """The actions ``add_subparsers()`` returned (argparse allows one); their
        ``choices`` map each sub-command's name to its parser."""

    def add_subparsers(self, **kwargs: Any) -> Any:
        """``ArgumentParser.add_subparsers``, the action kept in :attr:`subparsers`."""
        action = super().add_subparsers(**kwargs)
        self.subparsers.append(action)
        return action


def _add_json(parser: _Parser) -> None:
    """``--json`` after the command too (and after a sub-command such as ``policy show``)."""
    # ArgumentError: the command has its own --json (events, study)
    with contextlib.suppress(argparse.ArgumentError):
        # SUPPRESS: `gpuwatchctl --json CMD` keeps working; `CMD --json` sets it too.
        parser.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON"
        )
    for action in parser.subparsers:
        for nested in dict(action.choices or {}).values():
            _add_json(nested)


def build_parser(only: str | None = None, completion: bool = True) -> argparse.ArgumentParser:
    """The ``gpuwatchctl`` parser; subcommands come from :data:`COMMANDS`.

    ``completion`` adds shtab's ``--print-completion SHELL`` (:func:`main` leaves it out
    unless the command line asks for it or for help: importing shtab costs ~40 ms).

    With ``only``, only that command's module is imported (the others get a bare
    subparser): ``gpuwatchctl status`` does not pay for importing every command.
    """
    parser = _Parser(
        prog="gpuwatchctl", description="The command-line client of gpuwatchd's control socket."
    )
    if completion:
        import shtab  # ~40 ms to import: only when completion or help is asked for

        shtab.add_argument_to(parser, ["--print-completion"])  # bash, zsh, tcsh
    parser.add_argument("--version", action="version", version=f"gpuwatchctl {__version__}")
    parser.add_argument(
        "--socket", help="control socket (default $GPUWATCHD_SOCKET or /run/gpuwatchd/control.sock)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON (also accepted after the command)"
    )
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
            # no -h of its own: argparse looks up a translation of its help on disk
            # (gettext, several stat calls) for every parser that has one
            sub.add_parser(name, add_help=False)
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
        _add_json(command)
        command.set_defaults(command_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpuwatchctl`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    json_mode = json_requested(argv)
    try:
        args = build_parser(_command_of(argv), _wants_completion(argv)).parse_args(argv)
    except UsageError as exc:
        if json_mode:
            report_error(True, "usage", exc.message)
        else:
            exc.parser.print_usage(sys.stderr)
            print(f"{exc.parser.prog}: error: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    return _execute(args)


def _execute(args: Any) -> int:
    out = Output(
        json_mode=args.json,
        table_format=getattr(args, "table_format", "table"),
        legend=not getattr(args, "no_legend", False),
    )
    if not getattr(args.command_module, "NEEDS_DAEMON", True):
        local: int = args.command_module.execute(None, args, out)
        return local
    path = args.socket or default_socket_path()
    # A command that waits on the daemon (knob --wait) gets that long plus a margin.
    timeout_s = max(args.timeout, getattr(args, "wait", 0.0) + 5.0)
    try:
        with ControlClient(path, timeout_s=timeout_s) as client:
            status: int = args.command_module.execute(client, args, out)
            return status
    except ControlError as exc:
        report_error(out.json_mode, exc.code, exc.message)
        return EXIT_UNAVAILABLE if exc.code == "unavailable" else EXIT_ERROR


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
