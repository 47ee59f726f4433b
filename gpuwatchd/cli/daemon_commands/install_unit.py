"""``gpuwatchd install-unit [--uninstall]``: install (or remove) the systemd unit, sysusers
and tmpfiles files, as root; ``--root DIR`` writes them under DIR and runs nothing.

The unit's ``ExecStart=`` names this installation's gpuwatchd; the config's managed jobs and
notify URLs become a drop-in (``ReadWritePaths=``, ``IPAddressAllow=``). Prints each step
done (``{"done": [...]}`` with ``--json``); exit status 0, or 1 when a file cannot be
written. docs/systemd.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from gpuwatchd.cli.daemon_commands import Subparsers, config_path, file_settings
from gpuwatchd.cli.errors import report_error
from gpuwatchd.config import DEFAULT_CONFIG_PATH

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """Add ``install-unit`` and its options to ``sub`` (the ``gpuwatchd`` subparsers)."""
    unit = sub.add_parser(
        "install-unit",
        help="install the systemd unit, sysusers and tmpfiles files (root; docs/systemd.md)",
        description="Write /etc/systemd/system/gpuwatchd.service with ExecStart= naming this "
        "installation's gpuwatchd, /etc/sysusers.d/gpuwatchd.conf and "
        "/etc/tmpfiles.d/gpuwatchd.conf, then run systemd-sysusers, systemd-tmpfiles --create "
        "and systemctl daemon-reload. Enable it with: systemctl enable --now gpuwatchd.",
    )
    unit.add_argument(
        "--uninstall",
        action="store_true",
        help="systemctl disable --now, remove the three files, daemon-reload "
        "(groups, state, config and drop-ins stay)",
    )
    unit.add_argument(
        "--config",
        help=f"the daemon's config (default {DEFAULT_CONFIG_PATH} if it exists): its jobs' "
        "cwd and SQLite directories become ReadWritePaths=, TCP storages IPAddressAllow= "
        "(a generated drop-in); a non-default path is passed to gpuwatchd run",
    )
    unit.add_argument(
        "--notify",
        action="append",
        default=[],
        metavar="URL",
        help="an apprise URL the notify action sends to (repeatable; also the notify URLs of "
        "the config's policies): a drop-in allows its host's addresses (docs/systemd.md)",
    )
    unit.add_argument(
        "--root",
        default="/",
        metavar="DIR",
        help="write the files under DIR (e.g. a package's staging directory) and run nothing",
    )
    return unit


def run(args: argparse.Namespace) -> int:
    """Install or uninstall with parsed ``args``; 0, or 1 when a file cannot be written.

    Raises:
        ConfigError: the config file cannot be read or is not valid (file:line).
    """
    from gpuwatchd import install

    root = Path(args.root)
    activate = root.resolve() == Path("/")
    settings = None
    path = config_path(args)
    if path is not None:
        settings = file_settings(path)
        if args.config is None:
            settings = dataclasses.replace(settings, config_path=None)
    p = install.plan(root, settings=settings, notify=args.notify)
    try:
        done = install.uninstall(p, activate) if args.uninstall else install.install(p, activate)
    except OSError as exc:
        report_error("gpuwatchd", args.json, "install", str(exc))
        return 1
    if args.json:
        print(json.dumps({"done": list(done)}))
        return 0
    for line in done:
        print(line)
    if not args.uninstall and activate:
        print(f"next: systemctl enable --now {install.UNIT_NAME}")
    return 0
