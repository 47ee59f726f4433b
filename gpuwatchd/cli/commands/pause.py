"""Pause remediation: detection and logging go on, no action is taken (admin)."""

from __future__ import annotations

import argparse

from gpuwatchd.cli.commands import Output
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.protocol import Op

__all__ = ["add_arguments", "execute"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``pause`` and ``resume`` take no arguments."""


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Send ``pause`` (or ``resume``: the command's name is the op) and print the new state."""
    result = client.call(Op.PAUSE if args.command == "pause" else Op.RESUME)
    if out.json_mode:
        out.json(result)
    else:
        print("remediation paused" if result["paused"] else "remediation active")
    return 0
