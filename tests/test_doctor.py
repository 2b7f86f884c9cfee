"""`gpupool doctor`: every check passes against a running daemon, and each failure is named with
its fix: server down, wrong token, protocol mismatch (a tiny fake server), a server without a pin
(not contacted) or with another key, plain TCP, shim not picked up (a fake libcuda.so.1 built
here with gcc, first by LD_PRELOAD or in gpupool's own place)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import gpupool_protocol as gp
import pytest
import trustme
from conftest import REPO, GpupoolServer, require, run_client

FAKE_CUDA = "int cuInit(unsigned flags) { (void)flags; return 100; }\n"


def doctor_env(server_list: str, token: str, shim_dir: Path, **extra: str) -> dict[str, str]:
    """No config file; pin the servers with GPUPOOL_TLS_FINGERPRINT in `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env.pop("LD_PRELOAD", None)
    env.update(GPUPOOL_CONFIG="none", GPUPOOL_SERVER=server_list, GPUPOOL_TOKEN=token,
               GPUPOOL_SHIM_DIR=str(shim_dir), PYTHONPATH=str(REPO / "client"))
    env.update(extra)
    return env


def doctor(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_client([sys.executable, "-m", "gpupool", "doctor"], env=env, timeout=180)


def line(out: str, status: str, name: str) -> str:
    """The check's line (and its fix line, when it has one)."""
    m = re.search(rf"^{re.escape(status)} +{re.escape(name)}: (.*)\n(?:      fix: (.*)\n)?", out,
                  re.M)
    assert m, f"no {status} line for {name!r} in:\n{out}"
    return m.group(1) + ("\nfix: " + m.group(2) if m.group(2) else "")


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A libcuda.so.1 that is not ours (no gpupool_shim_version), as a driver's would be."""
    require(shutil.which("gcc"), "gcc is needed to build the fake libcuda.so.1")
    folder = tmp_path_factory.mktemp("fake-driver")
    src = folder / "fake.c"
    src.write_text(FAKE_CUDA)
    out = folder / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out),
                    str(src)], check=True)
    return out


class FakeServer:
    """Answers every connection's first frame with `reply`, then closes it."""

    def __init__(self, reply: object) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    head = conn.recv(gp.HEADER.size, socket.MSG_WAITALL)
                    length, op, _, req = gp.HEADER.unpack(head)
                    conn.recv(length, socket.MSG_WAITALL)
                    body = self.reply.encode()  # type: ignore[attr-defined]
                    flags = 1 if getattr(self.reply, "IS_REPLY", False) else 0
                    conn.sendall(gp.HEADER.pack(len(body), self.reply.OP, flags,  # type: ignore[attr-defined]
                                                req if flags else 0) + body)
                except (OSError, ValueError):
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def fake_server() -> Iterator[list[FakeServer]]:
    made: list[FakeServer] = []
    yield made
    for s in made:
        s.close()


# ------------------------------------------------------------------------------------ tests
def pinned(server: GpupoolServer, shims: Path | None = None, **extra: str) -> dict[str, str]:
    """doctor_env for `server` alone, its identity pinned."""
    assert server.fingerprint is not None
    return doctor_env(server.address, server.token, shims or server.build_dir / "client",
                      GPUPOOL_TLS_FINGERPRINT=server.fingerprint, **extra)


def test_all_checks_pass_against_a_running_daemon(gpupool_server: GpupoolServer) -> None:
    env = pinned(gpupool_server)
    proc = doctor(env)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    a = gpupool_server.address
    assert "FAIL" not in out
    assert line(out, "ok", "config").startswith("GPUPOOL_CONFIG=none: no file is read; 1 server")
    assert line(out, "ok", f"{a}: reachable") == f"connected to {a}"
    assert line(out, "ok", f"{a}: TLS") == "TLSv1.3"
    assert line(out, "ok", f"{a}: identity") == (
        f"{gpupool_server.fingerprint}, the pinned one (from GPUPOOL_TLS_FINGERPRINT)")
    version = f"{gp.MAJOR}.{gp.MINOR}"
    assert line(out, "ok", f"{a}: protocol version").startswith(f"server {version}, client {version}")
    assert line(out, "ok", f"{a}: token accepted").startswith("tests (user); 1 GPU, 1 meet")
    shim = gpupool_server.build_dir / "client" / "libcuda.so.1"
    assert line(out, "ok", "shim: libcuda.so.1 under gpupool run") == \
        f"{shim.resolve()} (gpupool 0.1.0)"
    assert "shim: libnvidia-ml.so.1 under gpupool run: " in out
    assert re.search(r"^(ok|warn) +CUDA runtime vs the server's driver", out, re.M), out
    rt = line(out, "ok", "round trip")
    assert rt.startswith(f"NVIDIA H100 80GB HBM3 (gpupool simulated) on {a}: ") and \
        rt.endswith("data intact"), rt
    assert out.rstrip().splitlines()[-1].startswith("gpupool doctor: all checks passed")
    # The round trip's lease was recorded and ended like any other.
    leases = gpupool_server.get_json("/api/v1/leases")["leases"]
    assert len(leases) == 1 and leases[0]["program"].startswith("python")


def test_server_down(gpupool_server: GpupoolServer) -> None:
    address, build = gpupool_server.address, gpupool_server.build_dir
    assert gpupool_server.stop() == 0
    proc = doctor(pinned(gpupool_server, build / "client"))
    assert proc.returncode == 1
    text = line(proc.stdout, "FAIL", f"{address}: reachable")
    assert text.startswith("connection refused\nfix: check that gpupoold runs on 127.0.0.1 and "
                           f"listens on port {gpupool_server.port}"), text
    for check in ("TLS", "identity", "protocol version", "token accepted"):
        assert line(proc.stdout, "skip", f"{address}: {check}") == "the server is not reachable"
    assert line(proc.stdout, "skip", "round trip").startswith("no server answered")
    assert "gpupool doctor: 1 check FAILED" in proc.stdout


def test_wrong_token(gpupool_server: GpupoolServer) -> None:
    a = gpupool_server.address
    shims = gpupool_server.build_dir / "client"
    proc = doctor(doctor_env(a, "gpt_000000000000_wrong", shims,
                             GPUPOOL_TLS_FINGERPRINT=str(gpupool_server.fingerprint)))
    assert proc.returncode == 1
    text = line(proc.stdout, "FAIL", f"{a}: token accepted")
    assert "token" in text.split("\n")[0]
    assert text.endswith("fix: GPUPOOL_TOKEN overrides the token of every server: set it to a "
                         "valid token or unset it"), text
    # The same token from the config file: the fix is to log in again.
    cfg = Path(gpupool_server.state_dir) / "client.toml"
    cfg.write_text(f'[[servers]]\naddress = "{a}"\ntoken = "gpt_000000000000_wrong"\n'
                   f'tls_fingerprint = "{gpupool_server.fingerprint}"\n')
    env = doctor_env("", "", shims, GPUPOOL_CONFIG=str(cfg))
    proc = doctor(env)
    assert proc.returncode == 1
    text = line(proc.stdout, "FAIL", f"{a}: token accepted")
    assert f"then `gpupool login {a}` with it" in text, text
    assert line(proc.stdout, "ok", f"{a}: reachable") and line(proc.stdout, "ok",
                                                               f"{a}: protocol version")


def test_protocol_mismatch(fake_server: list[FakeServer], tmp_path: Path) -> None:
    newer = FakeServer(gp.InfoReply(result=gp.GP_EVERSION, major=2, minor=0,
                                    message="this server speaks protocol 2.0; upgrade the client",
                                    server="gpupoold 9.0.0 on future"))
    older = FakeServer(gp.Notice(code=gp.GP_EPROTO, op=0,
                                 text="the first frame must be hello (op 1), got op 6"))
    fake_server += [newer, older]
    proc = doctor(doctor_env(f"{newer.address},{older.address}", "t", tmp_path, GPUPOOL_TLS="0"))
    assert proc.returncode == 1
    text = line(proc.stdout, "FAIL", f"{newer.address}: protocol version")
    assert text.startswith(f"the server speaks protocol 2.0, this client {gp.MAJOR}.{gp.MINOR}: this server speaks"), \
        text
    assert "fix: install the gpupool client that matches the server (gpupoold 9.0.0 on future)" \
        in text
    text = line(proc.stdout, "FAIL", f"{older.address}: protocol version")
    assert text.startswith(f"server {older.address} speaks protocol 1.0; this client needs {gp.MAJOR}.{gp.MINOR} "
                           "for info: upgrade gpupoold"), text
    assert "fix: upgrade gpupoold on 127.0.0.1 to this client's version (0.1.0)" in text
    for fake in (newer, older):
        assert line(proc.stdout, "ok", f"{fake.address}: reachable")
        assert line(proc.stdout, "skip", f"{fake.address}: token accepted")


def test_shim_not_picked_up_because_of_ld_preload(gpupool_server: GpupoolServer,
                                                  fake_libcuda: Path) -> None:
    env = pinned(gpupool_server, LD_PRELOAD=str(fake_libcuda))
    proc = doctor(env)
    assert proc.returncode == 1
    text = line(proc.stdout, "FAIL", "shim: libcuda.so.1 under gpupool run")
    assert text.startswith(f"the loader picks {fake_libcuda}, which is not gpupool's (it does "
                           "not export gpupool_shim_version)"), text
    assert f"fix: {fake_libcuda} is preloaded (LD_PRELOAD or /etc/ld.so.preload)" in text
    assert "remove it from LD_PRELOAD" in text
    assert line(proc.stdout, "skip", "round trip").startswith("gpupool's libcuda.so.1 is not")
    assert line(proc.stdout, "ok", f"{gpupool_server.address}: token accepted")


def test_shim_not_picked_up_because_another_file_is_in_its_place(
        gpupool_server: GpupoolServer, fake_libcuda: Path) -> None:
    env = pinned(gpupool_server, fake_libcuda.parent)
    proc = doctor(env)
    assert proc.returncode == 1
    text = line(proc.stdout, "FAIL", "shim: libcuda.so.1 under gpupool run")
    assert text.startswith(f"the loader picks {fake_libcuda}, which is not gpupool's"), text
    assert "is in gpupool's place but is not gpupool's shim: reinstall the gpupool package" in text
    # The NVML shim is not there at all.
    text = line(proc.stdout, "FAIL", "shim: libnvidia-ml.so.1 under gpupool run")
    assert text.startswith("cannot load it: libnvidia-ml.so.1: cannot open shared object file")


def test_no_server_and_a_broken_config(tmp_path: Path) -> None:
    env = doctor_env("", "", tmp_path)
    proc = doctor(env)
    assert proc.returncode == 1
    assert line(proc.stdout, "FAIL", "config") == (
        "GPUPOOL_CONFIG=none: no file is read: no GPU server configured\nfix: `gpupool login "
        "HOST:PORT`, or set GPUPOOL_SERVER=host:port")
    bad = tmp_path / "c.toml"
    bad.write_text("tls = maybe\n")
    proc = doctor(doctor_env("", "", tmp_path, GPUPOOL_CONFIG=str(bad)))
    assert proc.returncode == 1
    text = line(proc.stdout, "FAIL", "config")
    assert text.startswith(f"{bad}:1: cannot read the value of tls (strings need quotes")


# ------------------------------------------------------------------------------------- TLS
class Pki:
    """A CA and a server certificate for 127.0.0.1, and a CA that signed nothing of ours."""

    def __init__(self, root: Path) -> None:
        ca = trustme.CA()
        self.ca = root / "ca.pem"
        ca.cert_pem.write_to_path(str(self.ca))
        server = ca.issue_cert("localhost", "127.0.0.1")
        self.cert, self.key = root / "server.pem", root / "server.key"
        server.private_key_pem.write_to_path(str(self.key))
        for n, pem in enumerate(server.cert_chain_pems):
            pem.write_to_path(str(self.cert), append=n > 0)
        self.other_ca = root / "other-ca.pem"
        trustme.CA().cert_pem.write_to_path(str(self.other_ca))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def test_tls_checks(native_build: Path, start_daemon, plain_server: GpupoolServer,  # type: ignore[no-untyped-def]
                    pki: Pki, tmp_path: Path) -> None:
    """An operator's own certificate (tls_cert): the CA vouches for the server."""
    config = tmp_path / "gpupoold.toml"
    config.write_text(f'tls_cert = "{pki.cert}"\ntls_key = "{pki.key}"\n')
    tls = start_daemon("--config", str(config), build_dir=native_build)
    shims = native_build / "client"
    a = tls.address
    # Right CA: every check passes, the round trip included (the shim speaks TLS too).
    proc = doctor(doctor_env(f"tls://{a}", tls.token, shims, GPUPOOL_TLS_CA=str(pki.ca)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert line(proc.stdout, "ok", f"tls://{a}: TLS") == "TLSv1.3"
    assert line(proc.stdout, "ok", f"tls://{a}: identity") == (
        f"certificate verified with tls_ca {pki.ca} for 127.0.0.1")
    assert line(proc.stdout, "ok", "round trip").endswith("data intact")
    # A CA that did not sign the server's certificate.
    proc = doctor(doctor_env(a, tls.token, shims, GPUPOOL_TLS_CA=str(pki.other_ca)))
    assert proc.returncode == 1
    text = line(proc.stdout, "FAIL", f"{a}: TLS")
    assert text.startswith("the server's certificate was not accepted (unable to get local "
                           "issuer certificate)"), text
    assert f"fix: give the CA certificate (PEM) that signed the server's certificate: `gpupool " \
           f"login {a} --tls-ca CA.pem`" in text
    # Plain TCP to the TLS port, and TLS to a plain port.
    plain = plain_server.address
    proc = doctor(doctor_env(f"{a},tls://{plain}", tls.token, shims, GPUPOOL_TLS="0",
                             GPUPOOL_TLS_CA=str(pki.ca)))
    assert proc.returncode == 1
    text = line(proc.stdout, "FAIL", f"{a}: TLS")
    assert text.startswith("the server requires TLS: this gpupool server requires TLS"), text
    assert f"fix: drop tls = false (and GPUPOOL_TLS=0) for this server: `gpupool login {a}` " \
           "pins its identity and turns TLS on" in text
    text = line(proc.stdout, "FAIL", f"tls://{plain}: TLS")
    assert "the server does not speak TLS on this port" in text, text
    assert f"`gpupool login {plain} --plain` (the token then crosses unencrypted)" in text


def test_identity_checks(gpupool_server: GpupoolServer, plain_server: GpupoolServer,
                         tmp_path: Path) -> None:
    """No pin: the server is not contacted, the fix is `gpupool login`; another key: refused
    after the handshake with the loud message; plain TCP by choice: a warning, not a failure."""
    a = gpupool_server.address
    shims = gpupool_server.build_dir / "client"
    proc = doctor(doctor_env(a, gpupool_server.token, shims))
    assert proc.returncode == 1
    out = proc.stdout
    for check in ("reachable", "TLS"):
        assert line(out, "skip", f"{a}: {check}").startswith("not contacted: this client sends "
                                                             "nothing to a server whose identity")
    text = line(out, "FAIL", f"{a}: identity")
    assert text.startswith(f"no pinned identity for {a}: nothing was sent; run `gpupool login "
                           f"{a}`"), text
    assert f"fix: `gpupool login {a}` shows the server's identity: check it against what " \
           f"`gpupoold fingerprint` prints on the server and answer yes (in a script: `gpupool " \
           f"login {a} --fingerprint SHA256:...`)" in text
    assert line(out, "skip", f"{a}: token accepted") == "not contacted"
    assert line(out, "skip", "round trip").startswith("no server answered")
    # Another key pinned (from the environment): the fix names the variable.
    other = "SHA256:" + "A" * 43
    proc = doctor(doctor_env(a, gpupool_server.token, shims, GPUPOOL_TLS_FINGERPRINT=other))
    assert proc.returncode == 1
    out = proc.stdout
    assert line(out, "ok", f"{a}: reachable") and line(out, "ok", f"{a}: TLS") == "handshake done"
    text = line(out, "FAIL", f"{a}: identity")
    assert text.startswith(f"WARNING: THE IDENTITY OF SERVER {a} HAS CHANGED: it presents "
                           f"{gpupool_server.fingerprint}, but the pinned one is {other}"), text
    assert "set GPUPOOL_TLS_FINGERPRINT to it" in text
    assert line(out, "skip", f"{a}: token accepted") == (
        "nothing was sent: the server is not the one pinned")
    # Plain TCP, as both sides say: works, with a warning that says what it costs.
    p = plain_server.address
    proc = doctor(doctor_env(p, plain_server.token, shims, GPUPOOL_TLS="0"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = line(proc.stdout, "warn", f"{p}: TLS")
    assert text.startswith("plain TCP (tls = false, from GPUPOOL_TLS): the token and all data "
                           "cross the network unencrypted"), text
    assert line(proc.stdout, "skip", f"{p}: identity") == "plain TCP: no identity to check"
    assert line(proc.stdout, "ok", f"{p}: token accepted")
