"""Who may use gpupoold: the check the remoting handshake and the HTTP API make on a token.

`TokenAuthenticator` (setting `auth = "token"`) checks API tokens against the store (store/tokens.py
says how: hashed secrets, constant-time comparison) and answers an `AuthDecision` whose `message`
tells a refused client what happened and what to do. A token the store refused is refused from
memory for a while (auth/refused.py), so that a flood of it costs the store nothing.
`NoAuthentication` (`auth = "none"`) lets everyone in as the admin "anonymous".

The daemon's own admin token, `local-admin`, is replaced at every start and written to
`<state_dir>/local-admin.token` (mode 0600) for the admin commands run on the server
(`gpupoold status`, `gpupoold gpu ...`): `ensure_local_admin_token`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpupoold.auth.refused import STORE_REASONS, RefusedTokens
from gpupoold.config.identity import server_name
from gpupoold.store.database import Store, StoreClosed, TokenCheck
from gpupoold.store.tokens import FORMAT_TEXT, LOCAL_ADMIN, PREFIX, format_utc

log = logging.getLogger("gpupoold.auth")

LOCAL_ADMIN_FILE = "local-admin.token"
TOUCH_INTERVAL = 60.0  # seconds: a token's last_used is written at most this often
ANONYMOUS = "anonymous"
CREATE_HINT = "an operator creates one with `gpupoold token create --name NAME`"


@dataclass(frozen=True)
class AuthDecision:
    ok: bool
    identity: str = ""  # the token name, for logs, lease records and the API
    role: str = ""  # user | admin
    token_id: str = ""  # the 12 hex digits of the token (safe to log)
    reason: str = ""  # missing | malformed | unknown | revoked | expired (when refused)
    message: str = ""  # for the client: what happened and what to do
    remembered: bool = False  # refused from memory (auth/refused.py), the store not asked


class Authenticator(Protocol):
    async def check(self, token: str, peer: str) -> AuthDecision: ...


def decide(check: TokenCheck) -> AuthDecision:
    """The decision, and the words for the client, of a token check."""
    record = check.token
    if check.ok and record is not None:
        return AuthDecision(ok=True, identity=record.name, role=record.role, token_id=record.id)
    reason = check.result
    if reason == "missing":
        message = (f"this server requires a token: set GPUPOOL_TOKEN (HTTP: the header "
                   f"`Authorization: Bearer <token>`); {CREATE_HINT}")
    elif reason == "malformed":
        message = (f"the token is malformed: a token reads {FORMAT_TEXT}; check GPUPOOL_TOKEN "
                   "holds the whole token as `gpupoold token create` printed it")
    elif reason == "unknown":
        message = (f"token {PREFIX}{check.token_id}_... is not known to this server: check "
                   "GPUPOOL_TOKEN (the whole token, as printed when it was created) and that it "
                   f"was made on this server; else ask the operator for a new one ({CREATE_HINT})")
    elif reason == "revoked" and record is not None and record.revoked is not None:
        message = (f"token '{record.name}' was revoked on {format_utc(record.revoked)}; ask the "
                   "operator for a new one")
    elif reason == "expired" and record is not None and record.expires is not None:
        message = (f"token '{record.name}' expired on {format_utc(record.expires)}; ask the "
                   "operator for a new one")
    else:  # pragma: no cover - TokenCheck has no other results
        message = "the token was refused"
    return AuthDecision(ok=False, identity=record.name if record else "",
                        role=record.role if record else "", token_id=check.token_id,
                        reason=reason, message=message)


class TokenAuthenticator:
    """`auth = "token"`: every client and API call needs a valid token."""

    def __init__(self, store: Store, *, touch_interval: float = TOUCH_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._touch_interval = touch_interval
        self._clock = clock
        self._touched: dict[str, float] = {}  # token id -> clock() of the last write
        self._tasks: set[asyncio.Task[None]] = set()
        # The store's recent refusals, answered from memory (auth/refused.py).
        self.refused: RefusedTokens[AuthDecision] = RefusedTokens(clock=clock)

    async def check(self, token: str, peer: str) -> AuthDecision:
        remembered = self.refused.get(token)
        if remembered is not None:
            return remembered
        decision = decide(await self._store.verify_token(token))
        if decision.ok:
            self._note_use(decision.token_id)
        else:
            log.debug("token refused for %s: %s (%s)", peer, decision.reason,
                      decision.token_id or "no id")
            if decision.reason in STORE_REASONS:
                self.refused.put(token, dataclasses.replace(decision, remembered=True))
        return decision

    def _note_use(self, token_id: str) -> None:
        """Record last_used in the background, at most once per interval per token: an
        accepted request does not wait for a database write."""
        now = self._clock()
        last = self._touched.get(token_id)
        if last is not None and now - last < self._touch_interval:
            return
        self._touched[token_id] = now
        task = asyncio.get_running_loop().create_task(self._touch(token_id, time.time()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _touch(self, token_id: str, when: float) -> None:
        try:
            await self._store.touch_token(token_id, when)
        except StoreClosed:
            pass  # the daemon is stopping: last_used is a convenience, not a record
        except Exception:
            log.warning("could not record the last use of token %s", token_id, exc_info=True)

    async def flush(self) -> None:
        """Wait for the pending last_used writes (for shutdown and tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks))


class NoAuthentication:
    """`auth = "none"`: everyone, with or without a token, is the admin "anonymous"."""

    async def check(self, token: str, peer: str) -> AuthDecision:
        return AuthDecision(ok=True, identity=ANONYMOUS, role="admin")


AcceptAnyToken = NoAuthentication  # the pre-issue-4 name


def local_admin_name(store: Store, state_dir: Path) -> str:
    """`local-admin` in a store of this server's own (SQLite). In a shared one (PostgreSQL)
    each server has its own, `local-admin@NAME` (config/identity.py), or the servers would
    replace each other's at start."""
    return LOCAL_ADMIN if store.path is not None else f"{LOCAL_ADMIN}@{server_name(state_dir)}"


async def ensure_local_admin_token(store: Store, state_dir: Path) -> str:
    """Replace this server's local admin token (the previous one stops working; its name:
    local_admin_name) and write the new one to `<state_dir>/local-admin.token`, mode 0600.
    Returns the file's path (not the secret, so that logging the result is safe)."""
    _, text = await store.replace_token(local_admin_name(store, state_dir), "admin",
                                        actor="gpupoold")
    path = Path(state_dir) / LOCAL_ADMIN_FILE
    await asyncio.to_thread(write_secret_file, path, text + "\n")
    return str(path)


def write_secret_file(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, readable by this user only (0600): a reader sees the old
    file or the new one, never a partial one, and never a moment with looser permissions."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover of a crash
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror} (the state directory "
                                 "must be writable by the user gpupoold runs as)") from None
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
