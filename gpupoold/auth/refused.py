"""Tokens the store refused lately, remembered so that the store is not asked again for them.

A flood of one bogus, revoked or expired token would otherwise cost a store look-up each (a
network round trip on PostgreSQL). The store's answer for such a token cannot turn into a yes
(a token's secret is random: nobody can later create the one refused; a revoked or expired token
stays so), so remembering the no for `ttl` seconds changes no decision. Only the refusals that
came from the store are remembered; a missing or malformed token is refused without it anyway.

Kept: a SHA-256 of the token (never the text), at most `size` entries, the oldest dropped first.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

TTL = 60.0  # seconds a refusal is remembered
SIZE = 4096  # refusals remembered at most
STORE_REASONS = frozenset({"unknown", "revoked", "expired"})

T = TypeVar("T")


def _key(token: str) -> bytes:
    return hashlib.sha256(token.strip().encode(errors="replace")).digest()


class RefusedTokens(Generic[T]):
    """{SHA-256 of a token: the refusal} for `ttl` seconds, at most `size` of them."""

    def __init__(self, ttl: float = TTL, size: int = SIZE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.size = size
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[float, T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, token: str) -> T | None:
        key = _key(token)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            del self._entries[key]
            return None
        return entry[1]

    def put(self, token: str, refusal: T) -> None:
        key = _key(token)
        self._entries.pop(key, None)
        self._entries[key] = (self._clock() + self.ttl, refusal)  # the newest last
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
