"""API token text, hashing, names and expiry (gpupoold/store/tokens.py)."""

from __future__ import annotations

import base64
import hashlib
import re
from datetime import UTC, datetime

import pytest

from gpupoold.store import tokens
from gpupoold.store.tokens import (
    LOCAL_ADMIN,
    check_role,
    check_token_name,
    format_utc,
    hash_secret,
    new_token,
    parse_expiry,
    parse_token,
    secret_matches,
)

NOW = 1_800_000_000.0  # a fixed "now" for expiry arithmetic


def test_new_token_has_the_documented_format() -> None:
    token_id, secret, text = new_token()
    assert re.fullmatch(r"gpt_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", text), text
    assert text == f"gpt_{token_id}_{secret}"
    assert len(base64.urlsafe_b64decode(secret + "=")) == 32
    assert parse_token(text) == tokens.ParsedToken(token_id, secret)


def test_new_tokens_differ() -> None:
    made = [new_token() for _ in range(200)]
    assert len({m[0] for m in made}) == 200 and len({m[1] for m in made}) == 200


@pytest.mark.parametrize("text", [
    "", "gpt_", "gpt_0123456789ab", "gpt_0123456789ab_", "GPT_0123456789ab_" + "a" * 43,
    "gpt_0123456789AB_" + "a" * 43,  # ids are lower-case hex
    "gpt_0123456789a_" + "a" * 44,  # 11 hex digits
    "gpt_0123456789ab_" + "a" * 42, "gpt_0123456789ab_" + "a" * 44,
    "gpt_0123456789ab_" + "a" * 42 + "=",  # padding is not part of the format
    "gpt_0123456789ab_" + "a" * 42 + "+",  # standard base64, not URL-safe
    " gpt_0123456789ab_" + "a" * 43, "gpt_0123456789ab_" + "a" * 43 + "\n",
    "Bearer gpt_0123456789ab_" + "a" * 43, "x" * 10000,
])
def test_malformed_tokens_do_not_parse(text: str) -> None:
    assert parse_token(text) is None


def test_hash_is_sha256_of_the_secret_only() -> None:
    _, secret, _ = new_token()
    assert hash_secret(secret) == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in hash_secret(secret)


def test_secret_matches_compares_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = tokens.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tokens.hmac, "compare_digest", counting)
    _, secret, _ = new_token()
    stored = hash_secret(secret)
    assert secret_matches(secret, stored) is True
    assert secret_matches(secret + "x", stored) is False
    # An unknown id still costs one comparison of equal-length hashes, and never matches.
    assert secret_matches(secret, None) is False
    assert len(calls) == 3
    assert all(len(a) == len(b) == 64 for a, b in calls)


@pytest.mark.parametrize("name", ["alice", "a", "ci-runner", "bob@lab", "team.gpu_01",
                                  "x" * 64])
def test_good_names(name: str) -> None:
    check_token_name(name)


@pytest.mark.parametrize(("name", "why"), [
    ("", "empty"), ("x" * 65, "at most 64"), ("alice smith", "only letters"),
    ("al/ice", "only letters"), ("é", "only letters"), ("a\n", "only letters"),
    (LOCAL_ADMIN, "reserved"),
])
def test_bad_names_say_why(name: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_token_name(name)


def test_the_daemon_may_use_the_reserved_name() -> None:
    check_token_name(LOCAL_ADMIN, allow_reserved=True)


def test_roles() -> None:
    check_role("user")
    check_role("admin")
    with pytest.raises(ValueError, match="user, admin"):
        check_role("root")


@pytest.mark.parametrize(("text", "seconds"), [
    ("30d", 30 * 86400), ("12h", 12 * 3600), ("90m", 90 * 60), ("45s", 45), ("2w", 14 * 86400),
    ("30D", 30 * 86400), (" 7d ", 7 * 86400),
])
def test_durations(text: str, seconds: int) -> None:
    assert parse_expiry(text, now=NOW) == NOW + seconds


def test_never() -> None:
    assert parse_expiry("never", now=NOW) is None
    assert parse_expiry("NEVER", now=NOW) is None


def test_iso_dates() -> None:
    # A bare date is the start of that day in the server's local time.
    assert parse_expiry("2027-03-01", now=NOW) == datetime(2027, 3, 1).timestamp()
    assert parse_expiry("2027-03-01T12:30:00Z", now=NOW) == datetime(
        2027, 3, 1, 12, 30, tzinfo=UTC).timestamp()
    assert parse_expiry("2027-03-01T12:30+02:00", now=NOW) == datetime(
        2027, 3, 1, 10, 30, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(("text", "why"), [
    ("", "empty"), ("soon", "neither a duration nor a date"), ("30x", "neither"),
    ("-5d", "neither"), ("0d", "more than 0"), ("2020-01-01", "in the past"),
    ("99999999999d", "too far"), ("2027-02-30", "neither"),
])
def test_bad_expiry_says_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_expiry(text, now=NOW)


def test_format_utc() -> None:
    ts = datetime(2026, 11, 20, 14, 3, 59, tzinfo=UTC).timestamp()
    assert format_utc(ts) == "2026-11-20 14:03 UTC"
