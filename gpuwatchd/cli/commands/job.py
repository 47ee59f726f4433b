"""Start, stop or restart a managed job's workers (admin).

gpuwatchctl job stop JOB      stop every worker; they stay stopped (daemon restarts too)
gpuwatchctl job start JOB     start the slots that run nothing (finished, stopped, failed)
gpuwatchctl job restart JOB   stop, then start
"""

from __future__ import annotations

import argparse
from typing import Final

from gpuwatchd.cli.commands import Output
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.protocol import Op

__all__ = ["add_arguments", "execute"]


_OPS: Final = {"start": Op.JOB_START, "stop": Op.JOB_STOP, "restart": Op.JOB_RESTART}
"""The op each action sends."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``job start|stop|restart JOB``."""
    parser.add_argument("action", choices=tuple(_OPS), help="what to do")
    parser.add_argument("job", help="the managed job's name (as in the config's jobs:)")


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Send ``job.<action>`` and print how many workers were stopped and started."""
    result = client.call(_OPS[args.action], job=args.job)
    if out.json_mode:
        out.json(result)
    else:
        print(f"job {result['job']}: {result['stopped']} stopped, {result['started']} started")
    return 0
