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


def detach_text(d: Any) -> str:
    """A lease's idle-detach state in words (pool/detach.detach_view); dashboard.js detachText
    writes the same for live updates."""
    if not isinstance(d, dict):
        return ""
    text = str(d.get("state", ""))
    if d.get("state") in ("detached", "attaching"):
        text += (f" (left GPU {d.get('left_gpu')}, {human_bytes(d.get('saved_bytes'))} saved, "
                 f"{duration(d.get('detached_s'))} detached in all)")
    elif d.get("detaches"):
        text += f" ({d.get('detaches')}x detached, {duration(d.get('detached_s'))} in all)"
    if d.get("keep_gpu"):
        text += f"; keeps its GPU: {d.get('keep_gpu')}"
    return text
