"""Text formatting shared by the commands: sizes, durations, tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MIB = 1 << 20
GIB = 1 << 30


def gib(n: Any) -> str:
    """Bytes as "12.3 GiB" (or MiB below 1 GiB); "?" when unknown."""
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "?"
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    return f"{n / MIB:.0f} MiB"


def mib(n: Any) -> str:
    """Bytes as nvidia-smi writes them: "81920MiB"; "N/A" when unknown."""
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "N/A"
    return f"{int(n) // MIB}MiB"


def duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
        return "?"
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def number(value: Any, unit: str, digits: int = 0) -> str:
    """"42 %", "65C", "N/A" for null."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "N/A"
    return f"{value:.{digits}f}{unit}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = (),
          indent: str = "") -> str:
    """A plain table: a header line, then one line per row; columns `right` right-aligned."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w)
               for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(out)).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def boxed(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = (),
          title: str = "", empty: str = "") -> str:
    """An nvidia-smi-like box: +---+ borders, | separators, === under the header; `empty` is
    the line shown across the box when there are no rows."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    inner = sum(widths) + 3 * (len(widths) - 1) + 2
    if title and len(title) + 2 > inner:
        widths[-1] += len(title) + 2 - inner
        inner = len(title) + 2

    def sep(ch: str, cross: str) -> str:
        return "+" + cross.join(ch * (w + 2) for w in widths) + "+"

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w)
               for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(out) + " |"

    lines = []
    if title:
        lines += ["+" + "-" * inner + "+", "| " + title.ljust(inner - 2) + " |"]
    lines += [sep("-", "+"), line(headers), sep("=", "+")]
    lines += [line(r) for r in rows]
    if not rows and empty:
        lines += ["| " + empty.ljust(inner - 2) + " |", "+" + "-" * inner + "+"]
    else:
        lines.append(sep("-", "+"))
    return "\n".join(lines)
