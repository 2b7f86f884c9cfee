"""A fleet on three hosts: three gpupoold servers, each in a network namespace of its own with its
own address on a bridge, its own host name (a UTS namespace) and an /etc/hosts that names the
three (as a LAN's DNS would), each listening on every address (`0.0.0.0`), sharing one
PostgreSQL (reached through its Unix socket, which the namespaces share). A test where every
server shares 127.0.0.1 cannot tell "B's address" from "this machine's loopback": here it can.

- Admin actions for B sent to A's HTTPS API (drain, undrain, clear, lease end) act on B's GPU
  and lease, and on nothing of A's; the forward goes over HTTPS pinned to the certificate B
  registered.
- A client that names only A, pinned only to A, is redirected to B's GPU and reaches it with the
  pin A gave for B.
- The same for a lease of 2 GPUs (issue 37; A and B have 2 simulated GPUs each, C one): with one
  of A's GPUs leased, a `GPUPOOL_GPUS=2` client of A is sent to B at B's own address, where one
  worker serves it both of B's GPUs (its bytes exact on each and across a peer copy), while A's
  free GPU stays free. (The redirect reply and the client's pin check do not depend on the
  number of GPUs: the wrong pin below covers both.)
- A redirect to a server whose registered fingerprint is not the key it presents is refused
  before anything secret is sent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import REPO, ApiError, GpupoolServer, native_paths, require, wait_until
from test_e2e_leases import hold_gpu  # noqa: F401  (a fixture)

from gpupoold.config.identity import server_name
from gpupoold.gpu.sim import format_uuid, sim_uuid
from gpupoold.store.database import StoreDB
from gpupoold.tls_identity import ensure_identity

NET = "10.201.0"
HOSTS = {"a": 11, "b": 12, "c": 13}
GPUS = {"a": 2, "b": 2, "c": 1}  # simulated GPUs per host: A and B can serve a lease of 2
REMOTING_PORT, HTTP_PORT = 7070, 8080
MIB = 1 << 20
HOLD_GPUS = REPO / "tests" / "clients" / "hold_gpus.py"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
    return proc


class Lan:
    """A bridge in this namespace ({NET}.1) and one namespace per host ({NET}.11, .12, .13),
    each with a veth on the bridge; a hosts file naming the hosts. Removed by close()."""

    def __init__(self, folder: Path) -> None:
        tag = os.getpid() % 100000
        self.bridge = f"gpbr{tag}"
        self.ns = {h: f"gpf-{h}-{tag}" for h in HOSTS}
        self.hosts_file = folder / "hosts"
        self.hosts_file.write_text("127.0.0.1 localhost\n" + "".join(
            f"{NET}.{n} gpf-{h}\n" for h, n in HOSTS.items()))
        self._made: list[tuple[str, ...]] = []
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            self._made.append(("ip", "link", "del", self.bridge))
            sh("ip", "addr", "add", f"{NET}.1/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for h, n in HOSTS.items():
                ns, veth = self.ns[h], f"gv{h}{tag}"
                sh("ip", "netns", "add", ns)
                self._made.append(("ip", "netns", "del", ns))
                sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}b")
                sh("ip", "link", "set", veth, "netns", ns)
                sh("ip", "link", "set", f"{veth}b", "master", self.bridge, "up")
                sh("ip", "-n", ns, "addr", "add", f"{NET}.{n}/24", "dev", veth)
                sh("ip", "-n", ns, "link", "set", veth, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def wrapper(self, host: str) -> list[str]:
        """Run a command on `host`: its namespace, its host name, the LAN's hosts file."""
        return ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "--mount",
                "--propagation", "private", "sh", "-c",
                'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"', "sh",
                str(self.hosts_file), f"gpf-{host}"]

    def resolver(self) -> list[str]:
        """Run a command here (the client's machine, {NET}.1) with the LAN's hosts file."""
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$1" /etc/hosts && shift && exec "$@"', "sh",
                str(self.hosts_file)]

    def close(self) -> None:
        for cmd in reversed(self._made):  # the veths go with their namespaces
            sh(*cmd, check=False)
        self._made.clear()


@pytest.fixture
def lan(tmp_path: Path) -> Iterator[Lan]:
    require(os.geteuid() == 0, "network namespaces need root")
    require(shutil.which("ip") and shutil.which("unshare"), "ip (iproute2) and unshare "
            "(util-linux) make the hosts")
    made = Lan(tmp_path)
    yield made
    made.close()


@pytest.fixture
def socket_url(pg_server: Any, pg_url: str) -> str:
    """pg_url's database through the server's Unix socket: reachable from every namespace (a
    loopback address is not), and a local link (no sslmode needed)."""
    name = urllib.parse.urlsplit(pg_url).path.lstrip("/")
    return f"postgresql://gpupool@/{name}?host={pg_server.dir}&port={pg_server.port}"


@pytest.fixture
def hosts(lan: Lan, socket_url: str, pg_url: str, native_build: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, GpupoolServer]]:
    state_dirs = {h: tmp_path_factory.mktemp(f"gpupoold-{h}") for h in HOSTS}
    # B's GPU was quarantined before its start (a failed scrub last time): something to clear.
    # Its UUID is the one B's server (its host name and state dir) gives its simulated GPU 0.
    db = StoreDB(pg_url)
    try:
        uuid = format_uuid(sim_uuid(server_name(state_dirs["b"], host="gpf-b"), 0))
        db.save_gpu_states({uuid: {"draining": False, "quarantine": {
            "reason": "test: a scrub failed", "since": 1.0}}}, [uuid])
    finally:
        db.close()
    servers: dict[str, GpupoolServer] = {}
    try:
        for h, n in HOSTS.items():
            args = ["--listen", f"0.0.0.0:{REMOTING_PORT}", "--http", f"0.0.0.0:{HTTP_PORT}",
                    "--simulated", str(GPUS[h]), *native_paths(native_build), "--database", socket_url]
            servers[h] = GpupoolServer(args, state_dirs[h], native_build, wrapper=lan.wrapper(h),
                                       public_host=f"{NET}.{n}")
        yield servers
    finally:
        problems = []
        for s in servers.values():
            if s.running and s.stop() != 0:
                problems.append(f"gpupoold exited with {s.returncode} on SIGTERM")
            s.reap_group()
            problems += s.problems()
        assert not problems, problems


def names(server: GpupoolServer) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in server.get_json("/api/v1/servers")["servers"]}


def gpu0(server: GpupoolServer) -> dict[str, Any]:
    return server.get_json("/api/v1/gpus")["gpus"][0]


def client(lan: Lan, server: GpupoolServer, hold_gpu: Path, hold_ms: int, seed: int,  # noqa: F811
           env: dict[str, str] | None = None, loops: int = 0) -> subprocess.Popen[str]:
    """hold_gpu on the client's machine (this namespace, the LAN's names); loops -1: copying
    all along, so that it notices at once when its lease is ended."""
    return subprocess.Popen([*lan.resolver(), str(hold_gpu), str(MIB), str(hold_ms), str(seed),
                             str(loops)],
                            env=server.client_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def gpu_states(server: GpupoolServer) -> list[str]:
    return [g["state"] for g in server.get_json("/api/v1/gpus")["gpus"]]


def hold_gpus(lan: Lan, server: GpupoolServer, n: int,
              env: dict[str, str]) -> subprocess.Popen[str]:
    """tests/clients/hold_gpus.py for `n` GPUs on the client's machine: prints `holding` once
    its bytes are on every device, checks them (and a peer copy) when a line comes on stdin."""
    return subprocess.Popen([*lan.resolver(), sys.executable, str(HOLD_GPUS), str(n), str(MIB)],
                            env=server.client_env(env), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def active(server: GpupoolServer) -> list[dict[str, Any]]:
    """The server's own active leases (the store's lease list is the whole fleet's)."""
    me = next(k for k, v in names(server).items() if v["this"])
    return [x for x in server.get_json("/api/v1/leases?state=active")["leases"]
            if x["server"] == me]


def test_three_hosts_act_on_each_others_gpus_and_redirect_only_with_the_right_pin(
        lan: Lan, hosts: dict[str, GpupoolServer], hold_gpu: Path,  # noqa: F811
        pg_url: str, tmp_path: Path, clients: list[subprocess.Popen[str]]) -> None:
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    fleet = wait_until("three servers up", lambda: (
        n := names(a), len(n) == 3 and all(v["state"] == "up" for v in n.values()) and n)[-1])
    name = {h: next(k for k, v in names(s).items() if v["this"]) for h, s in hosts.items()}
    assert name["b"].startswith("gpf-b-")
    # What each registered: its own name and addresses, never a wildcard or loopback address.
    with_pins = StoreDB(pg_url)
    try:
        rows = {r["name"]: r for r in with_pins.servers()}
    finally:
        with_pins.close()
    for h, s in hosts.items():
        row = rows[name[h]]
        assert row["remoting"] == f"gpf-{h}:{REMOTING_PORT}"
        assert row["http_address"] == f"gpf-{h}:{HTTP_PORT}" and row["http_scheme"] == "https"
        assert row["fingerprint"] == s.fingerprint
        # The HTTPS listener presents the same identity as the remoting port.
        assert row["http_fingerprint"] == s.fingerprint
    assert len(fleet) == 3

    # ------------------------------------------------------------- clear, drain, undrain via A
    assert gpu0(b)["state"] == "quarantined" and gpu0(a)["state"] == "free"
    reply = a.api("POST", f"/api/v1/servers/{name['b']}/gpus/0/clear")
    assert reply["server"] == name["b"]
    wait_until("B's GPU scrubbed and free", lambda: gpu0(b)["state"] == "free", timeout=30)
    assert gpu0(b)["quarantine"] is None
    reply = a.api("POST", f"/api/v1/servers/{name['b']}/gpus/0/drain")
    assert reply["server"] == name["b"] and reply["draining"] is True
    assert gpu0(b)["draining"] is True and gpu0(a)["draining"] is False
    assert gpu0(c)["draining"] is False
    reply = a.api("POST", f"/api/v1/servers/{name['b']}/gpus/0/undrain")
    assert reply["server"] == name["b"] and gpu0(b)["draining"] is False
    # An index that is not a number is refused at A, before anything is forwarded.
    with pytest.raises(ApiError) as bad:
        a.api("POST", f"/api/v1/servers/{name['b']}/gpus/0x0/drain")
    assert bad.value.status == 400
    # The shared audit log: B recorded what it did, under the caller's name; A did nothing.
    audit = a.get_json("/api/v1/audit")["audit"]
    actions = [(r["server"], r["action"], r["actor"]) for r in audit
               if r["action"].startswith("gpu.")]
    assert sorted(actions) == sorted((name["b"], f"gpu.{x}", f"local-admin@{name['a']}")
                                     for x in ("clear", "drain", "undrain")), actions
    assert gpu0(a)["state"] == "free" and gpu0(a)["draining"] is False

    # ------------------------------------------------------------------- end B's lease via A
    on_a = client(lan, a, hold_gpu, 60_000, 1)
    on_b = client(lan, b, hold_gpu, 60_000, 2, loops=-1)
    clients += [on_a, on_b]
    lease_a = wait_until("a lease on A", lambda: active(a))[0]
    lease_b = wait_until("a lease on B", lambda: active(b))[0]
    reply = a.api("POST", f"/api/v1/servers/{name['b']}/leases/{lease_b['id']}/end",
                  {"reason": "test"})
    assert reply["server"] == name["b"]
    _, err = on_b.communicate(timeout=60)
    assert on_b.returncode != 0 and "ended" in err, err
    wait_until("B's lease ended", lambda: not active(b))
    assert [x["id"] for x in active(a)] == [lease_a["id"]]
    assert on_a.poll() is None

    # ----------------------- a lease of 2 GPUs: A has 1 free, B has 2, so B's, with B's pin
    c_drained = a.api("POST", f"/api/v1/servers/{name['c']}/gpus/0/drain")
    assert c_drained["server"] == name["c"]
    wait_until("C drained", lambda: gpu0(c)["state"] == "drained")
    wait_until("B's GPUs free", lambda: gpu_states(b) == ["free", "free"])
    assert sorted(gpu_states(a)) == ["free", "leased"]  # on_a holds one of A's two
    free_on_a = gpu_states(a).index("free")
    tenant = hold_gpus(lan, a, 2, {"GPUPOOL_GPUS": "2", "GPUPOOL_LOG": "info"})
    clients.append(tenant)
    assert tenant.stdout is not None and tenant.stderr is not None
    line = tenant.stdout.readline()
    assert line.startswith("holding"), f"{line}{tenant.stderr.read()}"
    (lease,) = active(b)
    assert lease["gpus"] == [0, 1], lease
    # One worker serves both; the client came from its own machine's address on the LAN.
    on_b_gpus = b.get_json("/api/v1/gpus")["gpus"]
    assert [(g["lease"] or {}).get("worker_pid") for g in on_b_gpus] == [lease["worker_pid"]] * 2
    assert lease["client"]["peer"].startswith(f"{NET}.1:"), lease["client"]
    assert gpu_states(a)[free_on_a] == "free"  # nothing of A's taken for it meanwhile
    assert [x["id"] for x in active(a)] == [lease_a["id"]]
    out, err = tenant.communicate("go\n", timeout=60)
    assert tenant.returncode == 0 and "PASS hold_gpus" in out, f"{out}\n{err}"
    assert f"gpf-b:{REMOTING_PORT}" in err and "127.0.0.1" not in err, err  # B's own address
    assert f"sent to GPU 0 of server {name['b']}" in a.log_text()
    history = wait_until("B's record of the ended lease of 2", lambda: [
        r for r in b.get_json("/api/v1/leases?state=ended")["leases"]
        if r["client_pid"] == tenant.pid])
    assert [r["gpus"] for r in history] == [[0, 1]], history

    # ------------------------------------------------- a redirect from A to B, with B's pin
    on_a2 = client(lan, a, hold_gpu, 60_000, 5)  # A full: a client of 1 GPU is sent on too
    clients.append(on_a2)
    wait_until("A's GPUs both leased", lambda: gpu_states(a) == ["leased", "leased"])
    wait_until("B's GPUs free", lambda: gpu_states(b) == ["free", "free"])
    env = a.client_env({"GPUPOOL_LOG": "info"})
    assert env["GPUPOOL_SERVER"] == f"{NET}.11:{REMOTING_PORT}" and "GPUPOOL_TLS_CA" not in env
    assert env["GPUPOOL_TLS_FINGERPRINT"] == a.fingerprint  # pinned to A only
    redirected = client(lan, a, hold_gpu, 0, 3, env)
    clients.append(redirected)
    out, err = redirected.communicate(timeout=60)
    assert redirected.returncode == 0, err
    assert f"gpf-b:{REMOTING_PORT}" in err  # the info line: continuing at B
    history = [r for r in b.get_json("/api/v1/leases?state=ended")["leases"]
               if r["client_pid"] == redirected.pid]
    assert len(history) == 1

    # ------------------------------- a registered pin that is not the key B presents: refused
    wrong = ensure_identity(tmp_path / "not-b").fingerprint
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE servers SET fingerprint = %s WHERE name = %s", (wrong, name["b"]))
    time.sleep(2.5)  # A's fleet syncs (every second) read the servers table again
    before = len(b.get_json("/api/v1/leases?state=all")["leases"])
    refused = client(lan, a, hold_gpu, 0, 4)
    clients.append(refused)
    _, err = refused.communicate(timeout=60)
    assert refused.returncode != 0
    assert "CHANGED" in err.upper() and wrong in err and b.fingerprint in err, err
    assert len(b.get_json("/api/v1/leases?state=all")["leases"]) == before
    on_a.kill()
    on_a2.kill()
