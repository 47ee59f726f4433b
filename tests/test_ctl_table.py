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

from gpuwatchd.cli.commands._table import print_table, table

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


def test_a_table_wider_than_the_console_is_narrowed_and_wrapped_as_rich_does() -> None:
    # the Jobs table of 64 jobs: knobs lines of ~70 columns beside eight short columns,
    # wider than a 160-column pipe; rich narrows the widest columns and wraps their words
    rng = random.Random(11)
    sentence = ["num_workers=1", "[0..16]", "from", "policy", "host-oversubscribed,"]
    sentence += ["applied", "2s", "ago;"]
    sentence += ["prefetch_factor=2", "[1..8]", "from", "script"]
    narrowed = 0
    for _ in range(150):
        columns = [rng.choice(["job", "pid", "knobs", "data wait", "samples/s"])
                   for _ in range(rng.randint(2, 8))]  # fmt: skip
        rows = [
            [
                "\n".join(
                    " ".join(sentence[rng.randint(0, 5) : rng.randint(6, len(sentence))])
                    if rng.random() < 0.5
                    else rng.choice(WORDS[:5])
                    for _ in range(rng.randint(1, 3))
                )
                for _ in columns
            ]
            for _ in range(rng.randint(1, 6))
        ]
        width = rng.choice([60, 100, 160])
        title = rng.choice([None, "Jobs"])
        made = table(title, columns, rows, width)
        natural = [
            max([len(column)] + [len(line) for row in rows for line in row[i].split("\n")])
            for i, column in enumerate(columns)
        ]
        narrowed += isinstance(made, Text) and sum(natural) + 3 * len(columns) + 1 > width
        for terminal in (False, True):
            want = _print(_rich(title, columns, rows), width, terminal)
            assert _print(made, width, terminal) == want
    assert narrowed > 30  # the narrowing path ran, not only rich's own table


def test_print_table_on_a_pipe_writes_what_rich_writes() -> None:
    # no colours to draw (a pipe): the drawn table's text is written as it is
    rng = random.Random(5)
    for _ in range(60):
        columns = [rng.choice(["job", "pid", "knobs", "名前"]) for _ in range(rng.randint(1, 5))]
        rows = [
            ["\n".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in columns]
            for _ in range(rng.randint(0, 8))
        ]
        title = rng.choice([None, "Jobs"])
        width = rng.choice([40, 80, 160])
        out = io.StringIO()
        piped = Console(file=out, width=width, highlight=False, soft_wrap=False)
        print_table(piped, title, columns, rows)
        assert out.getvalue() == _print(_rich(title, columns, rows), width, terminal=False)
