"""What the dashboard keeps per application (`Dashboard`: templates, sessions, history, the
open event streams) and the files it serves (templates/ and static/ beside this module)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from gpupoold import __version__
from gpupoold.dashboard.formatting import detach_text, duration, human_bytes, when
from gpupoold.dashboard.history import History
from gpupoold.dashboard.sessions import Sessions

STREAM_BACKLOG = 64  # announced changes a stream may fall behind before it loses the oldest
CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


def web_dir() -> Path:
    """The folder holding `templates/` and `static/`: this package's own (they ship in it)."""
    return Path(__file__).resolve().parent


class Dashboard:
    """What the dashboard keeps per application: templates, sessions, history, change signal."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(root / "templates")),
            autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
            lstrip_blocks=True)
        self.env.filters["bytes"] = human_bytes
        self.env.filters["when"] = when
        self.env.filters["duration"] = duration
        self.env.filters["detach_text"] = detach_text
        self.sessions = Sessions()
        self.history: History | None = None
        self.changed = asyncio.Event()  # replaced at every notify(): each stream waits on its own
        self.closing = False  # the daemon stops: event streams end
        # One queue per open event stream. A GPU state change puts the state of that moment in
        # every queue, so a stream sends each change in order even when the next one follows
        # within milliseconds (a simulated scrub takes ~20 ms): a snapshot taken when the stream
        # gets round to it would skip `scrubbing`.
        self.streams: set[asyncio.Queue[dict[str, Any]]] = set()
        # The remoting port's TLS (http/keys.py tls_view), shown on every page: the fingerprint
        # clients pin, or a warning for plain TCP. Set at start (dashboard/live.py).
        self.tls: dict[str, str | None] = {"tls": "on", "fingerprint": None, "certificate": None}
        # Why this server, meant to serve real GPUs, serves a simulated one (real mode found no
        # GPU and `fallback_to_simulated` is set); shown on every page. None: no fallback.
        self.fallback: str | None = None
        # The Fleet page's probes of the other servers' HTTP listeners (dashboard/fleet_live.py):
        # name -> (time.monotonic() of the try, accepted, why not).
        self.reach: dict[str, tuple[float, bool | None, str]] = {}

    def notify(self) -> None:
        """Something changed: wake every event stream."""
        self.changed.set()
        self.changed = asyncio.Event()

    def publish(self, payload: dict[str, Any]) -> None:
        """Queue `payload` (the state at a change) for every open stream, then wake them. A
        stream that has fallen STREAM_BACKLOG changes behind loses its oldest ones."""
        for q in self.streams:
            if q.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
            q.put_nowait(payload)
        self.notify()

    def render(self, name: str, status: int = 200, **ctx: Any) -> web.Response:
        text = self.env.get_template(name).render(version=__version__, tls=self.tls,
                                                    fallback=self.fallback, **ctx)
        return web.Response(text=text, status=status, content_type="text/html",
                            charset="utf-8", headers=SECURITY_HEADERS)


SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Frame-Options": "DENY",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
                    "Cache-Control": "no-store"}

DASHBOARD = web.AppKey("gpupool_dashboard", Dashboard)
