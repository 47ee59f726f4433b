"""``gpuwatchd check-policy PATH...``: validate policy files, and say when one is a config file.

Prints ``PATH: OK (N policies: ...)`` per valid path and the file:line error per invalid one
(one JSON object per path with ``--json``); exit status 0 when all are valid, else 1.
docs/policies.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from gpuwatchd.cli.daemon_commands import Subparsers
from gpuwatchd.errors import PolicyError

__all__ = ["add_parser", "check_policy", "run"]


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """Add ``check-policy`` and its arguments to ``sub`` (the ``gpuwatchd`` subparsers)."""
    check = sub.add_parser("check-policy", help="validate policy files; exit 1 on the first error")
    check.add_argument("paths", nargs="+", metavar="PATH")
    return check


def run(args: argparse.Namespace) -> int:
    """Check ``args.paths`` as :func:`check_policy` does; 0 or 1."""
    return check_policy(args.paths, json_mode=args.json)


def _looks_like_config(path: str) -> bool:
    """Whether ``path`` is a gpuwatchd config file (top-level keys of one, no policies)."""
    from gpuwatchd.config import CONFIG_KEYS
    from gpuwatchd.errors import ConfigError
    from gpuwatchd.yamlsrc import load_located

    try:
        with open(path, encoding="utf-8") as f:
            doc = load_located(f.read(1 << 20), path)  # bounded: depth, aliases
    except (OSError, UnicodeDecodeError, ConfigError):
        return False
    return isinstance(doc, dict) and "policies" not in doc and bool(CONFIG_KEYS & set(doc))


def check_policy(paths: Sequence[str], json_mode: bool = False) -> int:
    """``gpuwatchd check-policy PATH...``: print OK or file:line errors; exit status 0 or 1.

    With ``json_mode``, one JSON object per path on stdout: ``{"path", "ok": true,
    "policies": [names]}`` or ``{"path", "ok": false, "error": {"code": "policy",
    "message", "path", "line", "hint"?}}`` (docs/cli.md)."""
    from gpuwatchd.policyfiles import load_policies

    status = 0
    for path in paths:
        try:
            policies = load_policies([path])
        except PolicyError as exc:
            hint = None
            if os.path.isfile(path) and _looks_like_config(path):
                hint = (
                    f"{path} looks like a gpuwatchd config file, not a policy file: "
                    f"use gpuwatchd check-config {path}"
                )
            if json_mode:
                error = {"code": "policy", "message": str(exc), "path": exc.path, "line": exc.line}
                if hint:
                    error["hint"] = hint
                print(json.dumps({"path": path, "ok": False, "error": error}, sort_keys=True))
            else:
                print(f"error: {exc}", file=sys.stderr)
                if hint:
                    print(hint, file=sys.stderr)
            status = 1
            continue
        names = [p.name for p in policies.policies]
        if json_mode:
            print(json.dumps({"path": path, "ok": True, "policies": names}, sort_keys=True))
        else:
            shown = ", ".join(names) or "no policies"
            print(f"{path}: OK ({len(names)} policies: {shown})")
    return status
