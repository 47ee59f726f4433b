"""Return this node to service in Slurm (admin).

gpuwatchctl node resume   scontrol update NodeName=<this node> State=RESUME: undo a
                          drain_node (the daemon's slurm.node; docs/slurm.md)
"""

from __future__ import annotations

import argparse

from gpuwatchd.cli.commands import Output
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.protocol import Op

__all__ = ["add_arguments", "execute"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``node resume``."""
    parser.add_argument("action", choices=("resume",), help="what to do")


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Send ``node.resume`` and print what was done."""
    result = client.call(Op.NODE_RESUME)
    if out.json_mode:
        out.json(result)
    else:
        print(result["detail"])
    return 0
