"""`gpupoold serve`: run the application until SIGTERM or SIGINT, then stop cleanly (exit 0).
A start-up that cannot work as configured (a TLS file, the sockets systemd passed, a database
link without verified TLS) exits 78 (EX_CONFIG); one that might work on another try (a port in use) exits 1."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal

from aiohttp import web

from gpupoold import __version__, sdlisten
from gpupoold.app import StartupError, create_app
from gpupoold.config.file import EX_CONFIG
from gpupoold.config.identity import advertised_http
from gpupoold.config.settings import Settings, format_address, parse_address
from gpupoold.fdlimit import raise_open_files_limit
from gpupoold.http.keys import COUNTERS, MEMBERSHIP, REMOTING, REMOTING_TLS
from gpupoold.http.limits import RUNNER_LIMITS, cap_connections
from gpupoold.http.listener_tls import check_http_advertise, http_tls, listener_host
from gpupoold.log import print_error
from gpupoold.sdnotify import Notifier
from gpupoold.store.postgres import link_problem, redacted
from gpupoold.tls import (
    PLAIN_TCP_WARNING,
    TlsSettingError,
    remoting_identity,
    remoting_ssl_context,
)

log = logging.getLogger("gpupoold")


def announce(what: str, address: str) -> None:
    """The lines scripts and tests parse: `gpupoold: remoting on HOST:PORT` and `... http on`."""
    print(f"gpupoold: {what} on {address}", flush=True)


def _from(source: str) -> str:
    """' (socket from systemd)' for the STATUS= line when a listener's socket was passed."""
    return " (socket from systemd)" if source else ""


async def serve(settings: Settings) -> int:
    loop = asyncio.get_running_loop()
    notifier = Notifier()  # systemd Type=notify; does nothing without $NOTIFY_SOCKET
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(var, None)  # for us alone, not for the workers we start
    try:
        # Socket activation: listening sockets systemd passed (removes LISTEN_* from the
        # environment too); empty without it.
        passed = sdlisten.take()
    except sdlisten.SdListenError as exc:
        print_error(f"gpupoold: error: {exc}")
        notifier.close()
        return EX_CONFIG
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("gpupoold %s starting", __version__)
    raise_open_files_limit()  # before any listener: each connection is a descriptor
    if settings.database:
        problem = link_problem(settings.database, settings.database_insecure)
        if problem is not None:
            print_error(f"gpupoold: error: {problem}")
            notifier.close()
            return EX_CONFIG
        if link_problem(settings.database, False) is not None:
            log.warning("database_insecure = true: the link to the PostgreSQL of %s is not "
                        "verified (no sslmode=verify-full): anyone on it can read or change "
                        "tokens and lease records", redacted(settings.database))
    try:
        # HTTPS off loopback by default, with this server's identity (http/listener_tls.py).
        http_host = listener_host(settings, passed.get(sdlisten.HTTP))
        https = await asyncio.to_thread(http_tls, settings, http_host)
        ssl_context = https.context
        # The remoting port's identity: made here at the first start (tls_identity.py).
        identity = await asyncio.to_thread(remoting_identity, settings)
        # checks the tls_* files
        await asyncio.to_thread(remoting_ssl_context, settings, identity)
    except TlsSettingError as exc:
        print_error(f"gpupoold: error: {exc}")
        notifier.close()
        return EX_CONFIG
    if identity is None:
        log.warning("%s", PLAIN_TCP_WARNING)
    elif identity.created:
        log.warning("made a new identity for this server in %s: clients pin its fingerprint "
                    "(`gpupool login`, `gpupoold fingerprint`)", identity.cert.parent)
    unreachable = check_http_advertise(settings, http_host)
    if unreachable is not None:
        print_error(f"gpupoold: error: {unreachable}")
        notifier.close()
        return EX_CONFIG
    if https.warning:
        log.warning("%s", https.warning)
    app = create_app(settings)
    if identity is not None:
        app[REMOTING_TLS] = identity
    app[sdlisten.SOCKETS] = passed
    http_sock = passed.get(sdlisten.HTTP)
    http_source = sdlisten.describe(sdlisten.HTTP, http_sock) if http_sock is not None else ""
    # Bounded request heads and idle time (http/limits.py); the connection cap after setup.
    runner = web.AppRunner(app, handle_signals=False, **RUNNER_LIMITS)
    try:
        await runner.setup()
        assert runner.server is not None
        cap_connections(runner.server, settings.http_max_connections, app[COUNTERS])
        site: web.BaseSite
        if http_sock is not None:
            site = web.SockSite(runner, http_sock, ssl_context=ssl_context)
        else:
            host, port = parse_address(settings.http)
            site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        try:
            await site.start()
        except OSError as exc:
            where = http_source or settings.http
            raise StartupError(f"setting 'http': cannot listen on {where}: "
                               f"{exc.strerror or exc}") from None
    except StartupError as exc:
        print_error(f"gpupoold: error: {exc}")
        await runner.cleanup()
        return exc.exit_status
    remoting = app[REMOTING]
    announce("remoting", remoting.address)
    if identity is not None:
        # `gpupoold: identity SHA256:...`: what clients pin (tests and scripts read it)
        print(f"gpupoold: identity {identity.fingerprint}", flush=True)
    else:
        print("gpupoold: identity none (tls = \"off\": plain TCP)", flush=True)
    bound = runner.addresses[0]
    http_address = format_address(bound[0], bound[1])
    announce("http", http_address)
    if http_sock is not None:
        log.info("HTTP listener on %s: %s; setting 'http' (%s) is not used", http_address,
                 http_source, settings.http)
    if ssl_context is not None:
        log.info("the HTTP listener speaks HTTPS (%s)", https.source)
    # The servers of a fleet forward admin actions to this address, with this scheme and pin
    # (http/fleet_actions.py); after the lines above, which scripts read as soon as the
    # listener answers.
    await app[MEMBERSHIP].set_http(
        http_address, advertised_http(settings.http_advertise, http_address) or "",
        https.scheme, https.fingerprint)
    # Everything imported and built at start-up lives as long as the daemon: move it out of the
    # cyclic garbage collector's view. Otherwise each full collection walks those ~45k objects and
    # stops the event loop for 7-20 ms on a busy 2-core machine (measured with bench/
    # metrics_bench.py), which is most of a slow scrape's or probe's time.
    gc.collect()
    gc.freeze()
    notifier.ready(f"serving: remoting on {remoting.address}{_from(remoting.source)}, "
                   f"http on {http_address}{_from(http_source)}")
    try:
        await stop.wait()
        log.info("stopping: no new connections")
        notifier.stopping("stopping")
        await runner.cleanup()
    finally:
        notifier.close()
    log.info("stopped")
    return 0


def run(settings: Settings) -> int:
    return asyncio.run(serve(settings))
