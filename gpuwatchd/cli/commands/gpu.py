"""Cordon a GPU or lift its cordon (admin).

gpuwatchctl gpu cordon N     no managed worker is placed on GPU N (kept across daemon
                             restarts); its workers move to other GPUs, trials retried
gpuwatchctl gpu uncordon N   lift the cordon (an operator's or a policy's)

N is the NVML index (as nvidia-smi and gpuwatchctl status show it). The cordoned GPUs
are listed by gpuwatchctl status.
"""

from __future__ import annotations

import argparse
from typing import Final

from gpuwatchd.cli.commands import Output
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.protocol import Op

__all__ = ["add_arguments", "execute"]


def _index(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a GPU index: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a GPU index is >= 0, not {value}")
    return value


_OPS: Final = {"cordon": Op.GPU_CORDON, "uncordon": Op.GPU_UNCORDON}
"""The op each action sends."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``gpu cordon|uncordon N``."""
    parser.add_argument("action", choices=tuple(_OPS), help="what to do")
    parser.add_argument("gpu", type=_index, help="the GPU's NVML index")


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Send ``gpu.<action>`` and print what was done."""
    result = client.call(_OPS[args.action], gpu=args.gpu)
    if out.json_mode:
        out.json(result)
    else:
        print(result["detail"])
    return 0
