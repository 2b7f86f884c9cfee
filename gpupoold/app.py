"""The application factory, shared by `gpupoold serve` and the tests.

`create_app(settings)` returns an aiohttp application whose resources are `cleanup_ctx`
generators, started in this order and stopped in reverse: state directories, GPU inventory,
worker supervisor, remoting listener. So at shutdown the listener stops accepting first, then the
workers are stopped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from gpupoold.auth import AcceptAnyToken
from gpupoold.gpus import build_inventory
from gpupoold.keys import AUTH, INVENTORY, REMOTING, SCHEDULER, SESSIONS, SETTINGS, SUPERVISOR
from gpupoold.paths import SIM_LIB_NAME, WORKER_NAME, candidates, find_native
from gpupoold.remoting import RemotingListener
from gpupoold.routes import setup_routes
from gpupoold.scheduler import Scheduler
from gpupoold.sessions import SessionRegistry
from gpupoold.settings import Settings
from gpupoold.workers import WorkerSupervisor

log = logging.getLogger("gpupoold")


class StartupError(Exception):
    """gpupoold cannot start; the message says why (and names the setting)."""


def create_app(settings: Settings) -> web.Application:
    app = web.Application()
    app[SETTINGS] = settings
    app[AUTH] = AcceptAnyToken()
    app[SESSIONS] = SessionRegistry()
    app.cleanup_ctx.append(state_ctx)
    app.cleanup_ctx.append(inventory_ctx)
    app.cleanup_ctx.append(supervisor_ctx)
    app.cleanup_ctx.append(remoting_ctx)
    setup_routes(app)
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
    for setting, path in (("state_dir", settings.state_dir),
                          ("cache_dir", settings.effective_cache_dir)):
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o750)
        except OSError as exc:
            raise StartupError(f"setting '{setting}': cannot create {path}: "
                               f"{exc.strerror}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise StartupError(f"setting '{setting}': {path} is not writable")
    yield


async def inventory_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    sim_lib = _native("sim_lib", SIM_LIB_NAME, settings.sim_lib, os.R_OK)
    inventory = await build_inventory(settings, sim_lib)
    if inventory.fallback_reason:
        log.warning("*" * 72)
        log.warning("NO NVIDIA DRIVER: %s", inventory.fallback_reason)
        log.warning("serving 1 SIMULATED GPU instead (set `simulated` to choose; "
                    "docs/configuration.md)")
        log.warning("*" * 72)
    for gpu in inventory.gpus:
        kind = "simulated" if gpu.simulated else "real"
        log.info("GPU %d: %s (%s, %s)", gpu.index, gpu.name, kind, gpu.uuid or "uuid unknown")
    app[INVENTORY] = inventory
    app[SCHEDULER] = Scheduler(inventory, app[SESSIONS])
    yield


async def supervisor_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    worker = _native("worker", WORKER_NAME, settings.worker, os.X_OK)
    supervisor = WorkerSupervisor(worker, settings.effective_cache_dir, app[SESSIONS])
    app[SUPERVISOR] = supervisor
    yield
    await supervisor.stop_all(settings.stop_grace)


async def remoting_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    listener = RemotingListener(settings.listen, settings.handshake_timeout, app[SCHEDULER],
                                app[SESSIONS], app[SUPERVISOR], app[AUTH])
    try:
        await listener.start()
    except OSError as exc:
        raise StartupError(f"setting 'listen': cannot listen on {settings.listen}: "
                           f"{exc.strerror or exc}") from None
    app[REMOTING] = listener
    yield
    await listener.close()
