"""``gpuwatchctl`` commands, one module each (as circus does).

A command module has a docstring (its help text: first line the summary),
``add_arguments(parser)`` and ``execute(client, args, out) -> int``. A module with
``NEEDS_DAEMON = False`` runs without the control socket (``client`` is None).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

__all__ = ["COMMANDS", "Output"]

COMMANDS = ("status", "policy", "jobs", "events", "knob", "pause", "resume", "study", "job")
"""Command names, each a module of this package."""


class Output:
    """Where commands print: raw JSON with ``--json``, rich tables otherwise."""

    def __init__(self, *, json_mode: bool, stream: TextIO | None = None) -> None:
        self.json_mode = json_mode
        self.stream = stream or sys.stdout

    def json(self, value: Any) -> None:
        """Print ``value`` as indented JSON (the stable ``--json`` output)."""
        self.stream.write(json.dumps(value, indent=2, sort_keys=True) + "\n")

    def console(self) -> Any:
        """A :class:`rich.console.Console` on the output stream (imported lazily)."""
        from rich.console import Console

        # Piped output (scripts, journald, tests) would be cut to rich's 80-column default.
        width = None if self.stream.isatty() else int(os.environ.get("COLUMNS", "160"))
        return Console(file=self.stream, highlight=False, soft_wrap=False, width=width)
