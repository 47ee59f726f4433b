"""``gpuwatchd check-policy``: validate policy files, and say when one is a config file."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from gpuwatchd.errors import PolicyError

__all__ = ["check_policy"]

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


def check_policy(paths: Sequence[str]) -> int:
    """``gpuwatchd check-policy PATH...``: print OK or file:line errors; exit status 0 or 1."""
    from gpuwatchd.policyfiles import load_policies

    status = 0
    for path in paths:
        try:
            policies = load_policies([path])
        except PolicyError as exc:
            print(f"error: {exc}", file=sys.stderr)
            if os.path.isfile(path) and _looks_like_config(path):
                print(
                    f"{path} looks like a gpuwatchd config file, not a policy file: "
                    f"use gpuwatchd check-config {path}",
                    file=sys.stderr,
                )
            status = 1
            continue
        names = ", ".join(p.name for p in policies.policies) or "no policies"
        print(f"{path}: OK ({len(policies.policies)} policies: {names})")
    return status
