"""``gpuwatchctl`` commands, one module each (as circus does).

A command module has a docstring (its help text: first line the summary),
``add_arguments(parser)`` and ``execute(client, args, out) -> int``. A module with
``NEEDS_DAEMON = False`` runs without the control socket (``client`` is None).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

__all__ = ["COMMANDS", "Output", "add_table_arguments"]

COMMANDS = (
    "status",
    "top",
    "policy",
    "jobs",
    "events",
    "knob",
    "pause",
    "resume",
    "study",
    "job",
    "gpu",
    "node",
)
"""Command names, each a module of this package."""


def add_table_arguments(parser: argparse.ArgumentParser) -> None:
    """``--format table|csv`` and ``--no-legend`` for a command that prints a table (as
    ``nvidia-smi --format=csv`` and ``systemctl --no-legend``)."""
    parser.add_argument(
        "--format",
        dest="table_format",
        choices=("table", "csv"),
        default="table",
        help="table (default) or csv: comma-separated values, a header line first",
    )
    parser.add_argument(
        "--no-legend",
        action="store_true",
        help="leave out the header line and the title (for scripts, as systemctl's)",
    )


class Output:
    """Where commands print: raw JSON with ``--json``, rich tables otherwise; ``table_format``
    ``csv`` and ``legend`` False change how :meth:`table` prints."""

    def __init__(
        self,
        *,
        json_mode: bool,
        stream: TextIO | None = None,
        table_format: str = "table",
        legend: bool = True,
    ) -> None:
        self.json_mode = json_mode
        self.stream = stream or sys.stdout
        self.csv = table_format == "csv"
        self.legend = legend

    def table(
        self, columns: Sequence[str], rows: Iterable[Sequence[str]], title: str | None = None
    ) -> None:
        """Print one table: cells may hold rich markup (dropped in CSV) and newlines
        (``; `` in CSV); with ``legend`` False no header line and no title."""
        if self.csv:
            from rich.text import Text

            writer = csv.writer(self.stream, lineterminator="\n")
            if self.legend:
                writer.writerow(columns)
            for row in rows:
                writer.writerow([Text.from_markup(c).plain.replace("\n", "; ") for c in row])
            return
        rows = [list(row) for row in rows]
        console = self.console()
        plain = title is None or "[" not in title
        if plain and self.legend and not any("[" in c for row in rows for c in row):
            from gpuwatchd.cli.commands._table import print_table

            # no markup: drawn line by line, as rich draws it
            print_table(console, title, columns, rows)
            return
        from rich.table import Table

        table = Table(
            title=title if self.legend else None, title_justify="left", show_header=self.legend
        )
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        console.print(table)

    def json(self, value: Any) -> None:
        """Print ``value`` as indented JSON (the stable ``--json`` output)."""
        self.stream.write(json.dumps(value, indent=2, sort_keys=True) + "\n")

    def console(self) -> Any:
        """A :class:`rich.console.Console` on the output stream (imported lazily), without
        emoji codes: a ``:name:`` in a job's or a policy's name is printed as it is (and
        rich's table of emoji codes is not imported)."""
        from rich.console import Console

        # Piped output (scripts, journald, tests) would be cut to rich's 80-column default.
        width = None if self.stream.isatty() else int(os.environ.get("COLUMNS", "160"))
        return Console(file=self.stream, highlight=False, soft_wrap=False, width=width, emoji=False)
