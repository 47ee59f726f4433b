"""Set a knob of a live job: gpuwatchctl knob JOB KNOB VALUE [--hold DURATION] (admin).

The job applies it at its next safe point (a DataLoader knob at the next epoch) and
acknowledges; the command waits a little for that and otherwise reports it pending.
Out-of-bounds values are refused by the job with a reason (exit 1). The change holds
against policies for ``--hold`` (default 30m, at most 24h; ``0``: no hold, and the hold
in force on that knob ends): a policy's move of that knob meanwhile is refused, naming
the operator (docs/policies.md, "Operator overrides").
"""

from __future__ import annotations

import argparse
import time

from gpuwatchd.cli.commands import Output
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.protocol import Op
from gpuwatchd.errors import GpuwatchError
from gpuwatchd.policy.holds import DEFAULT_HOLD_S, MAX_HOLD_S
from gpuwatchd.units import parse_duration

__all__ = ["add_arguments", "execute", "parse_hold", "parse_value"]


def parse_hold(text: str) -> float:
    """``--hold`` value: a duration (``30m``, ``2h``, ``90`` seconds, ``0``) -> seconds,
    0..24h; else ArgumentTypeError."""
    try:
        seconds = parse_duration(text)
    except GpuwatchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 0 <= seconds <= MAX_HOLD_S:
        raise argparse.ArgumentTypeError("must be between 0 and 24h")
    return seconds


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
    """``knob JOB KNOB VALUE [--wait SECONDS] [--hold DURATION]``."""
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
    parser.add_argument(
        "--hold",
        type=parse_hold,
        default=DEFAULT_HOLD_S,
        metavar="DURATION",
        help="how long the change holds against policies, e.g. 10m, 2h "
        "(default 30m, at most 24h; 0: no hold, and any hold on this knob ends)",
    )


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Send ``knob`` and print whether the job applied it or it is pending."""
    result = client.call(
        Op.KNOB,
        job=args.job,
        knob=args.knob,
        value=args.value,
        wait_s=args.wait,
        hold_s=args.hold,
    )
    if out.json_mode:
        out.json(result)
    else:
        line = f"{result['job']}: {result['knob']}={result['value']} {result['state']}"
        until = result.get("hold_until_s")
        if isinstance(until, (int, float)):
            line += f", held against policies until {_utc(until)}"
        print(line)
    return 0


def _utc(timestamp_s: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(timestamp_s))
