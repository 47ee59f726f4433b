"""Set a knob of a live job: gpuwatchctl knob JOB KNOB VALUE (admin).

The job applies it at its next safe point (a DataLoader knob at the next epoch) and
acknowledges; the command waits a little for that and otherwise reports it pending.
Out-of-bounds values are refused by the job with a reason (exit 1).
"""

from __future__ import annotations

import argparse

from gpuwatchd.cli.commands import Output
from gpuwatchd.control.client import ControlClient

__all__ = ["add_arguments", "execute", "parse_value"]


def parse_value(text: str) -> int | float | bool:
    """``"4"`` -> 4, ``"0.5"`` -> 0.5, ``"true"``/``"false"`` -> bool; else ArgumentTypeError."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or boolean: {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``knob JOB KNOB VALUE [--wait SECONDS]``."""
    parser.add_argument("job")
    parser.add_argument("knob", help="e.g. num_workers, prefetch_factor, persistent_workers")
    parser.add_argument("value", type=parse_value)
    parser.add_argument(
        "--wait",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how long to wait for the job to apply it (default 2)",
    )


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Send ``knob`` and print whether the job applied it or it is pending."""
    result = client.call("knob", job=args.job, knob=args.knob, value=args.value, wait_s=args.wait)
    if out.json_mode:
        out.json(result)
    else:
        print(f"{result['job']}: {result['knob']}={result['value']} {result['state']}")
    return 0
