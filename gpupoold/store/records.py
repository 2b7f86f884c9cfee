"""What the store returns and takes (store/database.py): tokens, token checks, leases (new,
filtered, recorded), audit records and a server's registration. Plain frozen dataclasses, kept
apart from the queries that make them; store/database.py imports them all, and callers may
import them from either module."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServerRegistration:
    """How the other servers of a fleet and its clients reach this server safely (schema v7):
    `fingerprint`: its remoting TLS identity ("" on plain TCP); `http_address`: the HTTP address
    the others must use (`http_advertise`); `http_scheme`: "https" or "http"; `http_fingerprint`:
    the fingerprint of the certificate its HTTPS listener presents ("" for plain HTTP)."""

    fingerprint: str = ""
    http_address: str = ""
    http_scheme: str = ""
    http_fingerprint: str = ""


@dataclass(frozen=True)
class TokenRecord:
    id: str  # the 12 hex digits of the token's text
    name: str
    role: str  # user | admin
    created: float
    expires: float | None
    revoked: float | None
    last_used: float | None
    created_by: str
    weight: int = 1  # its shares' weight on a shared GPU (issue 32: worker/pacing.c)

    def state(self, now: float | None = None) -> str:
        """valid, revoked or expired."""
        if self.revoked is not None:
            return "revoked"
        if self.expires is not None and self.expires <= (time.time() if now is None else now):
            return "expired"
        return "valid"

    def to_json(self) -> dict[str, Any]:
        """The API's view of a token: never the hash, never the secret."""
        return {"id": self.id, "name": self.name, "role": self.role, "created": self.created,
                "expires": self.expires, "revoked": self.revoked, "last_used": self.last_used,
                "created_by": self.created_by, "state": self.state(), "weight": self.weight}


@dataclass(frozen=True)
class TokenCheck:
    """The result of checking a presented token."""

    result: str  # one of CHECK_RESULTS
    token: TokenRecord | None = None  # set for ok, revoked and expired
    token_id: str = ""  # the id in the token's text, once it parsed (safe to log)

    @property
    def ok(self) -> bool:
        return self.result == "ok"


@dataclass(frozen=True)
class NewLease:
    gpu_index: int
    gpu_uuid: str
    gpu_name: str
    simulated: bool
    token_name: str
    client_host: str
    client_user: str
    client_pid: int
    program: str
    peer: str
    request: str  # the client's requirements, in words
    queued_s: float
    started: float


_NEW_LEASE_FIELDS = tuple(NewLease.__dataclass_fields__)


@dataclass(frozen=True)
class LeaseFilter:
    """Which lease records a listing keeps (None: any): the token's name, the client's user
    name, the GPU index, and when it started (`since` inclusive, `until` exclusive; epoch s)."""

    token: str | None = None
    user: str | None = None
    gpu: int | None = None
    since: float | None = None
    until: float | None = None
    ended_after: float | None = None  # still running, or ended at or after this


@dataclass(frozen=True)
class LeaseRecord(NewLease):
    """A lease as the store has it: what it was given (NewLease), its id and how it ended."""

    id: int
    ended: float | None
    end_reason: str | None
    end_detail: str | None
    bytes_h2d: int
    bytes_d2h: int
    calls: dict[str, int]
    scrub_ok: bool | None  # None until its GPU was scrubbed after it (again once it reattaches)
    scrub: dict[str, Any] | None
    module_bytes: int = 0  # module images received (cache misses); 0 when all were cached
    detaches: int = 0  # times the lease gave its GPU back while idle (pool/detach.py)
    detached_s: float = 0.0  # seconds it spent detached
    server: str = ""  # the server that ran it (config/identity.py); "" in older records
    leased_s: float = 0.0  # seconds it held a GPU, as sampled (pool/usage.py; schema v9)
    busy_s: float = 0.0  # of those, seconds its GPU was busy
    reused_s: float = 0.0  # seconds its GPU served others while it was detached (schema v10)
    # Every GPU of a lease of several GPUs, program order (issue 37, schema v12); () for a lease
    # of one GPU (gpu_index), and in older records
    gpus: tuple[int, ...] = ()
    # A part of a lease spread over several servers of a fleet (issue 37 item 3, schema v17): the
    # group its parts share (the fleet ticket; the same in every part's record, on each part's
    # server), which part it is (0-based, device order) and how many; 0, 0, 0 otherwise
    spread_group: int = 0
    part: int = 0
    parts: int = 0

    def to_json(self) -> dict[str, Any]:
        view = {name: getattr(self, name) for name in self.__dataclass_fields__}
        view["gpus"] = list(self.gpus) or [self.gpu_index]  # every lease lists its GPUs
        return view


@dataclass(frozen=True)
class AuditRecord:
    id: int
    at: float
    actor: str
    action: str
    target: str
    detail: str
    server: str = ""  # the server that acted (its name; "" in records older than schema v7)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "time": self.at, "actor": self.actor, "action": self.action,
                "target": self.target, "detail": self.detail, "server": self.server}
