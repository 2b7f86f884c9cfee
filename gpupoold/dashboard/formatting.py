"""How the dashboard's pages write numbers and times (jinja2 filters, chart captions)."""

from __future__ import annotations

import time
from typing import Any


def human_bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def when(t: Any) -> str:
    if not isinstance(t, int | float):
        return "n/a"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def duration(s: Any) -> str:
    if not isinstance(s, int | float):
        return "n/a"
    s = int(s)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h {m:02d}m {sec:02d}s" if h else (f"{m}m {sec:02d}s" if m else f"{sec}s")
