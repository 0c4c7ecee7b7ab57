"""Tables that fit the terminal without cutting a value: cells wrap between words, never inside one.

Rich, when a table is too wide, narrows the widest columns first and then cuts words (a recipe name, a
number) with an ellipsis. Here each column gets at least its longest word and the rest of the width
is shared in proportion to how much more each column would like. When even the longest words do not
fit side by side, the column gaps shrink to one space and the columns with the longest words give way
one character at a time (never a column in `keep_whole`), so only the rarest long words fold.
"""

from __future__ import annotations

from typing import Any, Sequence


def fit_columns(
    table: Any, rows: Sequence[Sequence[str]], headers: Sequence[str], width: int, keep_whole: Sequence[int] = ()
) -> None:
    """Set each column's width of `table` (rich Table, box=None, padding (0, 1), pad_edge=False)."""
    from rich.text import Text

    plain = [[Text.from_markup(c).plain for c in row] for row in [list(headers), *rows]]
    n = len(headers)
    longest_word = [max((len(w) for r in plain for w in r[i].split()), default=1) for i in range(n)]
    full = [
        max((max((len(line) for line in r[i].splitlines()), default=0) for r in plain), default=1) for i in range(n)
    ]
    room = width - 2 * (n - 1)  # one space of padding on each side of every inner column boundary
    if sum(full) <= room:
        return
    if sum(longest_word) > room:
        table.collapse_padding = True  # adjacent paddings become one space
        room = width - (n - 1)
        widths = list(longest_word)
        movable = [i for i in range(n) if i not in keep_whole]
        while sum(widths) > room and movable and max(widths[i] for i in movable) > 1:
            widest = max(movable, key=lambda i: widths[i])
            widths[widest] -= 1
        for column, w in zip(table.columns, widths, strict=True):
            column.width = w
        return
    widths = list(longest_word)
    spare = room - sum(widths)
    wants = [f - w for f, w in zip(full, widths, strict=True)]
    total_want = sum(wants)
    for i in range(n):
        widths[i] += spare * wants[i] // total_want if total_want else 0
    for column, w in zip(table.columns, widths, strict=True):
        column.width = w


def plain_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], width: int, title: str = "", keep_whole: Sequence[int] = ()
) -> Any:
    """A borderless table with a bold header, fitted to `width` columns."""
    from rich.table import Table

    t = Table(title=title or None, title_justify="left", box=None, padding=(0, 1), pad_edge=False)
    for h in headers:
        t.add_column(h, header_style="bold underline", overflow="fold")
    for row in rows:
        t.add_row(*row)
    fit_columns(t, rows, headers, width, keep_whole)
    return t
