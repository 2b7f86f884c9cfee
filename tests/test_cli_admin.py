"""The admin commands of `gpupoold` (gpupoold/cli.py, gpupoold/admin_client.py), through main().

`token ...` works on the database of a temporary state directory. `status`, `gpu ...` and
`lease end` talk to a small aiohttp server in a thread that fakes the daemon's HTTP API
(docs/api.md), so these tests depend only on the API's documented answers.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import pwd
import re
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web
from conftest import GpupoolServer, require

from gpupoold.auth.authenticator import LOCAL_ADMIN_FILE
from gpupoold.cli import build_parser, cli_actor, main
from gpupoold.config import file as config_mod
from gpupoold.store.database import DB_NAME, StoreDB

TOKEN_RE = re.compile(r"gpt_[0-9a-f]{12}_[A-Za-z0-9_-]{43}")
ADMIN = "gpt_aaaaaaaaaaaa_" + "A" * 43
USER = "gpt_bbbbbbbbbbbb_" + "B" * 43


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No /etc/gpupoold/gpupoold.toml and no admin token from the environment of the test run.
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG", tmp_path / "no-such-config.toml")
    monkeypatch.delenv("GPUPOOL_ADMIN_TOKEN", raising=False)


@dataclass
class Result:
    rc: int
    out: str
    err: str


Run = Callable[..., Result]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    def run(*argv: str | Path) -> Result:
        capsys.readouterr()
        rc = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return Result(rc, captured.out, captured.err)
    return run


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


def open_db(state: Path) -> StoreDB:
    return StoreDB(state / DB_NAME)


# ---------------------------------------------------------------------------- token commands
def test_token_create_prints_the_token_alone(run: Run, state: Path) -> None:
    r = run("token", "create", "--name", "alice", "--state-dir", state)
    assert r.rc == 0, r.err
    assert TOKEN_RE.fullmatch(r.out.strip()) and r.out.count("\n") == 1
    assert "shown only this once" in r.err and "alice" in r.err
    db = open_db(state)
    try:
        check = db.verify_token(r.out.strip())
        assert check.ok and check.token is not None
        assert (check.token.name, check.token.role, check.token.expires) == ("alice", "user", None)
        (entry,) = db.audit_log()
        assert (entry.actor, entry.action, entry.target) == (cli_actor(), "token.create",
                                                             "token alice")
        assert entry.actor.startswith("cli:")
    finally:
        db.close()


def test_token_create_with_role_expiry_and_json(run: Run, state: Path) -> None:
    before = time.time()
    r = run("token", "create", "--name", "ops", "--role", "admin", "--expires", "30d", "--json",
            "--state-dir", state)
    assert r.rc == 0, r.err
    data = json.loads(r.out)
    assert TOKEN_RE.fullmatch(data["secret"]) and "once" in data["note"]
    assert data["token"]["name"] == "ops" and data["token"]["role"] == "admin"
    assert before + 30 * 86400 <= data["token"]["expires"] <= time.time() + 30 * 86400
    assert "secret_sha256" not in data["token"]


def test_token_commands_read_the_state_dir_from_the_config(run: Run, tmp_path: Path) -> None:
    cfg = tmp_path / "gpupoold.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "from-config"}"\n')
    assert run("token", "create", "--name", "alice", "--config", cfg).rc == 0
    assert (tmp_path / "from-config" / DB_NAME).is_file()
    r = run("token", "list", "--config", cfg)
    assert r.rc == 0 and "alice" in r.out


@pytest.mark.parametrize(("args", "message"), [
    (("--name", "bad name"), "bad token name 'bad name': a token name may contain only"),
    (("--name", "local-admin"), "reserved for the daemon's own admin token"),
    (("--name", "x", "--expires", "soon"), "bad --expires 'soon'"),
    (("--name", "x", "--expires", "2001-01-01"), "in the past"),
    (("--name", "x", "--weight", "0"), "bad weight 0: a weight is a whole number from 1 to 1000"),
])
def test_token_create_refuses_bad_input(run: Run, state: Path, args: tuple[str, ...],
                                        message: str) -> None:
    r = run("token", "create", *args, "--state-dir", state)
    assert r.rc == 1 and r.out == ""
    assert message in r.err and r.err.startswith("gpupoold: error: ")
    assert not (state / DB_NAME).exists()  # refused before touching the database


def test_token_weight_at_creation_and_set_weight(run: Run, state: Path) -> None:
    """Issue 32, item 4: `--weight` and `token set-weight`; the list shows the weight."""
    assert run("token", "create", "--name", "heavy", "--weight", "3", "--state-dir", state).rc == 0
    assert run("token", "create", "--name", "light", "--state-dir", state).rc == 0
    r = run("token", "set-weight", "light", "2", "--state-dir", state)
    assert r.rc == 0 and "share weight 2" in r.out, r.err
    r = run("token", "list", "--json", "--state-dir", state)
    assert {t["name"]: t["weight"] for t in json.loads(r.out)["tokens"]} == {"heavy": 3, "light": 2}
    r = run("token", "set-weight", "nobody", "2", "--state-dir", state)
    assert r.rc == 1 and "no token named 'nobody'" in r.err


def test_token_create_refuses_a_taken_name(run: Run, state: Path) -> None:
    assert run("token", "create", "--name", "alice", "--state-dir", state).rc == 0
    assert run("token", "revoke", "alice", "--state-dir", state).rc == 0
    r = run("token", "create", "--name", "alice", "--state-dir", state)
    assert r.rc == 1 and r.out == ""
    assert "a token named 'alice' already exists" in r.err and "token list" in r.err


def test_list_and_revoke_do_not_create_a_database(run: Run, state: Path) -> None:
    for argv in (("token", "list"), ("token", "revoke", "alice")):
        r = run(*argv, "--state-dir", state)
        assert r.rc == 1 and f"there is no database {state / DB_NAME}" in r.err
        assert "check --state-dir" in r.err
    assert not state.exists()


def test_token_list_shows_every_token_and_its_state(run: Run, state: Path) -> None:
    state.mkdir()
    StoreDB(state / DB_NAME).close()
    r = run("token", "list", "--state-dir", state)
    assert r.rc == 0 and "No tokens yet" in r.out
    for name, role in (("alice", "user"), ("ops", "admin"), ("old", "user")):
        assert run("token", "create", "--name", name, "--role", role, "--state-dir", state).rc == 0
    assert run("token", "revoke", "old", "--state-dir", state).rc == 0
    db = open_db(state)
    try:
        ids = {t.name: t.id for t in db.list_tokens()}
        db.create_token("gone", "user", time.time() - 10, "test")  # already expired
    finally:
        db.close()
    r = run("token", "list", "--state-dir", state)
    assert r.rc == 0
    lines = r.out.splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "ID", "CREATED", "EXPIRES", "LAST", "USED",
                                "WEIGHT", "STATE"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["alice"][1] == "user" and rows["alice"][2] == ids["alice"]
    assert rows["alice"][-1] == "valid" and rows["ops"][1] == "admin"
    assert rows["alice"][-2] == "1"  # the share weight, 1 unless set
    assert rows["old"][-1] == "revoked" and rows["gone"][-1] == "expired"
    assert "never" in rows["alice"]
    r = run("token", "list", "--json", "--state-dir", state)
    data = json.loads(r.out)
    assert [t["name"] for t in data["tokens"]] == ["alice", "ops", "old", "gone"]
    assert all("secret" not in json.dumps(t) for t in data["tokens"])


def test_token_revoke(run: Run, state: Path) -> None:
    token = run("token", "create", "--name", "alice", "--state-dir", state).out.strip()
    r = run("token", "revoke", "alice", "--state-dir", state)
    assert r.rc == 0 and "Revoked user token 'alice'" in r.out
    db = open_db(state)
    try:
        assert db.verify_token(token).result == "revoked"
        revoked_at = db.get_token("alice").revoked
    finally:
        db.close()
    r = run("token", "revoke", "alice", "--state-dir", state)
    assert r.rc == 0 and "already revoked" in r.out
    db = open_db(state)
    try:
        assert db.get_token("alice").revoked == revoked_at
        assert [a.action for a in db.audit_log()].count("token.revoke") == 1
    finally:
        db.close()
    r = run("token", "revoke", "nobody", "--state-dir", state)
    assert r.rc == 1 and "no token named 'nobody'" in r.err


def test_token_create_works_while_the_daemon_has_the_database_open(run: Run,
                                                                     state: Path) -> None:
    state.mkdir()
    daemon = open_db(state)  # another connection, as the running daemon's
    try:
        daemon.audit("gpupoold", "gpu.drain", "gpu 0")  # the daemon has written
        r = run("token", "create", "--name", "alice", "--state-dir", state)
        assert r.rc == 0
        assert daemon.verify_token(r.out.strip()).ok  # the daemon sees it at once
    finally:
        daemon.close()


@dataclass
class Child:
    """What a command run in a forked child as another user did."""

    rc: int
    out: str
    err: str


# What the commands import late, imported here: the child runs as a user who may not read this
# interpreter's standard library (here under /root, 0700).
for _late in ("encodings.idna", "gpupoold.tls_identity"):
    importlib.import_module(_late)


def as_user(uid: int, gid: int, argv: list[str | Path]) -> Child:
    """`gpupoold ARGV` through main() in a forked child with this uid and gid and no other
    groups, as `setpriv --reuid --regid --clear-groups` would run it (we are root). A forked
    child, not a new process: the venv's interpreter may live where other users cannot run it
    (here under /root). An exception that escapes main() is printed, exit status 99."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 99
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = os.fdopen(1, "w", closefd=False)
                sys.stderr = os.fdopen(2, "w", closefd=False)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                code = main([str(a) for a in argv])
            except BaseException:  # noqa: B036 - the child must exit whatever happens
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return Child(os.waitstatus_to_exitcode(status), out.read(), err.read())


@dataclass
class Account:
    name: str
    uid: int
    gid: int


@pytest.fixture(scope="module")
def accounts() -> Iterator[tuple[Account, Account]]:
    """(the daemon's user, an unprivileged user): two accounts made with useradd for this
    module, each with a group of its own, removed afterwards."""
    require(os.geteuid() == 0, "running a command as another user needs root")
    require(shutil.which("useradd") and shutil.which("userdel"),
            "useradd and userdel are needed (Debian package passwd)")
    tag = f"{os.getpid() % 100000:05d}"
    made: list[Account] = []
    try:
        for name, extra in ((f"gpt-daemon-{tag}", ["--system"]), (f"gpt-user-{tag}", [])):
            subprocess.run(["useradd", *extra, "--user-group", "--no-create-home",
                            "--shell", "/usr/sbin/nologin", name], check=True,
                           capture_output=True, text=True)
            entry = pwd.getpwnam(name)
            made.append(Account(name, entry.pw_uid, entry.pw_gid))
        yield made[0], made[1]
    finally:
        for account in made:
            subprocess.run(["userdel", account.name], capture_output=True)


@pytest.fixture
def world_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A root-owned directory (0755) that every user can reach (pytest's tmp_path is not)."""
    path = Path(tempfile.mkdtemp(prefix="gpupool-cli-test-"))
    path.chmod(0o755)
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG", path / "no-such-config.toml")
    yield path
    shutil.rmtree(path)


def daemons_state(where: Path, owner: Account, mode: int = 0o750) -> Path:
    """A state directory as gpupoold leaves it (the package's: 0750, its files 0600, the
    identity in a 0700 folder), owned by `owner`."""
    state = where / "state"
    state.mkdir()
    state.chmod(mode)
    StoreDB(state / DB_NAME).close()
    (state / LOCAL_ADMIN_FILE).write_text(ADMIN + "\n")
    identity = state / "identity"
    identity.mkdir(mode=0o700)
    (identity / "server.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    for path in (state, *state.rglob("*")):
        os.chown(path, owner.uid, owner.gid)
        if path.is_file():
            path.chmod(0o600)
    return state


# Every admin command, as an operator would first type it on the server.
ADMIN_COMMANDS = [
    (["token", "create", "--name", "alice"], "gpupoold token create"),
    (["token", "list"], "gpupoold token list"),
    (["token", "revoke", "alice"], "gpupoold token revoke"),
    (["status"], "gpupoold status"),
    (["gpu", "drain", "0"], "gpupoold gpu drain"),
    (["gpu", "undrain", "0"], "gpupoold gpu undrain"),
    (["gpu", "clear", "1"], "gpupoold gpu clear"),
    (["lease", "end", "12"], "gpupoold lease end"),
    (["fingerprint"], "gpupoold fingerprint"),
    (["fingerprint", "--pem"], "gpupoold fingerprint"),
]
REMOTE = ("status", "gpu", "lease")


@pytest.mark.parametrize(("argv", "command"), ADMIN_COMMANDS,
                         ids=[" ".join(argv) for argv, _ in ADMIN_COMMANDS])
def test_each_admin_command_without_the_rights_says_so_in_one_line(
        accounts: tuple[Account, Account], world_dir: Path, daemon: FakeDaemon,
        argv: list[str], command: str) -> None:
    """As a user who is neither root nor the daemon's: one line naming the file it could not
    use and `sudo` with the command, exit status 1, never a traceback; nothing changed."""
    owner, user = accounts
    state = daemons_state(world_dir, owner)
    before = {p: p.stat().st_mtime_ns for p in state.rglob("*")}
    extra = ["--http", daemon.address] if argv[0] in REMOTE else []
    child = as_user(user.uid, user.gid, [*argv, "--state-dir", state, *extra])
    assert "Traceback" not in child.err, child.err
    assert child.rc == 1 and child.out == "", child
    assert child.err.count("\n") == 1 and child.err.startswith("gpupoold: error: "), child.err
    assert f"permission denied for {user.name}" in child.err, child.err
    assert f"run it with sudo (`sudo {command}`)" in child.err, child.err
    assert "GPUPOOL_TOKEN" not in child.err  # the admin commands read GPUPOOL_ADMIN_TOKEN
    if argv[0] in REMOTE:
        assert "GPUPOOL_ADMIN_TOKEN" in child.err, child.err
    # a group would not be enough (the files are the daemon user's only): none is named
    assert "member of the group" not in child.err
    assert {p: p.stat().st_mtime_ns for p in state.rglob("*")} == before


def test_a_group_that_would_do_is_named(accounts: tuple[Account, Account], world_dir: Path,
                                        daemon: FakeDaemon) -> None:
    """Where the group's members may read the file (an operator's choice: 0640), the message
    names that group besides sudo; a member then gets in."""
    owner, user = accounts
    state = daemons_state(world_dir, owner, mode=0o755)
    (state / LOCAL_ADMIN_FILE).chmod(0o640)
    argv: list[str | Path] = ["status", "--state-dir", state, "--http", daemon.address]
    child = as_user(user.uid, user.gid, argv)
    assert child.rc == 1 and child.err.count("\n") == 1, child
    assert (f"run it with sudo (`sudo gpupoold status`) or as a member of the group "
            f"{owner.name} (`sudo adduser {user.name} {owner.name}`" in child.err), child.err
    child = as_user(user.uid, owner.gid, argv)
    assert child.rc == 0 and "you are root (admin)" in child.out, child


def test_a_config_the_user_cannot_read_says_so(accounts: tuple[Account, Account],
                                               world_dir: Path) -> None:
    _, user = accounts
    config = world_dir / "gpupoold.toml"
    config.write_text('state_dir = "/nowhere"\n')
    config.chmod(0o600)
    for argv in (["token", "list"], ["status"], ["fingerprint"]):
        child = as_user(user.uid, user.gid, [*argv, "--config", config])
        assert child.rc == 1 and child.err.count("\n") == 1, child
        assert (f"cannot read the configuration {config}: permission denied for {user.name}; "
                f"run it with sudo (`sudo gpupoold {argv[0]}" in child.err), child.err


@pytest.mark.parametrize("sub", ["", "state"])
def test_a_state_dir_the_user_cannot_write_is_a_clear_error(
        accounts: tuple[Account, Account], world_dir: Path, sub: str) -> None:
    _, user = accounts
    target = world_dir / sub if sub else world_dir  # missing (cannot create) or not writable
    child = as_user(user.uid, user.gid,
                    ["token", "create", "--name", "alice", "--state-dir", target])
    assert child.rc == 1 and child.err.count("\n") == 1, child
    assert f"permission denied for {user.name}; run it with sudo" in child.err, child.err
    assert not (target / DB_NAME).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create files for another user")
def test_root_gives_a_new_database_to_the_state_dirs_owner(run: Run, state: Path) -> None:
    state.mkdir()
    os.chown(state, 65534, 65534)
    assert run("token", "create", "--name", "alice", "--state-dir", state).rc == 0
    st = (state / DB_NAME).stat()
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    assert stat.S_IMODE(st.st_mode) == 0o600


# ------------------------------------------------------------------- the fake daemon (API)
NOW = time.time()

GPUS: list[dict[str, Any]] = [
    {"index": 0, "name": "NVIDIA H100 80GB HBM3 (gpupool simulated)", "uuid": "GPU-0",
     "simulated": True, "state": "leased", "draining": False, "quarantine": None,
     "last_scrub": None, "memory_total": 80 << 30,
     "lease": {"id": 12, "gpu": 0, "token": "alice", "started": NOW - 125, "queued_s": 0.5,
               "client": {"host": "laptop", "user": "ada", "pid": 4242, "program": "train.py",
                          "peer": "10.0.0.5:5000"},
               "bytes_h2d": 1, "bytes_d2h": 2, "calls": {}}},
    {"index": 1, "name": "Tesla T4", "uuid": "GPU-1", "simulated": True, "state": "quarantined",
     "draining": False, "lease": None, "last_scrub": None, "memory_total": 16 << 30,
     "quarantine": {"reason": "scrub failed: verify", "since": NOW - 3600}},
    {"index": 2, "name": "NVIDIA A100", "uuid": "GPU-2", "simulated": False, "state": "free",
     "draining": False, "lease": None, "quarantine": None, "last_scrub": None,
     "memory_total": 40 << 30},
]
QUEUE = [{"position": 1, "ticket": 31, "token": "bob", "request": "GPU 1",
          "client": {"host": "box", "user": "bob", "pid": 7, "program": "x.py", "peer": "p"},
          "since": NOW - 12, "waiting_s": 12.0}]


@dataclass
class FakeDaemon:
    """The documented answers of the API, on a real socket, in a thread of its own."""

    ssl_context: ssl.SSLContext | None = None
    auth: str = "token"
    requests: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    def _caller(self, request: web.Request) -> tuple[str, str] | web.Response:
        header = request.headers.get("Authorization")
        self.requests.append({"method": request.method, "path": request.path_qs,
                              "authorization": header})
        if self.auth == "none":
            return "anonymous", "admin"
        if header == f"Bearer {ADMIN}":
            return "root", "admin"
        if header == f"Bearer {USER}":
            return "alice", "user"
        error = ("this endpoint needs an API token and the request has none" if header is None
                 else "the API token is not known to this server")
        return web.json_response({"error": error, "hint": "send Authorization: Bearer <token>"},
                                 status=401, headers={"WWW-Authenticate": "Bearer"})

    def _admin(self, request: web.Request) -> tuple[str, str] | web.Response:
        who = self._caller(request)
        if isinstance(who, tuple) and who[1] != "admin":
            return web.json_response(
                {"error": f"{request.method} {request.path} needs an admin token; token "
                          f"'{who[0]}' has the role '{who[1]}'", "hint": "use an admin token"},
                status=403)
        return who

    async def status(self, request: web.Request) -> web.Response:
        who = self._caller(request)
        if isinstance(who, web.Response):
            return who
        return web.json_response({
            "version": "9.9.9", "time": time.time(), "remoting": "0.0.0.0:7070",
            "auth": self.auth, "you": {"name": who[0], "role": who[1]}, "gpus": len(GPUS),
            "states": {"free": 1, "leased": 1, "scrubbing": 0, "quarantined": 1, "drained": 0},
            "leases": 1, "queue": len(QUEUE), "active_leases": [GPUS[0]["lease"]],
            "counters": {}})

    async def gpus(self, request: web.Request) -> web.Response:
        who = self._caller(request)
        return who if isinstance(who, web.Response) else web.json_response({"gpus": GPUS})

    async def queue(self, request: web.Request) -> web.Response:
        who = self._caller(request)
        return who if isinstance(who, web.Response) else web.json_response({"queue": QUEUE})

    async def gpu_action(self, request: web.Request) -> web.Response:
        who = self._admin(request)
        if isinstance(who, web.Response):
            return who
        index, action = int(request.match_info["index"]), request.match_info["action"]
        self.requests[-1]["body"] = await request.text()
        if index >= len(GPUS):
            return web.json_response({"error": f"no GPU {index}", "hint": "list GPUs"}, status=404)
        view = dict(GPUS[index])
        if action == "clear":
            if view["state"] != "quarantined":
                return web.json_response(
                    {"error": f"GPU {index} is not quarantined (it is {view['state']})",
                     "hint": "check the GPU's state with GET /api/v1/gpus"}, status=409)
            view.update(state="scrubbing", quarantine=None)
        elif action == "drain":
            if view["state"] == "free":
                view["state"] = "drained"
            view["draining"] = True
        else:
            view.update(state="free", draining=False)
        return web.json_response(view)

    async def end_lease(self, request: web.Request) -> web.Response:
        who = self._admin(request)
        if isinstance(who, web.Response):
            return who
        self.requests[-1]["body"] = await request.text()
        if request.match_info["id"] != "12":
            return web.json_response({"error": f"lease {request.match_info['id']} is not active",
                                      "hint": "list leases"}, status=404)
        return web.json_response(GPUS[0]["lease"], status=202)

    def serve(self) -> Iterator[FakeDaemon]:
        app = web.Application()
        app.router.add_get("/api/v1/status", self.status)
        app.router.add_get("/api/v1/gpus", self.gpus)
        app.router.add_get("/api/v1/queue", self.queue)
        app.router.add_post("/api/v1/gpus/{index}/{action}", self.gpu_action)
        app.router.add_post("/api/v1/leases/{id}/end", self.end_lease)
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app)
        started = threading.Event()
        stop = asyncio.Event()

        async def main() -> None:
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
            await site.start()
            self.port = runner.addresses[0][1]
            started.set()
            await stop.wait()
            await runner.cleanup()

        thread = threading.Thread(target=loop.run_until_complete, args=(main(),))
        thread.start()
        try:
            assert started.wait(30), "the fake daemon did not start"
            yield self
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(30)
            loop.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def daemon() -> Iterator[FakeDaemon]:
    yield from FakeDaemon().serve()


@pytest.fixture
def admin_state(state: Path) -> Path:
    """A state directory holding the local admin token, as the daemon leaves it."""
    state.mkdir()
    (state / LOCAL_ADMIN_FILE).write_text(ADMIN + "\n")
    return state


def test_status_prints_gpus_leases_and_queue(run: Run, daemon: FakeDaemon,
                                             admin_state: Path) -> None:
    r = run("status", "--http", daemon.address, "--state-dir", admin_state)
    assert r.rc == 0, r.err
    assert [q["authorization"] for q in daemon.requests] == [f"Bearer {ADMIN}"] * 3
    lines = r.out.splitlines()
    assert "gpupoold 9.9.9" in lines[0] and "you are root (admin)" in lines[0]
    table = {line.split()[0]: line for line in lines if line[:1].isdigit()}
    assert set(table) == {"0", "1", "2"}
    assert "leased" in table["0"] and "#12" in table["0"]
    assert "alice: ada@laptop pid 4242 (train.py)" in table["0"]
    # started 125 s before this module was imported (NOW), which may be minutes ago in a long run
    ago = re.search(r"\((\d+)m(\d+)s ago\)", table["0"])
    assert ago and int(ago[1]) * 60 + int(ago[2]) >= 125, table["0"]
    assert "quarantined" in table["1"] and "Tesla T4 [simulated]" in table["1"]
    assert "free" in table["2"] and "simulated" not in table["2"]
    assert ("GPU 1 is quarantined: scrub failed: verify; once fixed: `gpupoold gpu clear 1`"
            in r.out)
    assert "Leases: 1 active. Queue: 1 waiting." in r.out
    assert "1. bob: bob@box pid 7 (x.py) wants GPU 1, waiting 12s" in r.out


def test_status_json(run: Run, daemon: FakeDaemon, admin_state: Path) -> None:
    r = run("status", "--json", "--http", daemon.address, "--state-dir", admin_state)
    assert r.rc == 0, r.err
    data = json.loads(r.out)
    assert data["status"]["version"] == "9.9.9"
    assert [g["index"] for g in data["gpus"]] == [0, 1, 2] and data["queue"] == QUEUE


def test_token_precedence_flag_then_environment_then_file(
        run: Run, daemon: FakeDaemon, admin_state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    common = ("--json", "--http", daemon.address, "--state-dir", admin_state)
    monkeypatch.setenv("GPUPOOL_ADMIN_TOKEN", USER)
    assert run("status", *common).rc == 0
    assert daemon.requests[-1]["authorization"] == f"Bearer {USER}"
    assert run("status", "--token", ADMIN, *common).rc == 0
    assert daemon.requests[-1]["authorization"] == f"Bearer {ADMIN}"
    monkeypatch.delenv("GPUPOOL_ADMIN_TOKEN")
    r = run("status", *common)
    assert r.rc == 0 and json.loads(r.out)["status"]["you"]["name"] == "root"


def test_http_address_comes_from_the_config(run: Run, daemon: FakeDaemon, admin_state: Path,
                                            tmp_path: Path) -> None:
    cfg = tmp_path / "gpupoold.toml"
    # The daemon listens on every interface: the CLI reaches it on loopback.
    cfg.write_text(f'http = "0.0.0.0:{daemon.port}"\nstate_dir = "{admin_state}"\n')
    r = run("status", "--config", cfg)
    assert r.rc == 0, r.err
    assert f"at http://127.0.0.1:{daemon.port}" in r.out


def test_gpu_actions(run: Run, daemon: FakeDaemon, admin_state: Path) -> None:
    common = ("--http", daemon.address, "--state-dir", admin_state)
    r = run("gpu", "drain", "2", *common)
    assert r.rc == 0 and "GPU 2 is drained" in r.out and "gpupoold gpu undrain 2" in r.out
    r = run("gpu", "drain", "0", *common)
    assert r.rc == 0 and "will be drained when its current work ends (state now: leased)" in r.out
    r = run("gpu", "undrain", "2", *common)
    assert r.rc == 0 and "GPU 2 is back in service (state: free)" in r.out
    r = run("gpu", "clear", "1", *common)
    assert r.rc == 0 and "quarantine cleared" in r.out and "scrubbing" in r.out
    r = run("gpu", "clear", "1", "--json", *common)
    assert json.loads(r.out)["state"] == "scrubbing"
    assert [(q["method"], q["path"]) for q in daemon.requests] == [
        ("POST", "/api/v1/gpus/2/drain"), ("POST", "/api/v1/gpus/0/drain"),
        ("POST", "/api/v1/gpus/2/undrain"), ("POST", "/api/v1/gpus/1/clear"),
        ("POST", "/api/v1/gpus/1/clear")]


def test_gpu_action_refused_by_the_api_shows_its_error_and_hint(
        run: Run, daemon: FakeDaemon, admin_state: Path) -> None:
    common = ("--http", daemon.address, "--state-dir", admin_state)
    r = run("gpu", "clear", "2", *common)
    assert r.rc == 1 and r.out == ""
    assert r.err == ("gpupoold: error: GPU 2 is not quarantined (it is free); check the GPU's "
                     "state with GET /api/v1/gpus\n")
    r = run("gpu", "drain", "9", *common)
    assert r.rc == 1 and "no GPU 9" in r.err


def test_lease_end(run: Run, daemon: FakeDaemon, admin_state: Path) -> None:
    common = ("--http", daemon.address, "--state-dir", admin_state)
    r = run("lease", "end", "12", "--reason", "maintenance at 14:00", *common)
    assert r.rc == 0, r.err
    assert "Lease 12 on GPU 0 (token alice, ada@laptop pid 4242 (train.py)) is ending" in r.out
    assert daemon.requests[-1]["path"] == "/api/v1/leases/12/end"
    assert json.loads(daemon.requests[-1]["body"]) == {"reason": "maintenance at 14:00"}
    r = run("lease", "end", "12", *common)
    assert r.rc == 0 and json.loads(daemon.requests[-1]["body"]) == {}
    r = run("lease", "end", "13", *common)
    assert r.rc == 1 and "lease 13 is not active" in r.err


def test_a_user_token_on_an_admin_action_is_403(run: Run, daemon: FakeDaemon,
                                                admin_state: Path) -> None:
    r = run("gpu", "drain", "0", "--token", USER, "--http", daemon.address,
            "--state-dir", admin_state)
    assert r.rc == 1
    assert "needs an admin token; token 'alice' has the role 'user'" in r.err


def test_no_token_anywhere_says_where_it_looked(run: Run, daemon: FakeDaemon,
                                                state: Path) -> None:
    r = run("status", "--http", daemon.address, "--state-dir", state)
    assert r.rc == 1 and r.err.count("\n") == 1, r.err
    assert daemon.requests[-1]["authorization"] is None
    assert "needs an admin token and this command found none" in r.err
    assert f"{state / LOCAL_ADMIN_FILE} does not exist" in r.err
    assert "--state-dir" in r.err and "GPUPOOL_ADMIN_TOKEN" in r.err


def test_a_wrong_token_says_where_it_came_from(run: Run, daemon: FakeDaemon,
                                               admin_state: Path) -> None:
    bad = "gpt_cccccccccccc_" + "C" * 43
    r = run("status", "--token", bad, "--http", daemon.address, "--state-dir", admin_state)
    assert r.rc == 1 and r.err.count("\n") == 1, r.err
    assert "refused the admin token from --token: the API token is not known" in r.err
    assert bad not in r.err  # the token itself is not printed


def test_the_real_daemons_refusals_name_what_these_commands_read(
        run: Run, gpupool_server: GpupoolServer, state: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a real gpupoold (whose words are for remoting clients, GPUPOOL_TOKEN): one line,
    naming GPUPOOL_ADMIN_TOKEN and never GPUPOOL_TOKEN, each piece of advice once."""
    http = gpupool_server.http_url
    r = run("status", "--http", http, "--state-dir", state)  # no token anywhere
    assert r.rc == 1 and r.err.count("\n") == 1, r.err
    assert "GPUPOOL_ADMIN_TOKEN" in r.err and "GPUPOOL_TOKEN" not in r.err, r.err
    monkeypatch.setenv("GPUPOOL_ADMIN_TOKEN", "gpt_cccccccccccc_" + "C" * 43)
    r = run("status", "--http", http, "--state-dir", state)
    assert r.rc == 1 and r.err.count("\n") == 1, r.err
    assert ("refused the admin token from GPUPOOL_ADMIN_TOKEN: token gpt_cccccccccccc_... is not "
            "known to this server; set GPUPOOL_ADMIN_TOKEN to an admin token" in r.err), r.err
    assert "GPUPOOL_TOKEN" not in r.err and r.err.count("token create") == 1, r.err
    monkeypatch.setenv("GPUPOOL_ADMIN_TOKEN", gpupool_server.token)  # a user token: 403
    r = run("gpu", "drain", "0", "--http", http, "--state-dir", state)
    assert r.rc == 1 and r.err.count("\n") == 1 and "needs an admin token" in r.err, r.err


def test_auth_none_needs_no_token(run: Run, admin_state: Path, state: Path) -> None:
    (admin_state / LOCAL_ADMIN_FILE).unlink()
    for daemon in FakeDaemon(auth="none").serve():
        r = run("status", "--http", daemon.address, "--state-dir", state)
        assert r.rc == 0, r.err
        assert "you are anonymous (admin)" in r.out


def test_daemon_not_running(run: Run, admin_state: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run("status", "--http", f"127.0.0.1:{port}", "--state-dir", admin_state)
    assert r.rc == 1
    assert f"cannot reach gpupoold at http://127.0.0.1:{port}: connection refused" in r.err
    assert "is gpupoold running? `systemctl status gpupoold`" in r.err


def test_bad_http_address(run: Run, admin_state: Path) -> None:
    r = run("status", "--http", "nowhere", "--state-dir", admin_state)
    assert r.rc == 1 and "setting 'http'" in r.err and "HOST:PORT" in r.err
    r = run("status", "--http", "ftp://x:1", "--state-dir", admin_state)
    assert r.rc == 1 and "not an http:// or https:// address" in r.err


# ----------------------------------------------------------------------------------- HTTPS
@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_daemon(ca: trustme.CA) -> Iterator[FakeDaemon]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    yield from FakeDaemon(ssl_context=ctx).serve()


def test_https_with_cacert(run: Run, tls_daemon: FakeDaemon, admin_state: Path, ca: trustme.CA,
                           tmp_path: Path) -> None:
    ca_pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    url = f"https://{tls_daemon.address}"
    r = run("status", "--http", url, "--cacert", ca_pem, "--state-dir", admin_state)
    assert r.rc == 0, r.err
    assert f"at {url}" in r.out
    r = run("status", "--http", url, "--state-dir", admin_state)
    assert r.rc == 1
    assert "HTTPS certificate of gpupoold" in r.err and "--cacert" in r.err
    r = run("status", "--http", f"http://{tls_daemon.address}", "--state-dir", admin_state)
    assert r.rc == 1 and "https://" in r.err  # plain HTTP to an HTTPS port


def test_https_from_the_config_trusts_the_daemons_own_certificate(
        run: Run, ca: trustme.CA, admin_state: Path, tmp_path: Path) -> None:
    """On the server the config names the daemon's certificate (http_tls_cert): the CLI uses
    https and trusts that certificate without --cacert."""
    leaf = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    leaf.configure_cert(ctx)
    for daemon in FakeDaemon(ssl_context=ctx).serve():
        cfg = tmp_path / "gpupoold.toml"
        cfg.write_text(f'http = "{daemon.address}"\nhttp_tls_cert = "{cert}"\n'
                       f'http_tls_key = "{key}"\nstate_dir = "{admin_state}"\n')
        r = run("status", "--config", cfg)
        assert r.rc == 0, r.err
        assert f"at https://{daemon.address}" in r.out


def test_https_with_a_client_certificate(run: Run, ca: trustme.CA, admin_state: Path,
                                         tmp_path: Path) -> None:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    ca.configure_trust(ctx)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ca_pem, cert, key = tmp_path / "ca.pem", tmp_path / "me.pem", tmp_path / "me.key"
    ca.cert_pem.write_to_path(str(ca_pem))
    mine = ca.issue_cert("admin@example.org")
    mine.cert_chain_pems[0].write_to_path(str(cert))
    mine.private_key_pem.write_to_path(str(key))
    for daemon in FakeDaemon(ssl_context=ctx).serve():
        url = f"https://{daemon.address}"
        common = ("--http", url, "--cacert", ca_pem, "--state-dir", admin_state)
        r = run("status", "--cert", cert, "--key", key, *common)
        assert r.rc == 0, r.err
        r = run("status", *common)
        assert r.rc == 1 and "--cert and --key" in r.err
        r = run("status", "--cert", tmp_path / "missing.pem", *common)
        assert r.rc == 1 and "cannot use the client certificate --cert" in r.err


def test_every_admin_command_has_help() -> None:
    parser = build_parser()
    for argv in (["token", "create", "--name", "x"], ["token", "list"], ["token", "revoke", "x"],
                 ["status"], ["gpu", "drain", "0"], ["gpu", "undrain", "1"], ["gpu", "clear", "2"],
                 ["lease", "end", "3"]):
        args = parser.parse_args(argv)
        assert args.command == argv[0]
    with pytest.raises(SystemExit):
        parser.parse_args(["gpu", "drain", "zero"])
