"""`gpupoold serve`: run the application until SIGTERM or SIGINT, then stop cleanly (exit 0)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from gpupoold import __version__
from gpupoold.app import StartupError, create_app
from gpupoold.keys import REMOTING
from gpupoold.sdnotify import Notifier
from gpupoold.settings import Settings, format_address, parse_address
from gpupoold.tls import TlsSettingError, http_ssl_context, remoting_ssl_context

log = logging.getLogger("gpupoold")


def announce(what: str, address: str) -> None:
    """The lines scripts and tests parse: `gpupoold: remoting on HOST:PORT` and `... http on`."""
    print(f"gpupoold: {what} on {address}", flush=True)


async def serve(settings: Settings) -> int:
    loop = asyncio.get_running_loop()
    notifier = Notifier()  # systemd Type=notify; does nothing without $NOTIFY_SOCKET
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(var, None)  # for us alone, not for the workers we start
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("gpupoold %s starting", __version__)
    try:
        ssl_context = await asyncio.to_thread(http_ssl_context, settings)
        await asyncio.to_thread(remoting_ssl_context, settings)  # checks the tls_* settings
    except TlsSettingError as exc:
        print(f"gpupoold: error: {exc}", file=sys.stderr, flush=True)
        return 1
    app = create_app(settings)
    runner = web.AppRunner(app, handle_signals=False)
    try:
        await runner.setup()
        host, port = parse_address(settings.http)
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        try:
            await site.start()
        except OSError as exc:
            raise StartupError(f"setting 'http': cannot listen on {settings.http}: "
                               f"{exc.strerror or exc}") from None
    except StartupError as exc:
        print(f"gpupoold: error: {exc}", file=sys.stderr, flush=True)
        await runner.cleanup()
        return 1
    announce("remoting", app[REMOTING].address)
    bound = runner.addresses[0]
    announce("http", format_address(bound[0], bound[1]))
    if ssl_context is not None:
        log.info("the HTTP listener speaks HTTPS (http_tls_cert)")
    notifier.ready(f"serving: remoting on {app[REMOTING].address}, "
                   f"http on {format_address(bound[0], bound[1])}")
    try:
        await stop.wait()
        log.info("stopping: no new connections; ending sessions")
        notifier.stopping("stopping: ending sessions")
        await runner.cleanup()
    finally:
        notifier.close()
    log.info("stopped")
    return 0


def run(settings: Settings) -> int:
    return asyncio.run(serve(settings))
