"""Private command lines (pool/privacy.py): the program's name for other tenants, the whole line
for its owner and admins. The end-to-end check over every view is
tests/test_e2e_private_commands.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gpupoold.pool.privacy import private_view, program_name, sees_arguments
from gpupoold.pool.waitqueue import ClientInfo

SECRET = "--api-key=SECRET123"


@pytest.mark.parametrize("command, name", [
    (f"train.py {SECRET}", "train.py"),
    (f"/opt/venv/bin/python3 train.py {SECRET}", "python3"),
    ("prog", "prog"),
    ("  prog\t--x=1", "prog"),
    ("", ""),
    ("   ", ""),
    ("dir/", ""),
])
def test_program_name_is_the_first_word_without_its_folder(command: str, name: str) -> None:
    assert program_name(command) == name


@pytest.mark.parametrize("viewer, role, owner, sees", [
    ("alice", "user", "alice", True),  # the owner
    ("bob", "user", "alice", False),  # another tenant
    ("root", "admin", "alice", True),  # an admin
    ("anonymous", "anonymous", "anonymous", False),  # http_anonymous_read, whatever the owner
    ("", "", "", False),  # an unnamed caller (a route with no token)
    ("alice", "", "alice", False),  # no role: not a checked token
])
def test_owner_and_admins_see_the_arguments(viewer: str, role: str, owner: str,
                                            sees: bool) -> None:
    assert sees_arguments(viewer, role, owner) is sees


def views() -> dict[str, Any]:
    """The shapes the adapters serialise: a live lease view (token + client), a queue entry, a
    stored lease record merged with its live view (token_name), a dashboard history row."""
    return {
        "gpus": [{"index": 0, "lease": {"id": 1, "token": "alice",
                                        "client": {"host": "h", "program": f"a {SECRET}"}}}],
        "queue": [{"position": 1, "token": "bob", "client": {"program": f"b {SECRET}"}}],
        "leases": [{"id": 2, "token_name": "alice", "program": f"/x/c {SECRET}",
                    "client": {"program": f"/x/c {SECRET}"}}],
        "rows": [{"id": 3, "token": "carol", "program": f"d {SECRET}"}],
        "orphan": {"program": f"e {SECRET}"},
    }


def test_another_tenant_sees_names_only_and_the_data_is_not_changed() -> None:
    data = views()
    before = copy.deepcopy(data)
    seen = private_view(data, "mallory", "user")
    assert SECRET not in repr(seen)
    assert seen["gpus"][0]["lease"]["client"]["program"] == "a"
    assert seen["leases"][0]["program"] == "c"
    assert seen["orphan"] == {"program": "e"}
    assert data == before  # the shared views the next caller gets are intact


def test_the_owner_sees_its_own_arguments_only() -> None:
    seen = private_view(views(), "alice", "user")
    assert seen["gpus"][0]["lease"]["client"]["program"] == f"a {SECRET}"
    assert seen["leases"][0]["program"] == f"/x/c {SECRET}"
    assert seen["leases"][0]["client"]["program"] == f"/x/c {SECRET}"
    assert seen["queue"][0]["client"]["program"] == "b"
    assert seen["rows"][0]["program"] == "d"
    assert seen["orphan"] == {"program": "e"}  # no owner: nobody's but the admins'


def test_admins_see_everything_and_anonymous_readers_names_only() -> None:
    assert private_view(views(), "root", "admin") == views()
    assert SECRET not in repr(private_view(views(), "alice", "anonymous"))


def test_log_lines_carry_the_program_name_only() -> None:
    c = ClientInfo(host="h", user="u", pid=7, program=f"/usr/bin/train {SECRET}",
                   peer="10.0.0.2:1")
    assert c.describe() == "u@h pid 7 (train) from 10.0.0.2:1"
    assert c.to_json()["program"] == f"/usr/bin/train {SECRET}"  # the record keeps it
    assert ClientInfo(host="h", user="u", pid=7, program="", peer="p").describe() == \
        "u@h pid 7 (?) from p"
