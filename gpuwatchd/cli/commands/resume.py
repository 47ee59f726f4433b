"""Resume remediation after gpuwatchctl pause (admin)."""

from __future__ import annotations

from gpuwatchd.cli.commands.pause import add_arguments, execute

__all__ = ["add_arguments", "execute"]
