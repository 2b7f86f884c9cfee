"""Authentication of remoting clients: the hook the handshake calls with the client's token.

No authentication exists yet: `AcceptAnyToken` lets every client in. API tokens (stored hashed,
compared in constant time) replace it in issue 4 without touching the listener.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class AuthDecision:
    ok: bool
    identity: str = ""  # who the token belongs to (token name), for logs and the API
    message: str = ""  # why it was refused (sent to the client)


class Authenticator(Protocol):
    async def check(self, token: str, peer: str) -> AuthDecision: ...


class AcceptAnyToken:
    """Accepts every client, with or without a token (no authentication configured)."""

    async def check(self, token: str, peer: str) -> AuthDecision:
        return AuthDecision(ok=True, identity="anonymous")
