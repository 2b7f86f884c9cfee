"""Typed keys of the objects the application holds (set up in app.py)."""

from __future__ import annotations

from aiohttp import web

from gpupoold.auth import Authenticator
from gpupoold.counters import Counters
from gpupoold.events import EventBus
from gpupoold.gpus import Inventory
from gpupoold.leases import LeaseManager
from gpupoold.nvml import Nvml
from gpupoold.remoting import RemotingListener
from gpupoold.settings import Settings
from gpupoold.store import Store
from gpupoold.telemetry import Telemetry
from gpupoold.views import PoolViews
from gpupoold.workers import WorkerSupervisor

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
