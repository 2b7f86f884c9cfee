"""Browser sessions: a random id in the cookie, the token kept in memory only (to notice a
revoked or expired one), a CSRF token per session; who looks at a page (`Viewer`)."""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

COOKIE = "gpupool_session"
SESSION_IDLE_S = 12 * 3600.0
MAX_SESSIONS = 10000


@dataclass
class Session:
    sid: str
    token: str  # kept in memory only, to notice a revoked or expired token
    identity: str
    role: str
    csrf: str
    created: float = field(default_factory=time.monotonic)
    seen: float = field(default_factory=time.monotonic)


class Sessions:
    def __init__(self, idle_s: float = SESSION_IDLE_S) -> None:
        self.idle_s = idle_s
        self._by_id: dict[str, Session] = {}

    def create(self, token: str, identity: str, role: str) -> Session:
        self.expire()
        if len(self._by_id) >= MAX_SESSIONS:  # drop the least recently used
            oldest = min(self._by_id.values(), key=lambda s: s.seen)
            self._by_id.pop(oldest.sid, None)
        s = Session(secrets.token_urlsafe(32), token, identity, role, secrets.token_urlsafe(32))
        self._by_id[s.sid] = s
        return s

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        s = self._by_id.get(sid)
        if s is None:
            return None
        now = time.monotonic()
        if now - s.seen > self.idle_s:
            self._by_id.pop(sid, None)
            return None
        s.seen = now
        return s

    def end(self, sid: str) -> None:
        self._by_id.pop(sid, None)

    def expire(self) -> None:
        now = time.monotonic()
        for sid in [k for k, s in self._by_id.items() if now - s.seen > self.idle_s]:
            del self._by_id[sid]

    def __len__(self) -> int:
        return len(self._by_id)


@dataclass(frozen=True)
class Viewer:
    """Who looks at a page: a session, or the anonymous reader."""

    session: Session | None
    name: str
    role: str  # "admin", "user" or "anonymous"

    @property
    def admin(self) -> bool:
        return self.session is not None and self.role == "admin"

    @property
    def csrf(self) -> str:
        return self.session.csrf if self.session is not None else ""


def csrf_ok(session: Session, sent: Any) -> bool:
    return isinstance(sent, str) and bool(sent) and hmac.compare_digest(sent, session.csrf)
