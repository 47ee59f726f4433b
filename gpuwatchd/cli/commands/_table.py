"""Tables of plain cells drawn as rich draws them, without rich's per-cell rendering.

``gpuwatchctl status`` with 64 jobs spends most of its time in rich laying out the Jobs
table cell by cell (docs/cli.md). :func:`table` draws a table of plain-text cells
line by line in rich's default look (``box.HEAVY_HEAD``, one space of padding, left
justified, title above on the left, bold header, italic title) as one styled
:class:`rich.text.Text`; tests/test_ctl_table.py checks that it prints what a
:class:`rich.table.Table` of the same cells prints. It hands over to a
:class:`rich.table.Table` whenever the table is wider than the console (rich then
wraps cells), the title is wider than the table, or a cell holds a character that
is not printable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["print_table", "table"]


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
    from rich.cells import cell_len
    from rich.text import Text

    cells = [[cell.split("\n") for cell in row] for row in rows]
    widths = [cell_len(c) for c in columns]
    for row in cells:
        for i, lines in enumerate(row):
            for line in lines:
                if not line.isprintable():
                    return _rich_table(title, columns, rows)
                length = cell_len(line)
                if length > widths[i]:
                    widths[i] = length
    total = sum(widths) + 3 * len(widths) + 1
    if total > width or not all(c.isprintable() for c in columns):
        return _rich_table(title, columns, rows)
    if title is not None and (cell_len(title) > total or not title.isprintable()):
        return _rich_table(title, columns, rows)  # rich wraps a title wider than the table

    def rule(left: str, fill: str, cross: str, right: str) -> str:
        return left + cross.join(fill * (w + 2) for w in widths) + right

    def draw(parts: Sequence[str], bar: str) -> str:
        padded = (p + " " * (w - cell_len(p)) for p, w in zip(parts, widths, strict=True))
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
    its width. A table drawn here fits that width, so it is printed without wrapping
    (rich would otherwise split each of its lines into words again: a third of a
    ``status`` with 64 jobs); rich's own table, the hand-over, wraps its cells."""
    from rich.text import Text

    drawn = table(title, columns, rows, console.width)
    console.print(drawn, no_wrap=True if isinstance(drawn, Text) else None)
