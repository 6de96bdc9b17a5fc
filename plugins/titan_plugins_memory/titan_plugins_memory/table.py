"""One fixed-width table printer for the plugin's reports (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence


def format_rows(rows: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """Rows of cells as aligned text: the first ``left`` columns left-justified, the rest right.

    Rows may be shorter than the header (missing cells are blank).
    """
    width = max(len(r) for r in rows)
    cells = [[*r, *[""] * (width - len(r))] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(width)]
    lines = []
    for row in cells:
        parts = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
