"""The application factory, shared by `gpupoold serve` and the tests.

`create_app(settings)` returns an aiohttp application whose resources are `cleanup_ctx`
generators, started in this order and stopped in reverse: state directories, the remoting
port's TLS identity (made at the first start unless `tls_cert` or `tls = "off"`), the store
(SQLite) and authentication, the GPU inventory (NVML), the worker supervisor, the lease manager,
the live GPU values (gpu/telemetry.py), the Prometheus collector (http/metrics.py), the web dashboard's
history sampler (dashboard/live.py), the remoting listener. So at shutdown the listener stops
accepting first, then the leases end (their workers stopped and their records written), and the
store closes last.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web

from gpupoold import sdlisten
from gpupoold.auth.authenticator import NoAuthentication, TokenAuthenticator, ensure_local_admin_token
from gpupoold.config.file import EX_CONFIG
from gpupoold.config.identity import advertised_address, server_name
from gpupoold.config.settings import Settings
from gpupoold.dashboard import dashboard_ctx, setup_dashboard
from gpupoold.gpu.cleaner import GpuCleaner
from gpupoold.gpu.inventory import InventoryError, NoGpuError, build_inventory
from gpupoold.gpu.nvml import Nvml
from gpupoold.gpu.sim import remove_sim_memory, remove_stale_sim_memory
from gpupoold.gpu.telemetry import Telemetry
from gpupoold.http.auth import auth_middleware
from gpupoold.http.browser_guard import browser_guard_middleware, setup_browser_guard
from gpupoold.http.keys import (
    AUTH,
    COUNTERS,
    EVENTS,
    INVENTORY,
    LEASES,
    MEMBERSHIP,
    NVML,
    REMOTING,
    REMOTING_TLS,
    SETTINGS,
    STORE,
    SUPERVISOR,
    TELEMETRY,
    USAGE,
    VIEWS,
)
from gpupoold.http.metrics import METRICS_KEY, DaemonMetrics
from gpupoold.http.routes import setup_routes
from gpupoold.paths import CHECKPOINT_NAME, SCRUB_NAME, SIM_LIB_NAME, WORKER_NAME, candidates, find_native
from gpupoold.pool.counters import Counters
from gpupoold.pool.detach import Checkpointer
from gpupoold.pool.events import EventBus, LeaseEnded
from gpupoold.pool.leases import LeaseManager
from gpupoold.pool.membership import Membership
from gpupoold.pool.usage_recorder import UsageRecorder
from gpupoold.pool.views import PoolViews
from gpupoold.remoting.listener import RemotingListener
from gpupoold.remoting.peer_hello import PartServer, PeerHelloChecker
from gpupoold.remoting.peer_links import PeerIdentity, PeerLinks
from gpupoold.store.database import ServerRegistration, Store
from gpupoold.store.notify import Notifications
from gpupoold.tls import TlsSettingError, remoting_identity
from gpupoold.workers.ipc_broker import IpcBroker
from gpupoold.workers.state_dir import WorkerDir
from gpupoold.workers.supervisor import WorkerSupervisor, WorkerTls

log = logging.getLogger("gpupoold")
DB_NAME = "gpupoold.db"


class StartupError(Exception):
    """gpupoold cannot start; the message says why (and names the setting). `exit_status`: 1
    (another try might work), or EX_CONFIG (78: it cannot work as configured or found)."""

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def create_app(settings: Settings) -> web.Application:
    # The browser checks (Host, Origin, a trusted proxy's scheme) come before the tokens.
    app = web.Application(middlewares=[browser_guard_middleware, auth_middleware])
    app[SETTINGS] = settings
    app[COUNTERS] = Counters()
    # The lease manager publishes on it; the metrics (here) and the dashboard subscribe.
    app[EVENTS] = EventBus()
    app[METRICS_KEY] = DaemonMetrics()
    app[METRICS_KEY].subscribe(app[EVENTS])
    app.cleanup_ctx.append(state_ctx)
    app.cleanup_ctx.append(identity_ctx)
    app.cleanup_ctx.append(store_ctx)
    app.cleanup_ctx.append(inventory_ctx)
    app.cleanup_ctx.append(supervisor_ctx)
    app.cleanup_ctx.append(leases_ctx)
    app.cleanup_ctx.append(telemetry_ctx)
    app.cleanup_ctx.append(usage_ctx)
    app.cleanup_ctx.append(metrics_ctx)
    app.cleanup_ctx.append(dashboard_ctx)
    app.cleanup_ctx.append(remoting_ctx)
    app.cleanup_ctx.append(membership_ctx)
    setup_routes(app)
    setup_dashboard(app)
    setup_browser_guard(app)
    return app


def _native(setting: str, name: str, configured: Path | None, mode: int) -> Path | None:
    path = find_native(name, configured)
    if configured is not None and not (path and path.is_file() and os.access(path, mode)):
        what = "executable" if mode & os.X_OK else "readable"
        raise StartupError(f"setting '{setting}': {configured} is not an existing {what} file")
    if path is None:
        looked = ", ".join(str(p) for p in candidates(name))
        log.warning("%s not found (looked in %s; set '%s'): clients will be refused", name,
                    looked, setting)
    return path


async def state_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    folders = [("state_dir", settings.state_dir), ("cache_dir", settings.effective_cache_dir)]
    if settings.jit_cache_mib > 0:  # the workers' PTX JIT cache (gpu/environment.py)
        folders.append(("jit_cache_mib", settings.effective_cache_dir / "jit"))
    for setting, path in folders:
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o750)
        except OSError as exc:
            raise StartupError(f"setting '{setting}': cannot create {path}: "
                               f"{exc.strerror}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise StartupError(f"setting '{setting}': {path} is not writable")
    yield


async def store_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    if settings.database:
        try:
            store = await Store.open(settings.database, settings.database_password_file,
                                     server=server_name(settings.state_dir),
                                     state_dir=settings.state_dir)
        except Exception as exc:
            raise StartupError(f"setting 'database': {exc}") from None
        log.info("database: %s", store.where)
    else:
        path = settings.state_dir / DB_NAME
        try:
            store = await Store.open(path, server=server_name(settings.state_dir),
                                     state_dir=settings.state_dir)
        except Exception as exc:
            raise StartupError(f"setting 'state_dir': cannot open the database {path}: "
                               f"{exc}") from None
    app[STORE] = store
    if settings.auth == "none":
        log.warning("*" * 72)
        log.warning("AUTHENTICATION IS OFF (auth = none): anyone who can reach %s and %s can "
                    "use the GPUs and the admin API", settings.listen, settings.http)
        log.warning("*" * 72)
        app[AUTH] = NoAuthentication()
    else:
        app[AUTH] = TokenAuthenticator(store)
        token_file = await ensure_local_admin_token(store, settings.state_dir)
        log.info("local admin token written to %s (for `gpupoold status`, `gpupoold gpu ...`)",
                 token_file)
    try:
        yield
    finally:
        await store.close()


async def inventory_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    sim_lib = _native("sim_lib", SIM_LIB_NAME, settings.sim_lib, os.R_OK)
    nvml = Nvml()
    app[NVML] = nvml
    if settings.simulated > 0 or settings.fallback_to_simulated:
        # The memory files of this user's simulated GPUs whose state directory is gone.
        for folder in await asyncio.to_thread(remove_stale_sim_memory, settings.state_dir):
            log.info("removed stale simulated GPU memory %s (its state directory is gone)", folder)
    try:
        inventory = await build_inventory(settings, sim_lib, nvml=nvml)
    except InventoryError as exc:
        await asyncio.to_thread(nvml.shutdown)
        raise StartupError(str(exc), EX_CONFIG if isinstance(exc, NoGpuError) else 1) from None
    if inventory.fallback_reason:
        log.warning("*" * 72)
        log.warning("NO REAL GPU (%s)", inventory.fallback_reason)
        log.warning("serving 1 SIMULATED GPU instead, as `fallback_to_simulated = true` asks "
                    "(docs/configuration.md)")
        log.warning("*" * 72)
    for gpu in inventory.gpus:
        kind = "simulated" if gpu.simulated else "real"
        log.info("GPU %d: %s (%s, %s)", gpu.index, gpu.name, kind, gpu.uuid or "uuid unknown")
    app[INVENTORY] = inventory
    try:
        yield
    finally:
        await asyncio.to_thread(nvml.shutdown)


async def identity_ctx(app: web.Application) -> AsyncIterator[None]:
    """The remoting port's TLS identity (gpupoold/tls.py), unless `gpupoold serve` found it
    already: the operator's `tls_cert`, else the state directory's own, made at the first
    start. None (no REMOTING_TLS) with `tls = "off"`."""
    if REMOTING_TLS not in app:
        try:
            ident = await asyncio.to_thread(remoting_identity, app[SETTINGS])
        except TlsSettingError as exc:
            raise StartupError(str(exc)) from None
        if ident is not None:
            app[REMOTING_TLS] = ident
    yield


async def supervisor_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    worker = _native("worker", WORKER_NAME, settings.worker, os.X_OK)
    ident = app.get(REMOTING_TLS)
    # The workers run the data path's TLS session with the same files as the daemon's.
    tls = None if ident is None else WorkerTls(ident.cert, ident.key, ident.client_ca)
    app[SUPERVISOR] = WorkerSupervisor(worker, settings.effective_cache_dir, tls=tls,
                                       workers_dir=WorkerDir(settings.state_dir),
                                       orphan_grace=settings.worker_orphan_grace,
                                       sandbox=settings.worker_sandbox,
                                       jit_cache_mib=settings.jit_cache_mib)
    yield


async def leases_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    worker = app[SUPERVISOR].worker
    # The scrub tool ships beside the worker.
    scrub = find_native(SCRUB_NAME, worker.parent / SCRUB_NAME if worker is not None and (
        worker.parent / SCRUB_NAME).is_file() else None)
    if scrub is None:
        log.error("%s not found (looked beside the worker and in %s): GPUs cannot be scrubbed "
                  "and will be quarantined", SCRUB_NAME,
                  ", ".join(str(p) for p in candidates(SCRUB_NAME)))
    cleaner = GpuCleaner(scrub, app[INVENTORY].nvml, settings.state_dir, settings.reset_policy,
                         settings.reset_socket, settings.scrub_timeout)
    # So does the checkpoint tool (idle detach); without it no lease detaches.
    checkpoint = find_native(CHECKPOINT_NAME, worker.parent / CHECKPOINT_NAME if worker is not None
                             and (worker.parent / CHECKPOINT_NAME).is_file() else None)
    if checkpoint is None and settings.idle_detach_after > 0:
        log.warning("%s not found (looked beside the worker and in %s): idle leases keep their "
                    "GPUs", CHECKPOINT_NAME, ", ".join(str(p) for p in candidates(CHECKPOINT_NAME)))
    # A shared store (no file of its own): the fleet queue grants the GPUs (pool/fleet.py).
    leases = LeaseManager(app[INVENTORY], settings, app[STORE], app[SUPERVISOR], cleaner,
                          app[COUNTERS], app[EVENTS], Checkpointer(checkpoint),
                          shared_store=app[STORE].path is None)
    app[LEASES] = leases
    app[VIEWS] = PoolViews(leases)
    # CUDA IPC between the workers of one job (issue 37): same token only, ends with the lease.
    broker = IpcBroker(lambda lease_id: le.token if (le := leases.pool.lease(lease_id)) else None)
    stop_ipc = app[EVENTS].subscribe(LeaseEnded, lambda ev: broker.lease_ended(ev.lease_id))
    app[SUPERVISOR].ipc = broker
    # Server-to-server links of spread leases (issue 37, item 3; TLS only): the remoting
    # listener takes the other servers' peer_hellos (remoting_ctx), the workers ask here.
    links = peer_links(app, leases)
    stop_links = app[EVENTS].subscribe(LeaseEnded, lambda ev: links.lease_ended(ev.lease_id))
    app[SUPERVISOR].peer_links = links
    await leases.start()
    try:
        yield
    finally:
        await leases.close(settings.stop_grace)
        app[SUPERVISOR].ipc = None
        app[SUPERVISOR].peer_links = None
        links.close()  # (dials in flight are not waited for)
        stop_links()
        stop_ipc()
        broker.close()
        inventory = app[INVENTORY]
        if any(gpu.simulated for gpu in inventory.gpus):
            # A clean stop: the simulated GPUs' memory files go, except those of GPUs whose
            # lease continues without gpupoold (its worker and the next daemon use them).
            kept = leases.kept_gpus
            removed = await asyncio.to_thread(remove_sim_memory, settings.state_dir,
                                              len(inventory.gpus), kept)
            if removed:
                log.info("removed the simulated GPUs' memory %s", removed)


def peer_links(app: web.Application, leases: LeaseManager) -> PeerLinks:
    """The links' broker (remoting/peer_links.py): a lease's spread part from the pool, a part's
    server from the store, this server's remoting identity (None with `tls = "off"`)."""
    store = app[STORE]
    ident = app.get(REMOTING_TLS)

    def lease_part(lease_id: int) -> tuple[int, int] | None:
        lease = leases.pool.lease(lease_id)
        return None if lease is None else (lease.req.spread_group, lease.req.part)

    return PeerLinks(store.server, None if ident is None else PeerIdentity(
        ident.cert, ident.key, ident.fingerprint), lease_part, part_finder(store),
        app[COUNTERS])


def peer_checker(app: web.Application) -> PeerHelloChecker:
    """The checks of another server's peer_hello (remoting/peer_hello.py)."""
    store, leases = app[STORE], app[LEASES]
    ident = app.get(REMOTING_TLS)

    def local_part(group: int, part: int) -> int | None:
        for lease in leases.pool.active():
            # (an idle-detached part has no slot, and its worker lives and takes the link)
            if (group and lease.req.spread_group == group and lease.req.part == part
                    and not lease.worker.exited.done()):
                return lease.id
        return None

    return PeerHelloChecker(None if ident is None else ident.fingerprint, store.servers,
                            part_finder(store), local_part)


def part_finder(store: Store) -> Callable[[int, int], Awaitable[PartServer | None]]:
    """Where a part of a spread lease runs, from the fleet's store (the leases and servers)."""

    async def part_server(group: int, part: int) -> PartServer | None:
        row = await store.spread_part(group, part)
        return None if row is None else PartServer(**row)

    return part_server


async def telemetry_ctx(app: web.Application) -> AsyncIterator[None]:
    leases = app[LEASES]
    telemetry = Telemetry(app[INVENTORY], leases, app[SETTINGS])
    await telemetry.start()
    app[VIEWS].telemetry = telemetry
    app[TELEMETRY] = telemetry
    try:
        yield
    finally:
        app[VIEWS].telemetry = None
        await telemetry.close()


async def usage_ctx(app: web.Application) -> AsyncIterator[None]:
    """GPU time accounting (pool/usage_recorder.py): sampled with the telemetry, written to the store;
    closed before the leases end, with a last flush."""
    settings = app[SETTINGS]
    recorder = UsageRecorder(app[STORE], app[LEASES], app[TELEMETRY], settings.telemetry_interval,
                             settings.usage_retention_days,
                             counted=[g.index for g in app[INVENTORY].gpus if g.simulated])
    recorder.start()
    app[USAGE] = recorder
    unsubscribe = recorder.subscribe(app[EVENTS])  # lease ends, detaches and attaches
    try:
        yield
    finally:
        unsubscribe()
        await recorder.close()


async def metrics_ctx(app: web.Application) -> AsyncIterator[None]:
    metrics = app[METRICS_KEY]
    metrics.attach(app[LEASES], app[TELEMETRY], app[COUNTERS], app[SETTINGS].telemetry_interval,
                   app[USAGE].meter)  # the one integrator of the leased/busy/reused seconds
    try:
        yield
    finally:
        await metrics.close()


async def remoting_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    listener = RemotingListener(settings, app[LEASES], app[AUTH], app[COUNTERS],
                                sock=app.get(sdlisten.SOCKETS, {}).get(sdlisten.REMOTING),
                                views=app[VIEWS])
    # Before it listens: a peer_hello may come with the first connection.
    listener.peer_links = app[SUPERVISOR].peer_links
    listener.peer_checker = peer_checker(app)
    try:
        await listener.start()
    except OSError as exc:
        raise StartupError(f"setting 'listen': cannot listen on {settings.listen}: "
                           f"{exc.strerror or exc}") from None
    app[REMOTING] = listener
    ident = app.get(REMOTING_TLS)
    listener.info.fingerprint = ident.fingerprint if ident is not None else ""  # the info reply
    yield
    await listener.close()


async def membership_ctx(app: web.Application) -> AsyncIterator[None]:
    """This server among those sharing the store (pool/membership.py), once it listens; in a
    fleet, its part of the fleet queue from then on (pool/fleet.py), woken by the other
    servers' notifications (store/notify.py)."""
    settings = app[SETTINGS]
    address = advertised_address(settings.advertise, app[REMOTING].address)
    ident = app.get(REMOTING_TLS)
    # The others send clients here only with this pin (a redirect's redirect_fingerprint); the
    # HTTP listener's part is registered once it is bound (serve.py, Membership.set_http).
    membership = Membership(app[STORE], address, settings.http, ServerRegistration(
        fingerprint=ident.fingerprint if ident is not None else ""))
    await membership.start()
    app[MEMBERSHIP] = membership
    fleet = app[LEASES].fleet
    notifications = None
    if fleet is not None and settings.database:
        log.info("fleet: this server is %s, reached at %s", app[STORE].server, address)
        fleet.start()
        notifications = Notifications(settings.database, settings.database_password_file,
                                      fleet.kick, server=app[STORE].server)
        notifications.start()
    yield
    if fleet is not None:
        await fleet.close()
    if notifications is not None:
        await notifications.close()
    await membership.close()
