"""The one Markdown table writer of the toolkit's pages, reports and benchmark printouts."""
from __future__ import annotations


def markdown_table(header: list, rows: list[list]) -> str:
    """A Markdown table: `header` (the column names) over `rows` (one list of values a row, each shown by str),
    ending in a newline."""
    lines = ["| " + " | ".join(str(x) for x in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
