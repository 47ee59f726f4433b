"""``gpuwatchd check-config FILE``: check a config file and its managed jobs against the
policies (the config's, or ``--policies``).

Prints each mistake as file:line (or one JSON object with ``--json``); exit status 0 when
there is none (warnings only), 1 otherwise. docs/configuration.md, docs/cli.md.
"""

from __future__ import annotations

import argparse

from gpuwatchd.cli.daemon_commands import Subparsers

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """Add ``check-config`` and its options to ``sub`` (the ``gpuwatchd`` subparsers)."""
    check_config = sub.add_parser(
        "check-config",
        help="check a gpuwatchd config file and its jobs; exit 1 with file:line per mistake",
    )
    check_config.add_argument("path", metavar="FILE", help="the config file (gpuwatchd.yaml)")
    check_config.add_argument(
        "--policies",
        action="append",
        metavar="PATH",
        help="policy files or directories to check against the jobs (default: the config's)",
    )
    return check_config


def run(args: argparse.Namespace) -> int:
    """Check ``args.path``; 0 or 1 as the module says."""
    from gpuwatchd.config_check import run_check

    return run_check(args.path, args.policies or (), json_mode=args.json)
