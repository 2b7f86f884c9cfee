"""API tokens: their text, their hash, names and expiry.

A token reads `gpt_<id>_<secret>`: `id` is 12 hex digits that name the token in logs and in the
database without revealing it; `secret` is 32 random bytes in URL-safe base64 without padding
(43 characters). Only the SHA-256 of the secret is stored. A presented token is checked by looking
its id up and comparing the hashes with `hmac.compare_digest`; for an unknown id the same
comparison is made against a dummy hash, so the answer's timing does not tell whether an id
exists (the store calls `secret_matches` either way).

Expiry (`parse_expiry`) is written `never`, a duration from now (`90m`, `12h`, `30d`, `2w`), or an
ISO 8601 date or date and time (without a zone: the server's local time).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, date, datetime

PREFIX = "gpt_"
ID_HEX = 12
SECRET_BYTES = 32
SECRET_CHARS = 43  # len(urlsafe_b64encode(32 bytes)) without its one '=' of padding
ROLES = ("user", "admin")
LOCAL_ADMIN = "local-admin"  # the daemon's own admin token (auth.ensure_local_admin_token)
NAME_MAX = 64
MAX_DURATION = 100 * 365 * 86400  # longer durations are a typo for `never`
WEIGHT_MAX = 1000  # a share's weight: 1..1000, as worker/pacing.c takes it

_TOKEN_RE = re.compile(rf"{PREFIX}([0-9a-f]{{{ID_HEX}}})_([A-Za-z0-9_-]{{{SECRET_CHARS}}})\Z")
_NAME_RE = re.compile(rf"[A-Za-z0-9._@-]{{1,{NAME_MAX}}}\Z")
_DURATION_RE = re.compile(r"(\d+)\s*([smhdw])\Z")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# Compared with when the id is unknown: same length and type as a real hash, matches nothing.
_DUMMY_HASH = hashlib.sha256(b"gpupool: no token has this id").hexdigest()

FORMAT_TEXT = f"{PREFIX}<{ID_HEX} hex digits>_<{SECRET_CHARS} characters>"
EXPIRY_HELP = "`never`, a duration from now (`90m`, `12h`, `30d`, `2w`) or an ISO 8601 date"


@dataclass(frozen=True)
class ParsedToken:
    id: str
    secret: str


def new_token() -> tuple[str, str, str]:
    """A fresh token: (id, secret, full text). The caller stores the id and hash_secret(secret)."""
    token_id = secrets.token_hex(ID_HEX // 2)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(SECRET_BYTES)).rstrip(b"=").decode()
    return token_id, secret, f"{PREFIX}{token_id}_{secret}"


def parse_token(text: str) -> ParsedToken | None:
    """The id and secret of a token's text, or None when it is not in the token format."""
    m = _TOKEN_RE.match(text)
    if m is None:
        return None
    return ParsedToken(m.group(1), m.group(2))


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str | None) -> bool:
    """Constant-time check of `secret` against a stored hash; None (unknown id) compares with a
    dummy hash and returns False, taking the same time."""
    expected = _DUMMY_HASH if stored_hash is None else stored_hash
    same = hmac.compare_digest(hash_secret(secret).encode(), expected.encode())
    return same and stored_hash is not None


def check_token_name(name: str, *, allow_reserved: bool = False) -> None:
    """ValueError (saying what is allowed) unless `name` is a valid name for a new token."""
    if not _NAME_RE.match(name):
        if not name:
            raise ValueError("a token name cannot be empty")
        if len(name) > NAME_MAX:
            raise ValueError(f"a token name has at most {NAME_MAX} characters, this one {len(name)}")
        raise ValueError("a token name may contain only letters, digits and . _ @ -")
    if (name == LOCAL_ADMIN or name.startswith(LOCAL_ADMIN + "@")) and not allow_reserved:
        raise ValueError(f"'{LOCAL_ADMIN}' and '{LOCAL_ADMIN}@...' are reserved for the daemon's "
                         "own admin token (each server's, rewritten at every start)")


def check_weight(weight: int) -> None:
    """ValueError unless `weight` is a share weight the worker's pacing takes (1..1000)."""
    if not 1 <= weight <= WEIGHT_MAX:
        raise ValueError(f"a weight is a whole number from 1 to {WEIGHT_MAX}, got {weight}")


def check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"the role must be one of {', '.join(ROLES)}, got {role!r}")


def parse_expiry(text: str, now: float | None = None) -> float | None:
    """The expiry time (Unix seconds) that `text` means, None for never; ValueError otherwise.
    An expiry in the past is refused: such a token would be useless."""
    now = time.time() if now is None else now
    value = text.strip().lower()
    if not value:
        raise ValueError(f"an expiry cannot be empty: use {EXPIRY_HELP}")
    if value == "never":
        return None
    m = _DURATION_RE.match(value)
    if m is not None:
        amount = int(m.group(1))
        if amount == 0:
            raise ValueError("a duration must be more than 0")
        seconds = amount * _UNIT_SECONDS[m.group(2)]
        if seconds > MAX_DURATION:
            raise ValueError(f"{text!r} is too far away: use `never` for a token that does not "
                             "expire")
        return now + seconds
    try:
        when = _parse_date(text.strip())
    except (ValueError, OverflowError):
        raise ValueError(f"{text!r} is neither a duration nor a date: use {EXPIRY_HELP}") from None
    if when <= now:
        raise ValueError(f"{text!r} is in the past")
    return when


def _parse_date(text: str) -> float:
    if len(text) == 10:  # a bare date: the start of that day, local time
        d = date.fromisoformat(text)
        return datetime(d.year, d.month, d.day).timestamp()
    dt = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    return dt.timestamp()  # naive: local time (datetime.timestamp's own rule)


def format_utc(ts: float) -> str:
    """A time for messages sent to remote users, whose time zone is unknown: '2026-11-20 14:03
    UTC'."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def format_local(ts: float | None, never: str = "never") -> str:
    """A time for the operator's tables, in the server's local time."""
    if ts is None:
        return never
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")
