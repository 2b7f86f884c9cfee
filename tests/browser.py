"""A small headless-Chromium harness over the DevTools protocol (for tests/test_dashboard_browser.py).

Starts Debian's `chromium` (no Playwright, nothing downloaded), reads the DevTools websocket
address from its stderr and talks to it with aiohttp's websocket client, in flat-session mode:
one websocket, each page a target attached with its own session id. The API is synchronous (the
asyncio loop runs in a thread of its own), so a test can mix it with blocking subprocess work.

    with Chromium.start(workdir) as browser:
        page = browser.new_page()                 # own browser context: own cookies
        page.goto("http://.../ui/")
        page.type_into("input[name=token]", secret)
        page.click("button[type=submit]")
        page.evaluate("document.title")
        page.screenshot(path)
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")
START_TIMEOUT = 30.0
CALL_TIMEOUT = 30.0
CANDIDATES = ("chromium", "chromium-browser")


class BrowserError(Exception):
    """The browser refused a command, a script threw, or something did not happen in time."""


def find_chromium() -> str | None:
    """$GPUPOOL_CHROMIUM, else Debian's `chromium` on PATH."""
    env = os.environ.get("GPUPOOL_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    """A headless Chromium process and one DevTools websocket to it."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, ws_url: str) -> None:
        self.proc = proc
        self.log_path = log_path
        self.ws_url = ws_url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cdp", daemon=True)
        self._thread.start()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self.console: list[str] = []  # console messages and uncaught page errors, all pages
        self.run(self._connect())

    # ------------------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, workdir: Path, binary: str | None = None) -> Chromium:
        binary = binary or find_chromium()
        if not binary:
            raise BrowserError("chromium not found: install Debian's chromium package "
                               "(`sudo apt-get install --no-install-recommends chromium`) or set "
                               "GPUPOOL_CHROMIUM to a Chromium binary")
        workdir.mkdir(parents=True, exist_ok=True)
        profile = workdir / "chromium-profile"
        log_path = workdir / "chromium.log"
        log = log_path.open("wb")
        cmd = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--no-default-browser-check", "--disable-dev-shm-usage",
               "--disable-background-networking", "--remote-debugging-port=0",
               f"--user-data-dir={profile}", "about:blank"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        rx = re.compile(r"DevTools listening on (ws://\S+)")
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            m = rx.search(log_path.read_text(errors="replace"))
            if m:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with {proc.returncode}" if proc.poll() is not None
                       else f"did not announce its DevTools address within {START_TIMEOUT} s")
                _kill_group(proc)
                raise BrowserError(f"{binary} {why}:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.05)
        try:
            return cls(proc, log_path, m.group(1))
        except BaseException:
            _kill_group(proc)
            raise

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Browser.close, then make sure the process group is gone; stops the loop thread."""
        if self._loop.is_closed():
            return
        try:
            self.run(self._send("Browser.close", timeout=5))
        except Exception:  # noqa: BLE001 - closing anyway: the process is killed below
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        _kill_group(self.proc)
        try:
            self.run(self._disconnect())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = CALL_TIMEOUT + 5) -> T:
        """Run a coroutine on the harness loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # --------------------------------------------------------------------------- the protocol
    async def _connect(self) -> None:
        self._session = aiohttp.ClientSession()
        self._ws = await self._session.ws_connect(self.ws_url, max_msg_size=0)
        self._reader = asyncio.create_task(self._read())

    async def _disconnect(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for msg in self._ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(msg.data)
                if "id" in data:
                    fut = self._pending.pop(data["id"], None)
                    if fut is not None and not fut.done():
                        fut.set_result(data)
                else:
                    self._event(data)
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(BrowserError("the DevTools connection closed "
                                                   "(did chromium crash? see chromium.log)"))
            self._pending.clear()

    def _event(self, data: dict[str, Any]) -> None:
        method, params = data.get("method"), data.get("params", {})
        if method == "Runtime.consoleAPICalled":
            args = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            self.console.append(f"console.{params['type']}: {args}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            exc = details.get("exception", {}).get("description") or details.get("text")
            self.console.append(f"uncaught: {exc}")

    async def _send(self, method: str, params: dict[str, Any] | None = None,
                    session: str | None = None, timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        assert self._ws is not None
        msg_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._pending[msg_id] = fut
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        await self._ws.send_str(json.dumps(msg))
        try:
            reply = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            self._pending.pop(msg_id, None)
            raise BrowserError(f"{method}: no answer from chromium within {timeout} s") from None
        if "error" in reply:
            raise BrowserError(f"{method} failed: {reply['error']}")
        return reply.get("result", {})

    def send(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        return self.run(self._send(method, params, session, timeout), timeout + 5)

    def new_page(self, width: int = 1280, height: int = 900) -> Page:
        """A fresh tab in a fresh browser context (no cookies shared with other pages)."""
        context = self.send("Target.createBrowserContext", {"disposeOnDetach": True})
        target = self.send("Target.createTarget", {"url": "about:blank",
                                                   "browserContextId": context["browserContextId"]})
        session = self.send("Target.attachToTarget", {"targetId": target["targetId"],
                                                      "flatten": True})["sessionId"]
        page = Page(self, session)
        page.send("Page.enable")
        page.send("Runtime.enable")
        page.viewport(width, height)
        return page


class Page:
    """One attached tab."""

    def __init__(self, browser: Chromium, session: str) -> None:
        self.browser = browser
        self.session = session

    def send(self, method: str, params: dict[str, Any] | None = None,
             timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        return self.browser.send(method, params, self.session, timeout)

    def viewport(self, width: int, height: int, scale: float = 1, mobile: bool = False) -> None:
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": scale,
                   "mobile": mobile})

    def evaluate(self, expression: str, timeout: float = CALL_TIMEOUT) -> Any:
        """The value of a JavaScript expression (promises awaited); a throw raises BrowserError."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, timeout)
        if "exceptionDetails" in result:
            d = result["exceptionDetails"]
            why = d.get("exception", {}).get("description") or d.get("text")
            raise BrowserError(f"script threw: {why}\n  in: {expression}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 10, interval: float = 0.02,
                 what: str | None = None) -> Any:
        """Poll a JavaScript expression until it is truthy; returns its value. (Make it a
        boolean or a plain value: a DOM node comes back as {}, which Python reads as false.)"""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except BrowserError:
                value = None  # mid-navigation: the context went away; try again
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out after {timeout} s waiting for "
                                   f"{what or expression} (page: {self.url()})")
            time.sleep(interval)

    def url(self) -> str:
        try:
            return str(self.evaluate("location.href"))
        except BrowserError as exc:
            return f"<unknown: {exc}>"

    def goto(self, url: str, timeout: float = 15) -> None:
        """Navigate and wait until the new document has loaded."""
        reply = self.send("Page.navigate", {"url": url})
        if reply.get("errorText"):
            raise BrowserError(f"navigation to {url} failed: {reply['errorText']}")
        self.wait_loaded(timeout)

    def wait_loaded(self, timeout: float = 15) -> None:
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'",
                      timeout, what="the page to load")

    def type_into(self, selector: str, text: str) -> None:
        """Focus an input and type into it as a user would (Input.insertText)."""
        self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
                      f" if (!e) throw new Error('no element ' + {json.dumps(selector)});"
                      " e.focus(); e.value = ''; return true; })()")
        self.send("Input.insertText", {"text": text})

    def click(self, selector: str) -> None:
        """A real mouse click in the middle of the element (scrolled into view first)."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            f" if (!e) throw new Error('no element ' + {json.dumps(selector)});"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2, r.width, r.height]; })()")
        x, y, w, h = box
        if w <= 0 or h <= 0:
            raise BrowserError(f"{selector} is not visible (size {w}x{h})")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y,
                                                   "button": "left", "clickCount": 1})

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """Save a PNG of the page (the whole document when full_page)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.send("Page.getLayoutMetrics")["cssContentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"],
                              "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.send("Page.captureScreenshot", params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def html(self) -> str:
        return str(self.evaluate("document.documentElement.outerHTML"))


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
