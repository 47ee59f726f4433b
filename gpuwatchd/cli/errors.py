"""Errors of the two commands, ``gpuwatchd`` and ``gpuwatchctl``, as text or as JSON.

In JSON mode (``--json`` anywhere on the command line) an error is one JSON object on
stdout, ``{"error": {"code": ..., "message": ...}}`` (plus ``path``/``line`` where a file
is at fault), with the usual exit status (docs/cli.md). A reader that goes away
(``| head``) is not an error: :func:`stdout_to_devnull`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from gpuwatchd.errors import ConfigError, GpuwatchError, PolicyError

__all__ = [
    "RaisingParser",
    "UsageError",
    "error_code",
    "json_requested",
    "report_error",
    "stdout_to_devnull",
]


class UsageError(Exception):
    """Bad usage found by the parser (exit 2); ``parser`` is the (sub)parser that found it."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class RaisingParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors raise :class:`UsageError` (so that ``main``
    can print them as JSON in JSON mode) instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


def json_requested(argv: Sequence[str]) -> bool:
    """Whether ``--json`` is among ``argv``'s options (before a ``--``)."""
    words = list(argv)
    return "--json" in (words[: words.index("--")] if "--" in words else words)


def error_code(exc: GpuwatchError) -> str:
    """The error code of a gpuwatchd error: ``policy``, ``config``, or the error's own
    ``code`` (control-protocol codes), else ``error``."""
    if isinstance(exc, PolicyError):
        return "policy"
    if isinstance(exc, ConfigError):
        return "config"
    code = getattr(exc, "code", None)
    return code if isinstance(code, str) else "error"


def report_error(
    prog: str, json_mode: bool, code: str, message: str, exc: BaseException | None = None
) -> None:
    """Print an error: the JSON object on stdout in JSON mode (one stream for scripts, as
    with a reply; ``path``/``line`` from a :class:`ConfigError` ``exc``), else
    ``PROG: CODE: MESSAGE`` on stderr."""
    if json_mode:
        error: dict[str, object] = {"code": code, "message": message}
        if isinstance(exc, ConfigError) and exc.path is not None:
            error["path"], error["line"] = exc.path, exc.line
        print(json.dumps({"error": error}, sort_keys=True))
    else:
        print(f"{prog}: {code}: {message}", file=sys.stderr)


def stdout_to_devnull() -> None:
    """Point file descriptor 1 at /dev/null, once a write to stdout raised BrokenPipeError
    (``gpuwatchd record | head``, ``gpuwatchctl events --follow | head``): what is still
    buffered and the interpreter's last flush then go nowhere instead of failing again.
    Does nothing where stdout is not a file (a caller's capture, in-process)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
