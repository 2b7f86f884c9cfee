"""What one tenant sees of another's command line: the program's name, never its arguments.

A client reports its whole command line as its `program` (the shim sends argv[0]'s base name and
the arguments, up to 1,023 bytes), and arguments hold secrets (`--api-key=...`, database URLs).
The lease's owner (the same token) and admins see all of it; everyone else (another token, the
anonymous reader of `http_anonymous_read`) sees `program_name` only. Every adapter that shows a
lease or a waiter (the info reply, the HTTP API, the dashboard) passes its views through
`private_view` for the viewer it answers; log lines carry the name only (ClientInfo.describe).
The store keeps the whole command line: it is what the owner's and the admins' views read.
docs/security.md, "What a tenant can do", is the promise this keeps.
"""

from __future__ import annotations

from typing import Any, TypeVar

ADMIN = "admin"
USER = "user"

T = TypeVar("T")


def program_name(command: str) -> str:
    """The program's name of a reported command line: its first word, without a folder (the shim
    sends argv[0]'s base name already; other clients may send a path). "" for an empty line."""
    words = command.split(maxsplit=1)
    return words[0].rsplit("/", 1)[-1] if words else ""


def sees_arguments(viewer: str, role: str, owner: str) -> bool:
    """Whether the viewer (a token name and its role) sees the arguments of a command line run
    with the token `owner`: admins do, and a user token sees its own. The anonymous reader and a
    refused or unnamed caller never do, whatever the owner's name."""
    if role == ADMIN:
        return True
    return role == USER and bool(viewer) and viewer == owner


def private_view(data: T, viewer: str, role: str) -> T:
    """`data` (JSON-like: dicts, lists, scalars) as the viewer may see it: every `program` whose
    owner the viewer is not reduced to its name. The owner of a `program` is the `token` (a live
    view) or `token_name` (a stored lease record) of its own dict or of the nearest dict around
    it; a `program` with no owner is reduced for everyone but admins. `data` is not changed; an
    admin gets it back as it is."""
    if role == ADMIN:
        return data
    return _walk(data, viewer, role, "")  # type: ignore[no-any-return]


def _walk(value: Any, viewer: str, role: str, owner: str) -> Any:
    if isinstance(value, list):
        return [_walk(v, viewer, role, owner) for v in value]
    if not isinstance(value, dict):
        return value
    here = value.get("token_name", value.get("token", owner))
    here = here if isinstance(here, str) else owner
    out = {k: _walk(v, viewer, role, here) for k, v in value.items()}
    program = out.get("program")
    if isinstance(program, str) and not sees_arguments(viewer, role, here):
        out["program"] = program_name(program)
    return out
