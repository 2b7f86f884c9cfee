"""Token authentication and the local admin token (gpupoold/auth/authenticator.py)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpupoold.auth.authenticator import (
    LOCAL_ADMIN_FILE,
    AcceptAnyToken,
    AuthDecision,
    NoAuthentication,
    TokenAuthenticator,
    ensure_local_admin_token,
    write_secret_file,
)
from gpupoold.store import tokens
from gpupoold.store.database import Store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = await Store.open(tmp_path / "gpupoold.db")
    yield s
    await s.close()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def other_secret(text: str) -> str:
    """The same token id with a different (valid-looking) secret."""
    return text[:-1] + ("B" if text[-1] != "B" else "C")


async def test_a_valid_token_is_accepted_with_its_identity(store: Store) -> None:
    rec, text = await store.create_token("alice", "admin", None, actor="t")
    decision = await TokenAuthenticator(store).check(text, "10.0.0.5:5000")
    assert decision == AuthDecision(ok=True, identity="alice", role="admin", token_id=rec.id)


async def test_refusals_say_what_happened_and_what_to_do(store: Store) -> None:
    auth = TokenAuthenticator(store)
    _, good = await store.create_token("bob", "user", None, actor="t")

    missing = await auth.check("", "peer")
    assert (missing.ok, missing.reason) == (False, "missing")
    assert "requires a token" in missing.message and "GPUPOOL_TOKEN" in missing.message
    assert "gpupoold token create --name NAME" in missing.message

    malformed = await auth.check("hunter2", "peer")
    assert (malformed.ok, malformed.reason) == (False, "malformed")
    assert "malformed" in malformed.message and "gpt_<12 hex digits>" in malformed.message
    assert "hunter2" not in malformed.message  # a mistyped secret is not echoed

    unknown = await auth.check("gpt_0123456789ab_" + "x" * 43, "peer")
    assert (unknown.ok, unknown.reason, unknown.token_id) == (False, "unknown", "0123456789ab")
    assert "gpt_0123456789ab_..." in unknown.message and "not known" in unknown.message

    wrong = await auth.check(other_secret(good), "peer")
    assert (wrong.ok, wrong.reason, wrong.identity) == (False, "unknown", "")
    assert "bob" not in wrong.message


async def test_revoked_and_expired_tokens_name_the_date(store: Store) -> None:
    auth = TokenAuthenticator(store)
    _, gone = await store.create_token("alice", "user", None, actor="t")
    rec = await store.revoke_token("alice", actor="t")
    assert rec.revoked is not None
    revoked = await auth.check(gone, "peer")
    assert (revoked.ok, revoked.reason, revoked.identity) == (False, "revoked", "alice")
    assert revoked.message == (f"token 'alice' was revoked on {tokens.format_utc(rec.revoked)}; "
                               "ask the operator for a new one")

    when = time.time() - 86400
    _, old = await store.create_token("carol", "user", when, actor="t")
    expired = await auth.check(old, "peer")
    assert (expired.ok, expired.reason, expired.identity) == (False, "expired", "carol")
    assert f"expired on {tokens.format_utc(when)}" in expired.message
    assert "ask the operator for a new one" in expired.message


async def test_unknown_ids_cost_a_constant_time_comparison(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = tokens.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(len(a))
        return real(a, b)

    monkeypatch.setattr(tokens.hmac, "compare_digest", counting)
    _, good = await store.create_token("alice", "user", None, actor="t")
    auth = TokenAuthenticator(store)
    assert (await auth.check("gpt_ffffffffffff_" + "z" * 43, "peer")).reason == "unknown"
    assert calls == [64]  # compared against the dummy hash, like a known id would be
    assert (await auth.check(other_secret(good), "peer")).reason == "unknown"
    assert (await auth.check(good, "peer")).ok
    assert calls == [64, 64, 64]
    assert (await auth.check("not a token", "peer")).reason == "malformed"
    assert len(calls) == 3  # nothing to compare: the format alone refuses it


async def test_last_used_is_written_at_most_once_per_interval(store: Store) -> None:
    rec, text = await store.create_token("alice", "user", None, actor="t")
    clock = FakeClock()
    auth = TokenAuthenticator(store, touch_interval=60, clock=clock)
    writes: list[str] = []
    real_touch = store.touch_token

    async def counting_touch(token_id: str, when: float) -> None:
        writes.append(token_id)
        await real_touch(token_id, when)

    store.touch_token = counting_touch  # type: ignore[method-assign]
    assert (await store.get_token("alice")).last_used is None
    for _ in range(5):
        assert (await auth.check(text, "peer")).ok
    await auth.flush()
    assert writes == [rec.id]
    first = (await store.get_token("alice")).last_used
    assert first is not None
    clock.now += 59
    assert (await auth.check(text, "peer")).ok
    await auth.flush()
    assert writes == [rec.id]
    clock.now += 2
    assert (await auth.check(text, "peer")).ok
    await auth.flush()
    assert writes == [rec.id, rec.id]
    assert (await store.get_token("alice")).last_used >= first
    # A refused token is never touched.
    await auth.check(other_secret(text), "peer")
    await auth.flush()
    assert len(writes) == 2


async def test_last_used_after_the_store_closed_is_dropped(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "gpupoold.db")
    _, text = await store.create_token("alice", "user", None, actor="t")
    auth = TokenAuthenticator(store)
    decision = await auth.check(text, "peer")
    await store.close()
    await auth.flush()  # the pending write meets a closed store: no error escapes
    assert decision.ok


async def test_no_authentication_lets_everyone_in_as_admin() -> None:
    for token in ("", "garbage", "gpt_0123456789ab_" + "x" * 43):
        decision = await NoAuthentication().check(token, "peer")
        assert decision == AuthDecision(ok=True, identity="anonymous", role="admin")
    assert AcceptAnyToken is NoAuthentication


async def test_local_admin_token_file(store: Store, tmp_path: Path) -> None:
    old_umask = os.umask(0)  # the file must be 0600 whatever the umask
    try:
        path = await ensure_local_admin_token(store, tmp_path)
    finally:
        os.umask(old_umask)
    assert path == str(tmp_path / LOCAL_ADMIN_FILE)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600
    text = Path(path).read_text()
    assert text.endswith("\n")
    decision = await TokenAuthenticator(store).check(text.strip(), "local")
    assert (decision.ok, decision.identity, decision.role) == (True, "local-admin", "admin")


async def test_local_admin_token_is_rotated_at_every_start(store: Store, tmp_path: Path) -> None:
    auth = TokenAuthenticator(store)
    path = Path(await ensure_local_admin_token(store, tmp_path))
    first = path.read_text().strip()
    path.chmod(0o644)  # somebody loosened it: the rewrite restores 0600
    await ensure_local_admin_token(store, tmp_path)
    second = path.read_text().strip()
    assert first != second
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (await auth.check(first, "local")).reason == "unknown"
    assert (await auth.check(second, "local")).ok
    assert [t.name for t in await store.list_tokens()] == ["local-admin"]
    assert [a.action for a in await store.audit_log()] == ["token.rotate", "token.create"]
    assert sorted(p.name for p in tmp_path.iterdir() if "local-admin" in p.name) == [
        LOCAL_ADMIN_FILE]  # no temporary file left behind


def test_write_secret_file_failure_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="cannot write .*must be writable"):
        write_secret_file(tmp_path / "missing-dir" / "x.token", "secret\n")
    assert list(tmp_path.iterdir()) == []


def test_write_secret_file_replaces_a_symlink_rather_than_following_it(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    link = tmp_path / LOCAL_ADMIN_FILE
    link.symlink_to(target)
    write_secret_file(link, "new\n")
    assert target.read_text() == "keep"
    assert not link.is_symlink() and link.read_text() == "new\n"

