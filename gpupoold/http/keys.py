"""Typed keys of the objects the application holds (set up in app.py)."""

from __future__ import annotations

from aiohttp import web

from gpupoold.auth.authenticator import Authenticator
from gpupoold.config.settings import Settings
from gpupoold.gpu.inventory import Inventory
from gpupoold.gpu.nvml import Nvml
from gpupoold.gpu.telemetry import Telemetry
from gpupoold.pool.counters import Counters
from gpupoold.pool.events import EventBus
from gpupoold.pool.leases import LeaseManager
from gpupoold.pool.membership import Membership
from gpupoold.pool.usage_recorder import UsageRecorder
from gpupoold.pool.views import PoolViews
from gpupoold.remoting.listener import RemotingListener
from gpupoold.store.database import Store
from gpupoold.tls import RemotingIdentity
from gpupoold.workers.supervisor import WorkerSupervisor

SETTINGS = web.AppKey("settings", Settings)
COUNTERS = web.AppKey("counters", Counters)
EVENTS = web.AppKey("events", EventBus)
STORE = web.AppKey("store", Store)
AUTH = web.AppKey("auth", Authenticator)
NVML = web.AppKey("nvml", Nvml)
INVENTORY = web.AppKey("inventory", Inventory)
SUPERVISOR = web.AppKey("supervisor", WorkerSupervisor)
LEASES = web.AppKey("leases", LeaseManager)
REMOTING = web.AppKey("remoting", RemotingListener)
TELEMETRY = web.AppKey("telemetry", Telemetry)
VIEWS = web.AppKey("views", PoolViews)
MEMBERSHIP = web.AppKey("membership", Membership)
USAGE = web.AppKey("usage", UsageRecorder)  # GPU time accounting (issue 33)
# The remoting port's TLS identity (gpupoold/tls.py); absent with `tls = "off"` (plain TCP).
REMOTING_TLS = web.AppKey("remoting_tls", RemotingIdentity)


def remoting_address(app: web.Application) -> str:
    """Where clients reach this server (the advertised address, once it is registered)."""
    membership = app.get(MEMBERSHIP)
    if membership is not None:
        return membership.remoting
    remoting = app.get(REMOTING)
    return remoting.address if remoting is not None else ""


def tls_view(app: web.Application) -> dict[str, str | None]:
    """What the status API, `gpupoold status` and the dashboard say of the remoting port's TLS:
    `tls` "on"/"off", the `fingerprint` clients pin, the `certificate` ("identity": the server's
    own, "tls_cert": the operator's)."""
    ident = app.get(REMOTING_TLS)
    if ident is None:
        return {"tls": "off", "fingerprint": None, "certificate": None}
    return {"tls": "on", "fingerprint": ident.fingerprint,
            "certificate": "tls_cert" if ident.own else "identity"}
