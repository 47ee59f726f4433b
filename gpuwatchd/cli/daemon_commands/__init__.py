"""``gpuwatchd`` commands, one module each (as :mod:`gpuwatchd.cli.commands` for ``gpuwatchctl``).

A command module's docstring is its contract (what it does, its exit status); it has
``add_parser(sub)``, which adds its subparser (``sub``: :class:`Subparsers`) with its help
text and options, and ``run(args) -> int``, which carries it out; one that leaves nothing
to the interpreter's teardown may set ``EXIT_WITHOUT_TEARDOWN = True`` (``replay``: the
console script then ends with ``os._exit`` once its output is flushed).
:mod:`gpuwatchd.cli.main` assembles them in the order of :data:`COMMANDS`. Here too: the
argument types and the config-file lookup more than one command uses. Commands and
options: docs/cli.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Final, Protocol

from gpuwatchd.config import DEFAULT_CONFIG_PATH, Settings, parse_config, parse_devices
from gpuwatchd.errors import ConfigError, GpuwatchError
from gpuwatchd.units import parse_duration

__all__ = [
    "COMMANDS",
    "Subparsers",
    "config_path",
    "count_arg",
    "devices_arg",
    "file_settings",
    "non_negative_duration_arg",
    "positive_duration_arg",
    "positive_int_arg",
]

COMMANDS: Final = ("run", "check_policy", "check_config", "replay", "record", "install_unit")
"""The command modules of this package, in the order ``gpuwatchd --help`` lists them."""


class Subparsers(Protocol):
    """What ``ArgumentParser.add_subparsers()`` returns, as a command module's
    ``add_parser`` uses it: argparse names that class only privately
    (``argparse._SubParsersAction``)."""

    def add_parser(self, *args: Any, **kwargs: Any) -> argparse.ArgumentParser:
        """Add the sub-command parser named ``args[0]`` (argparse's own keywords:
        ``help``, ``description``, ...) and return it."""
        ...


def devices_arg(value: str) -> str:
    """``--devices``: ``auto``, ``nvml``, ``none`` or ``replay:TRACE.csv`` (argparse type)."""
    try:
        return parse_devices(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(value: str, zero_ok: bool) -> float:
    try:
        seconds = parse_duration(value)
    except GpuwatchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds < 0 or (seconds == 0 and not zero_ok):
        raise argparse.ArgumentTypeError("must not be negative" if zero_ok else "must be positive")
    return seconds


def positive_duration_arg(value: str) -> float:
    """A duration > 0 (``1``, ``0.5s``, ``100ms``) in seconds (argparse type)."""
    return _seconds(value, zero_ok=False)


def non_negative_duration_arg(value: str) -> float:
    """A duration >= 0 (``0`` turns the option's limit off) in seconds (argparse type)."""
    return _seconds(value, zero_ok=True)


def _whole_number(value: str, minimum: int, rule: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if number < minimum:
        raise argparse.ArgumentTypeError(rule)
    return number


def positive_int_arg(value: str) -> int:
    """A whole number >= 1 (argparse type)."""
    return _whole_number(value, 1, "must be at least 1")


def count_arg(value: str) -> int:
    """A whole number >= 0 (argparse type)."""
    return _whole_number(value, 0, "must not be negative")


def config_path(args: argparse.Namespace) -> str | None:
    """``--config``, else :data:`~gpuwatchd.config.DEFAULT_CONFIG_PATH` when that file
    exists, else None (built-in defaults)."""
    if args.config is None and Path(DEFAULT_CONFIG_PATH).is_file():
        return DEFAULT_CONFIG_PATH
    return str(args.config) if args.config is not None else None


def file_settings(path: str | None) -> Settings:
    """The settings of the config file at ``path`` (defaults when None).

    Raises:
        ConfigError: the file cannot be read or is not a valid config (file:line).
    """
    if path is None:
        return Settings()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", path=path) from None
    return parse_config(text, path)
