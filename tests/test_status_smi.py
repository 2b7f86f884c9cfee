"""`gpupool status` and `gpupool smi` against real daemons: the table's content (names, memory,
states, holders, my leases, the queue), unreachable servers, servers this client does not trust
(no pin: not contacted; another key: refused), and --json equal to the HTTP API's views."""

from __future__ import annotations

import json
import os
import pwd
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import gpupool_protocol as gp
import pytest
from conftest import REPO, GpupoolServer, run_client

PROTOCOL = f"{gp.MAJOR}.{gp.MINOR}"  # this checkout's protocol version

MIB = 1 << 20
HELD = 256 * MIB

# A CUDA client that takes a GPU, allocates HELD bytes, says "ready", and holds the lease until
# its stdin closes.
HOLDER = f"""
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
def ck(rc, what):
    if rc != 0:
        print("FAIL", what, rc, flush=True)
        sys.exit(1)
ck(cuda.cuInit(0), "cuInit")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
ck(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ck(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
ck(cuda.cuCtxSetCurrent(ctx), "set current")
cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
ck(cuda.cuMemAlloc_v2(ctypes.byref(ptr), {HELD}), "cuMemAlloc")
print("ready", flush=True)
sys.stdin.read()
"""


def cli_env(servers: list[str], token: str, pin: str | None = None) -> dict[str, str]:
    """No config file: these servers and token, and `pin` (GPUPOOL_TLS_FINGERPRINT) as the
    identity of every one of them; None: no pin at all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env.update(GPUPOOL_CONFIG="none", GPUPOOL_SERVER=",".join(servers), GPUPOOL_TOKEN=token,
               PYTHONPATH=str(REPO / "client"))
    if pin is not None:
        env["GPUPOOL_TLS_FINGERPRINT"] = pin
    return env


def gpupool(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_client([sys.executable, "-m", "gpupool", *args], env=env, timeout=60)


class Holder:
    def __init__(self, server: GpupoolServer, script: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, script.name], env=server.client_env(),
                                     cwd=script.parent,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"holder: {line!r} {self.proc.stderr.read()}"  # type: ignore[union-attr]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for h in started:
        h.close()


def wait_until(check, timeout: float = 15.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.2)


def smi_json(env: dict[str, str]) -> dict:  # type: ignore[type-arg]
    proc = gpupool(env, "smi", "--json")
    return json.loads(proc.stdout)


def stable(gpu: dict) -> dict:  # type: ignore[type-arg]
    keys = ("index", "name", "uuid", "simulated", "memory_total", "pci_bus_id", "state",
            "draining", "quarantine")
    return {k: gpu.get(k) for k in keys}


def test_status_and_smi_show_gpus_my_lease_and_the_queue(
        gpupool_server: GpupoolServer, holders: list[Holder], tmp_path: Path) -> None:
    server = gpupool_server
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    env = cli_env([server.address], server.token, server.fingerprint)

    # Idle: one free simulated GPU, no leases, empty queue.
    proc = gpupool(env, "status")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"{server.address}: gpupoold 0.1.0 on " in out
    assert f"(protocol {PROTOCOL}, TLSv1.3, pinned identity)" in out, out
    assert re.search(r"^  0 +NVIDIA H100 80GB HBM3 \(gpupool simulated\) +free +- +0 MiB / "
                     r"80\.0 GiB +0 %$", out, re.M), out
    assert "My leases: none" in out and "Queue: empty" in out

    holders.append(Holder(server, script))
    holders[0].wait_ready()
    holders.append(Holder(server, script))  # waits in the queue: the only GPU is taken
    host = socket.gethostname()

    def queued() -> str | None:
        p = gpupool(env, "status")
        return p.stdout if "Queue: 1 waiting" in p.stdout else None

    out = wait_until(queued) or gpupool(env, "status").stdout
    assert "Queue: 1 waiting" in out, out
    user = os.environ.get("USER") or pwd.getpwuid(os.getuid()).pw_name
    assert re.search(rf"^  0 +NVIDIA H100 80GB HBM3 \(gpupool simulated\) +leased +tests "
                     rf"\({re.escape(user)}@{re.escape(host)}\) \[me\]", out, re.M), out
    lease_id = server.get_json("/api/v1/leases?state=active")["leases"][0]["id"]
    assert re.search(rf"^    lease {lease_id} on GPU 0: python holder\.py \(pid "
                     rf"{holders[0].proc.pid} on {re.escape(host)}\), for \d+ s$", out, re.M), out
    assert re.search(r"^    1\. tests \(.*\): python holder\.py, wants any GPU, waiting \d+ s "
                     r"\[me\]$", out, re.M), out

    # smi: the leased GPU with the memory the holder allocated (live values, refreshed about
    # every second), and the holder in the processes section.
    def memory_seen() -> dict | None:  # type: ignore[type-arg]
        view = smi_json(env)
        return view if view["gpus"][0]["live"]["memory_used"] >= HELD else None

    view = wait_until(memory_seen)
    assert view, smi_json(env)
    proc = gpupool(env, "smi")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    used = view["gpus"][0]["live"]["memory_used"] // MIB
    assert re.search(rf"^\| {re.escape(server.address)} \|   0 \| NVIDIA H100 80GB HBM3 "
                     rf"\(gpupool simulated\) \| leased \| +{used}MiB / 81920MiB \| +\d+% \| +\d+C "
                     rf"\| +\d+W / 700W \|$", out, re.M), out  # the simulated sensors (gpu/sim.py)
    assert used >= HELD // MIB
    assert "servers: 1 of 1 answering    GPUs: 1" in out
    assert f"{server.address}: gpupoold 0.1.0 on" in out and "CUDA 13.0" in out
    assert re.search(rf"^\| {re.escape(server.address)} \|   0 \| +{lease_id} \| "
                     rf"+{holders[0].proc.pid} \| {re.escape(host)} +\| python holder\.py +\| "
                     rf"+{used}MiB \|$", out, re.M), out

    # --json is the API's view of the same GPUs and leases.
    api_gpus = server.get_json("/api/v1/gpus")["gpus"]
    assert [stable(g) for g in view["gpus"]] == [stable(g) for g in api_gpus]
    assert all(g["server"] == server.address for g in view["gpus"])
    assert [(p["lease"], p["gpu"], p["client"]["pid"]) for p in view["processes"]] == [
        (lease_id, 0, holders[0].proc.pid)]
    status = json.loads(gpupool(env, "status", "--json").stdout)
    (entry,) = status["servers"]
    assert entry["ok"] and entry["protocol"] == PROTOCOL and entry["gpus"] == 1
    assert entry["trusted"] and entry["tls"] == "TLSv1.3"
    assert entry["identity"] == server.fingerprint == info_fingerprint(entry)
    assert entry["queue"] == 1 and entry["free_matching"] == 0
    info = entry["info"]
    assert [stable(g) for g in info["gpus"]] == [stable(g) for g in api_gpus]
    assert [x["id"] for x in info["leases"]] == [lease_id] and info["leases"][0]["mine"]
    api_queue = server.get_json("/api/v1/queue")["queue"]
    assert [(q["ticket"], q["position"]) for q in info["queue"]] == [
        (q["ticket"], q["position"]) for q in api_queue]

    # Another token's client is not mine.
    other = cli_env([server.address], server.create_token("someone-else"), server.fingerprint)
    info = json.loads(gpupool(other, "status", "--json").stdout)["servers"][0]["info"]
    assert [x["mine"] for x in info["leases"]] == [False]
    assert "My leases: none" in gpupool(other, "status").stdout


def test_unreachable_and_refusing_servers_are_shown(
        gpupool_server: GpupoolServer, tmp_path: Path) -> None:
    server = gpupool_server
    env = cli_env([server.address, "127.0.0.1:1"], server.token, server.fingerprint)
    proc = gpupool(env, "status")
    assert proc.returncode == 1  # one server did not answer
    assert "127.0.0.1:1: unreachable: connection refused" in proc.stdout
    assert f"{server.address}: gpupoold" in proc.stdout
    proc = gpupool(env, "smi")
    assert proc.returncode == 1
    assert "servers: 1 of 2 answering" in proc.stdout
    assert "  127.0.0.1:1: unreachable: connection refused" in proc.stdout
    assert "No running processes found" in proc.stdout
    view = json.loads(gpupool(env, "smi", "--json").stdout)
    assert [(s["address"], s["reachable"], s["trusted"], s["error"]) for s in view["servers"]] \
        == [(server.address, True, True, None), ("127.0.0.1:1", False, True, "connection refused")]
    bad = cli_env([server.address], "gpt_000000000000_wrong", server.fingerprint)
    proc = gpupool(bad, "status")
    assert proc.returncode == 1
    assert f"{server.address}: gpupoold 0.1.0 on" in proc.stdout and "refused:" in proc.stdout
    status = json.loads(gpupool(bad, "status", "--json").stdout)["servers"][0]
    assert status["reachable"] and not status["ok"] and status["result"] == 100003
    assert status["info"] == {}


def info_fingerprint(entry: dict) -> str:  # type: ignore[type-arg]
    """The identity the server says it has in its info reply (protocol 1.4)."""
    return entry["info"]["fingerprint"]


def test_servers_this_client_does_not_trust(native_build: Path, start_daemon,  # type: ignore[no-untyped-def]
                                            plain_server: GpupoolServer) -> None:
    """Without a pin a server is not contacted at all, with another key it is refused after
    the handshake; either way the line says why and what fixes it, and nothing else changes
    for the servers that are trusted. Plain TCP only where the client says so too."""
    a = start_daemon(build_dir=native_build)
    b = start_daemon(build_dir=native_build)
    env = cli_env([a.address, b.address], a.token)
    env["GPUPOOL_TOKEN"] = ""
    config = Path(a.state_dir) / "client.toml"
    config.write_text(
        f'[[servers]]\naddress = "{a.address}"\ntoken = "{a.token}"\n'
        f'tls_fingerprint = "{a.fingerprint}"\n'
        f'[[servers]]\naddress = "{b.address}"\ntoken = "{b.token}"\n'
        f'[[servers]]\naddress = "{plain_server.address}"\ntoken = "{plain_server.token}"\n'
        'tls = false\n')
    env.update(GPUPOOL_CONFIG=str(config), GPUPOOL_SERVER="")
    proc = gpupool(env, "status")
    assert proc.returncode == 1
    out = proc.stdout
    assert f"{a.address}: gpupoold 0.1.0 on" in out
    assert (f"{b.address}: not trusted: no pinned identity for {b.address}: nothing was sent; "
            f"run `gpupool login {b.address}`") in out, out
    assert f"{plain_server.address}: gpupoold 0.1.0 on" in out and "plain TCP)" in out
    view = json.loads(gpupool(env, "smi", "--json").stdout)
    assert [(s["address"], s["ok"], s["trusted"]) for s in view["servers"]] == [
        (a.address, True, True), (b.address, False, False), (plain_server.address, True, True)]
    out = gpupool(env, "smi").stdout
    assert f"  {b.address}: not trusted: no pinned identity for {b.address}" in out, out
    # b pinned to a's key: refused after the handshake, with the loud message.
    config.write_text(
        f'[[servers]]\naddress = "{b.address}"\ntoken = "{b.token}"\n'
        f'tls_fingerprint = "{a.fingerprint}"\n')
    proc = gpupool(env, "status", "--json")
    assert proc.returncode == 1
    (entry,) = json.loads(proc.stdout)["servers"]
    assert not entry["trusted"] and not entry["reachable"]
    assert entry["error"].startswith(f"WARNING: THE IDENTITY OF SERVER {b.address} HAS CHANGED: "
                                     f"it presents {b.fingerprint}, but the pinned one is "
                                     f"{a.fingerprint}")


def test_no_server_configured(tmp_path: Path) -> None:
    env = cli_env([], "")
    env["GPUPOOL_SERVER"] = ""
    for cmd in ("status", "smi"):
        proc = gpupool(env, cmd)
        assert proc.returncode == 1
        assert "no GPU server configured: run `gpupool login HOST:PORT`" in proc.stderr


def test_two_servers_in_one_table(native_build: Path, start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a = start_daemon(simulated=2, build_dir=native_build)
    b = start_daemon(simulated=1, build_dir=native_build)
    env = cli_env([a.address, b.address], a.token)
    env["GPUPOOL_TOKEN"] = ""
    env["GPUPOOL_CONFIG"] = str(tmp_path / "c.toml")
    (tmp_path / "c.toml").write_text(
        f'[[servers]]\naddress = "{a.address}"\ntoken = "{a.token}"\n'
        f'tls_fingerprint = "{a.fingerprint}"\n'
        f'[[servers]]\naddress = "{b.address}"\ntoken = "{b.token}"\n'
        f'tls_fingerprint = "{b.fingerprint}"\n')
    proc = gpupool(env, "smi")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    rows = re.findall(r"^\| (\S+) +\| +(\d) \| (.+?) +\| (\w+) +\|", proc.stdout, re.M)
    name = "NVIDIA H100 80GB HBM3 (gpupool simulated)"
    assert rows == [(a.address, "0", name, "free"), (a.address, "1", name, "free"),
                    (b.address, "0", name, "free")]
    assert "servers: 2 of 2 answering    GPUs: 3" in proc.stdout
