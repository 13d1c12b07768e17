"""Numbers and columns as the tables print them."""

from __future__ import annotations

from collections.abc import Sequence


def format_number(value: float) -> str:
    """Few significant digits: the noise is larger than that anyway."""
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def format_ratio(ratio: float | None) -> str:
    """Two decimals; two significant digits below 0.1, which would else all
    read 0.0x or 0.00 (e.g. an in-process gather against a real comm)."""
    if ratio is None:
        return "-"
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}"


def align(rows: list[list[str]], label_columns: int, rules: Sequence[int] = (1,)) -> list[str]:
    """Left-align the first ``label_columns`` columns, right-align the
    numbers; a dashed rule goes before each row index in ``rules``."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if i < label_columns else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    rule = "-" * max(map(len, lines))
    for index in sorted(rules, reverse=True):
        lines.insert(index, rule)
    return lines
