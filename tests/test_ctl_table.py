"""The fast table of ``gpuwatchctl status`` prints what a rich Table of the same cells prints.

gpuwatchd/cli/commands/_table.py draws plain-cell tables line by line (rich's per-cell
layout cost most of a 64-job ``status``); here both are printed through real rich
consoles -- piped (plain text) and a colour terminal (ANSI styles) -- for seeded
random tables (several lines per cell, wide characters, empty cells, titles or none)
and must give the same characters; too wide or unprintable, it hands over to rich.
"""

from __future__ import annotations

import io
import random

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuwatchd.cli.commands._table import table

WORDS = ["a", "GPU", "num_workers=4 [0..16] from script", "80.9 MiB", "", "データ", "é", "0 %"]


def _print(renderable: object, width: int, terminal: bool) -> str:
    out = io.StringIO()
    console = Console(
        file=out,
        width=width,
        highlight=False,
        soft_wrap=False,
        force_terminal=terminal,
        color_system="standard" if terminal else None,
    )
    console.print(renderable)
    return out.getvalue()


def _rich(title: str | None, columns: list[str], rows: list[list[str]]) -> Table:
    reference = Table(title=title, title_justify="left")
    for column in columns:
        reference.add_column(column)
    for row in rows:
        reference.add_row(*[Text(cell) for cell in row])
    return reference


def test_the_fast_table_prints_what_rich_prints() -> None:
    rng = random.Random(7)
    fast_cases = 0
    for _ in range(200):
        names = ["job", "pid", "knobs", "RSS", "名前"]
        columns = [rng.choice(names) for _ in range(rng.randint(1, 6))]
        rows = [
            ["\n".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in columns]
            for _ in range(rng.randint(1, 12))
        ]
        title = rng.choice([None, "Jobs", "GPUs (replay: a.csv)"])
        width = rng.choice([40, 80, 160])
        made = table(title, columns, rows, width)
        fast_cases += isinstance(made, Text)
        for terminal in (False, True):
            want = _print(_rich(title, columns, rows), width, terminal)
            assert _print(made, width, terminal) == want
    assert fast_cases > 60  # (91 of 200 fit their width: the fast path is what ran)


def test_too_wide_or_unprintable_goes_to_rich() -> None:
    wide = table("Jobs", ["job"], [["x" * 100]], 80)
    assert isinstance(wide, Table)
    control = table("Jobs", ["job"], [["tab\there"]], 160)
    assert isinstance(control, Table)  # rich's own handling of control characters
    assert isinstance(table("A title wider than its table", ["job"], [["x"]], 160), Table)
