"""Markdown tables, as every record under docs/benchmarks writes them."""

from __future__ import annotations


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A pipe table; None cells stay empty."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
