"""Typed keys of the objects the application holds (set up in app.py)."""

from __future__ import annotations

from aiohttp import web

from gpupoold.auth import Authenticator
from gpupoold.gpus import Inventory
from gpupoold.remoting import RemotingListener
from gpupoold.scheduler import Scheduler
from gpupoold.sessions import SessionRegistry
from gpupoold.settings import Settings
from gpupoold.workers import WorkerSupervisor

SETTINGS = web.AppKey("settings", Settings)
AUTH = web.AppKey("auth", Authenticator)
INVENTORY = web.AppKey("inventory", Inventory)
SESSIONS = web.AppKey("sessions", SessionRegistry)
SCHEDULER = web.AppKey("scheduler", Scheduler)
SUPERVISOR = web.AppKey("supervisor", WorkerSupervisor)
REMOTING = web.AppKey("remoting", RemotingListener)
