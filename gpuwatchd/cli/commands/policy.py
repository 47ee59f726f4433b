"""Reload or show the daemon's policies.

gpuwatchctl policy reload [PATH]   load PATH (or the configured sources) atomically;
                                   a broken file is reported with file and line, exits 1,
                                   and the running policies stay in place
gpuwatchctl policy show            list the loaded policies
"""

from __future__ import annotations

import argparse
import os
import sys

from gpuwatchd.cli.commands import Output
from gpuwatchd.control.client import ControlClient
from gpuwatchd.control.protocol import Op
from gpuwatchd.errors import ControlError

__all__ = ["add_arguments", "execute"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``policy reload [PATH]`` or ``policy show``."""
    sub = parser.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    reload = sub.add_parser("reload", help="reload policies atomically (also: SIGHUP)")
    reload.add_argument("path", nargs="?", help="policy file or directory to load instead")
    sub.add_parser("show", help="list the loaded policies")


def execute(client: ControlClient, args: argparse.Namespace, out: Output) -> int:
    """Send ``policy.reload`` or ``policy.show`` and print the loaded policies."""
    if args.policy_command == "reload":
        # The daemon resolves paths against its own working directory: send absolute ones.
        params = {"path": os.path.abspath(args.path)} if args.path else {}
        try:
            result = client.call(Op.POLICY_RELOAD, **params)
        except ControlError as exc:
            if exc.code != "bad_request":
                raise
            print(
                f"gpuwatchctl: policy reload failed, the running policies stay: {exc.message}",
                file=sys.stderr,
            )
            return 1
    else:
        result = client.call(Op.POLICY_SHOW)
    if out.json_mode:
        out.json(result)
        return 0
    console = out.console()
    verb = "reloaded" if args.policy_command == "reload" else "loaded"
    console.print(f"{len(result['policies'])} policies {verb} from {', '.join(result['sources'])}")
    for policy in result["policies"]:
        dry = " (dry run)" if policy.get("dry_run") else ""
        console.print(f"  {policy['name']}{dry}: {policy.get('description') or ''}".rstrip(": "))
    return 0
