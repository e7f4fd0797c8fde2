"""A Markdown table as aligned terminal text (`mmcse runs`, the CLI's tables): plain string work, so a
command that prints one loads no data-frame or plotting library."""

from __future__ import annotations

import textwrap


def terminal_table(markdown: str, width: int = 120) -> str:
    """A Markdown table (`table_markdown`) as aligned plain text no wider than ``width`` columns:
    the first column (the row names) starts every block and the other columns fill blocks left to
    right, so a wide table wraps into blocks instead of wrapping each line; the text around the
    table (title, notes) follows, wrapped at ``width``. The CSV keeps full precision."""

    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        return "\n".join(textwrap.fill(line, width) if line else line for line in lines)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[start:end]]
    header, body = cells[0], [row for row in cells[2:]]  # cells[1]: the |---| separator
    widths = [max(len(row[c]) if c < len(row) else 0 for row in [header, *body]) for c in range(len(header))]
    blocks: list[list[int]] = []
    for c in range(1, len(header)):
        used = widths[0] + sum(widths[k] + 2 for k in blocks[-1]) if blocks else width + 1
        if used + 2 + widths[c] > width:
            blocks.append([])
        blocks[-1].append(c)
    out = [textwrap.fill(line, width) if line else line for line in lines[:start]]
    for n, block in enumerate(blocks or [[]]):
        columns = [0, *block]
        if n:
            out.append("")
        for row in [header, None, *body]:
            if row is None:
                out.append("  ".join("-" * widths[c] for c in columns))
                continue
            out.append("  ".join((row[c] if c < len(row) else "").ljust(widths[c]) for c in columns).rstrip())
    out += [textwrap.fill(line, width) if line else line for line in lines[end:]]
    return "\n".join(out).rstrip() + "\n"
