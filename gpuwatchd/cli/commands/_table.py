"""Tables of plain cells drawn as rich draws them, without rich's per-cell rendering.

``gpuwatchctl status`` with 64 jobs spends most of its time in rich laying out the Jobs
table cell by cell (docs/cli.md). :func:`table` draws a table of plain-text cells
line by line in rich's default look (``box.HEAVY_HEAD``, one space of padding, left
justified, title above on the left, bold header, italic title) as one styled
:class:`rich.text.Text`; tests/test_ctl_table.py checks that it prints what a
:class:`rich.table.Table` of the same cells prints. A table wider than the console
has its widest columns narrowed and their cells wrapped at word boundaries as rich
does it (``Table._collapse_widths``, ``rich._wrap.divide_line``: ``status`` with 64
jobs, whose knobs cells are wider than 160 columns, spent 3/4 of its time in rich's
layout). It hands over to a :class:`rich.table.Table` when narrowing is not enough, a
word is wider than its column (rich folds it), a narrowed cell or header is not ASCII,
the title is wider than the table, or a cell holds a character that is not printable.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["print_table", "table"]

_WORD = re.compile(r"\s*\S+\s*")
"""A word and the spaces around it, as rich's word wrap (``rich._wrap.re_word``) sees it."""


def _collapse_widths(widths: list[int], max_width: int) -> list[int]:
    """``widths`` (with padding) narrowed toward ``max_width`` as rich's
    ``Table._collapse_widths`` narrows columns that may all wrap: the widest down to the
    next widest, in turn, sharing the excess as ``rich._ratio.ratio_reduce`` does."""
    excess = sum(widths) - max_width
    while excess > 0:
        widest = max(widths)
        second = max((w for w in widths if w != widest), default=0)
        if widest == second:
            break
        ratios = [1 if w == widest else 0 for w in widths]
        cap = min(excess, widest - second)
        remaining, total_ratio = excess, sum(ratios)
        out = []
        for ratio, value in zip(ratios, widths, strict=True):
            if ratio and total_ratio > 0:
                cut = min(cap, round(ratio * remaining / total_ratio))
                out.append(value - cut)
                remaining -= cut
                total_ratio -= ratio
            else:
                out.append(value)
        widths = out
        excess = sum(widths) - max_width
    return widths


def _wrap(line: str, width: int) -> list[str] | None:
    """``line`` (ASCII) wrapped at word boundaries into lines of at most ``width``
    characters, as rich wraps a cell's text (``rich._wrap.divide_line``, trailing
    spaces dropped); None when a word is wider than ``width`` (rich folds it)."""
    if len(line) <= width:  # every word fits where it is: no break
        return [line.rstrip()]
    breaks = []
    offset = 0
    for match in _WORD.finditer(line):
        start, word = match.start(), match.group()
        length = len(word.rstrip())
        if width - offset >= length:
            offset += len(word)
        elif length > width:
            return None
        elif offset and start:
            breaks.append(start)
            offset = len(word)
    bounds = [0, *breaks, len(line)]
    return [line[a:b].rstrip() for a, b in itertools.pairwise(bounds)]


def _rich_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> Any:
    from rich.table import Table
    from rich.text import Text

    out = Table(title=title, title_justify="left")
    for column in columns:
        out.add_column(column)
    for row in rows:
        out.add_row(*[Text(cell) for cell in row])
    return out


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int,
) -> Any:
    """A renderable of ``rows`` (plain text: no markup, ``\\n`` for several lines) under
    ``columns``, at most ``width`` console columns wide; ``title`` above it (plain
    text too). A :class:`rich.text.Text` where it draws the table itself, else a
    :class:`rich.table.Table` of :class:`rich.text.Text` cells."""
    from rich.cells import cell_len as rich_cell_len
    from rich.text import Text

    def cell_len(text: str) -> int:  # printable ASCII (checked below): a cell a character
        return len(text) if text.isascii() else rich_cell_len(text)

    cells = [[cell.split("\n") for cell in row] for row in rows]
    widths = [cell_len(c) for c in columns]
    for row in cells:
        for i, lines in enumerate(row):
            for line in lines:
                if not line.isprintable():
                    return _rich_table(title, columns, rows)
                length = len(line) if line.isascii() else rich_cell_len(line)
                if length > widths[i]:
                    widths[i] = length
    total = sum(widths) + 3 * len(widths) + 1
    if not all(c.isprintable() for c in columns):
        return _rich_table(title, columns, rows)
    if total > width:  # narrow the widest columns and wrap their cells, as rich does
        room = width - len(widths) - 1  # rich measures each column within it first
        narrowed = [w - 2 for w in _collapse_widths([min(w + 2, room) for w in widths], room)]
        if sum(narrowed) + 3 * len(widths) + 1 > width or min(narrowed) < 1:
            return _rich_table(title, columns, rows)
        for i, (was, now) in enumerate(zip(widths, narrowed, strict=True)):
            if now == was:
                continue
            if len(columns[i]) > now or not columns[i].isascii():
                return _rich_table(title, columns, rows)  # rich wraps the header too
            for row in cells:
                wrapped = []
                for line in row[i]:
                    parts = _wrap(line, now) if line.isascii() else None
                    if parts is None:
                        return _rich_table(title, columns, rows)
                    wrapped.extend(parts)
                row[i] = wrapped
        widths = narrowed
        total = sum(widths) + 3 * len(widths) + 1
    if title is not None and (cell_len(title) > total or not title.isprintable()):
        return _rich_table(title, columns, rows)  # rich wraps a title wider than the table

    def rule(left: str, fill: str, cross: str, right: str) -> str:
        return left + cross.join(fill * (w + 2) for w in widths) + right

    def draw(parts: Sequence[str], bar: str) -> str:
        padded = (
            p.ljust(w) if p.isascii() else p + " " * (w - rich_cell_len(p))
            for p, w in zip(parts, widths, strict=True)
        )
        return bar + " " + f" {bar} ".join(padded) + " " + bar

    text = Text(end="\n")
    if title is not None:
        text.append(title + " " * max(0, total - cell_len(title)), style="table.title")
        text.append("\n")
    text.append(rule("┏", "━", "┳", "┓") + "\n")
    text.append("┃")
    for i, column in enumerate(columns):  # rich styles the padding and the cell apart
        text.append(" ", style="table.header")
        text.append(column + " " * (widths[i] - cell_len(column)), style="table.header")
        text.append(" ", style="table.header")
        text.append("┃")
    text.append("\n" + rule("┡", "━", "╇", "┩") + "\n")
    body = []
    for row in cells:
        height = max(len(lines) for lines in row)
        for k in range(height):
            body.append(draw([lines[k] if k < len(lines) else "" for lines in row], "│"))
    if body:
        text.append("\n".join(body) + "\n")
    text.append(rule("└", "─", "┴", "┘"))
    return text


def print_table(
    console: Any, title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]]
) -> None:
    """Print :func:`table` of ``rows`` on ``console`` (a :class:`rich.console.Console`) at
    its width. A table drawn here fits that width, so it is printed as the segments of
    its text (``Text.render``: no wrapping, where printing the text itself made rich
    split it into a text per line and wrap each, half of the table's time on a
    terminal with 64 jobs); rich's own table, the hand-over, wraps its cells. Without
    colours (a pipe, a file) the table's text is written as it is."""
    from rich.segment import Segments
    from rich.text import Text

    drawn = table(title, columns, rows, console.width)
    if not isinstance(drawn, Text):
        console.print(drawn)
    elif console.color_system is None and not console.record:
        console.file.write(drawn.plain + "\n")  # no styles to draw: what rich would write
    else:
        console.print(Segments(drawn.render(console, end="\n")))
