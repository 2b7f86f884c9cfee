"""Least-privilege workers (issue 29, item 4; docs/security.md, "The worker"): the environment
a worker gets, its sandbox arguments, and a worker a tenant has taken over
(build/tests/gpupool-worker-compromise, tests/c/worker/worker_compromise.c) that tries to read
the daemon's secrets, the TLS key and a sibling worker, and finds nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import GpupoolServer, wait_until
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from test_e2e_leases import facts, gpu_states, hold_gpu, start_client, worker_pids  # noqa: F401  (hold_gpu is a fixture)

from gpupoold.auth.authenticator import LOCAL_ADMIN_FILE
from gpupoold.gpu.environment import allowed_variable, driver_environment
from gpupoold.gpu.inventory import Gpu
from gpupoold.tls_identity import ensure_identity
from gpupoold.workers.supervisor import WorkerSupervisor

# What a daemon's environment may hold that no worker must get.
SECRETS = {
    "PGPASSWORD": "sekrit-pg-password",
    "GPUPOOL_TOKEN": "sekrit-gpupool-token",
    "DATABASE_URL": "postgresql://gpupool:sekrit-url@db/gpupool",
    "AWS_SECRET_ACCESS_KEY": "sekrit-aws",
    "HOME": "/root/sekrit-home",
}


def test_the_environment_is_an_allowlist(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LD_PRELOAD", "/x/libpreload.so")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    monkeypatch.setenv("GPUPOOL_WORKER_STAGED_COPIES", "1")
    monkeypatch.setenv("GPUPOOL_SIM_NAME", "x")
    env = driver_environment(Gpu(0, "g", "", True, "/lib/sim.so", 0,
                                 env={"GPUPOOL_SIM_CONFIG": "/s/gpu0.conf"}))
    assert not set(SECRETS) & set(env)
    assert "LD_PRELOAD" not in env
    assert env["LC_ALL"] == "C.UTF-8" and env["CUDA_MODULE_LOADING"] == "LAZY"
    assert env["GPUPOOL_WORKER_STAGED_COPIES"] == "1" and env["GPUPOOL_SIM_NAME"] == "x"
    assert env["GPUPOOL_SIM_CONFIG"] == "/s/gpu0.conf"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["PATH"] == os.environ["PATH"]
    # GPUPOOL_ is no blanket prefix: the client's token and settings are not the worker's.
    assert not allowed_variable("GPUPOOL_TOKEN") and not allowed_variable("GPUPOOL_SERVER")


def test_argv_names_the_writable_folders_and_the_sandbox_switch(tmp_path: Path) -> None:
    gpu = Gpu(0, "g", "", True, "/lib/sim.so", 0, writable=("/dev/shm/gpupool-sim-0-x",),
              readable=("/s/sim/gpu0.conf",))
    argv = WorkerSupervisor(tmp_path / "w", tmp_path / "cache").argv(gpu, 3)
    assert argv[argv.index("--sandbox-rw") + 1] == "/dev/shm/gpupool-sim-0-x"
    assert argv[argv.index("--sandbox-ro") + 1] == "/s/sim/gpu0.conf"
    assert "--no-sandbox" not in argv
    argv = WorkerSupervisor(tmp_path / "w", tmp_path / "cache", sandbox=False).argv(gpu, 3)
    assert "--no-sandbox" in argv


def key_needles(key_pem: bytes) -> list[bytes]:
    """Byte strings only the private key holds: its private numbers, big- and little-endian
    (OpenSSL keeps them as little-endian words), and the PEM text's base64 lines."""
    key = serialization.load_pem_private_key(key_pem, None)
    if isinstance(key, ec.EllipticCurvePrivateKey):
        numbers = [key.private_numbers().private_value]
    else:
        assert isinstance(key, rsa.RSAPrivateKey)
        n = key.private_numbers()
        numbers = [n.d, n.p, n.q]
    needles = []
    for v in numbers:
        raw = v.to_bytes((v.bit_length() + 7) // 8, "big")
        needles += [raw, raw[::-1]]
    lines = [ln for ln in key_pem.splitlines() if ln and not ln.startswith(b"-----")]
    return needles + [ln for ln in lines if len(ln) >= 32]


def disguised(needles: list[bytes]) -> str:
    """GPUPOOL_WORKER_TEST_NEEDLES: hex of every byte XOR 0xa5 (the worker's environment must
    not hold the needles themselves, or the search would find them there)."""
    return ",".join(bytes(b ^ 0xA5 for b in n).hex() for n in needles)


def compromise_lines(server: GpupoolServer) -> list[str]:
    return re.findall(r"compromise: (.*)", server.log_text())


def test_a_compromised_worker_reaches_no_secret(
        start_daemon: Callable[..., GpupoolServer], native_build: Path, hold_gpu: Path,  # noqa: F811
        tmp_path: Path) -> None:
    """The acceptance of issue 29, item 4: after its session started, a worker running a tenant's
    code can open neither local-admin.token, nor the database password file, nor the TLS key;
    cannot ptrace a sibling worker or read its memory or environment; finds no byte of the TLS
    key in its own memory; and its /proc/PID/environ holds none of the daemon's secrets."""
    worker = native_build / "tests" / "gpupool-worker-compromise"
    sim = native_build / "libgpupool-sim.so"
    assert worker.is_file() and sim.is_file()
    state = tmp_path / "state"
    # The identity gpupoold would make at its first start, made first so that the test knows
    # the key (gpupoold keeps it: tls_identity.py).
    ident = ensure_identity(state)
    key_pem = ident.key_path.read_bytes()
    password_file = tmp_path / "etc-gpupool" / "database-password"
    password_file.parent.mkdir(mode=0o700)
    password_file.write_text("sekrit-db-password\n")
    password_file.chmod(0o600)
    secrets = [state / LOCAL_ADMIN_FILE, password_file, ident.key_path]
    env = {**SECRETS,
           "GPUPOOL_WORKER_TEST_SECRETS": ":".join(map(str, secrets)),
           "GPUPOOL_WORKER_TEST_NEEDLES": disguised(key_needles(key_pem))}
    server = start_daemon("--simulated", "2", "--worker", str(worker), "--sim-lib", str(sim),
                          simulated=None, native=False, env=env, state_dir=state)
    wait_until("both GPUs free", lambda: gpu_states(server) == ["free", "free"])
    assert (state / LOCAL_ADMIN_FILE).is_file()

    # The compromised worker cannot list /proc: it is told who its siblings are.
    (state / "cache" / "compromise-pids").write_text(" ".join(map(str, worker_pids(server))))
    client = start_client(server, hold_gpu, 1 << 20, 3000, 7)
    lines = wait_until("the compromised worker's report",
                       lambda: (ls := compromise_lines(server)) and ls[-1] == "done" and ls)
    # Its sibling (the other GPU's worker) and itself, while the session runs.
    pids = worker_pids(server)
    environs = {pid: Path(f"/proc/{pid}/environ").read_bytes() for pid in pids}
    statuses = {pid: (Path(f"/proc/{pid}/status").read_text(),
                      Path(f"/proc/{pid}/limits").read_text()) for pid in pids}
    out, err = client.communicate(timeout=60)
    assert client.returncode == 0, err
    assert facts(out)["uuid"]
    report = "\n".join(lines)

    assert "tls key held: no; dumpable: 0" in report
    # Confined before the driver started its threads, with every rule made.
    assert "sandbox:" not in server.log_text()
    for path in secrets:
        assert re.search(rf"open secret {re.escape(str(path))}: refused", report), report
    opened = [ln for ln in lines if "OPENED" in ln or "ATTACHED" in ln]
    assert all(ln.startswith("open control") for ln in opened), opened
    # The controls: the probes work where access is allowed.
    assert sum(ln.startswith("open control") and "OPENED" in ln for ln in lines) == 2, report
    assert "control marker in memory: found" in report
    # The sibling: no ptrace, no memory, no environment.
    assert "1 sibling worker(s)" in report, report
    assert re.search(r"ptrace attach to sibling \d+: refused", report)
    assert re.search(r"open sibling mem /proc/\d+/mem: refused", report)
    assert re.search(r"open sibling environ /proc/\d+/environ: refused", report)
    assert re.search(rf"open daemon environ /proc/{server.proc.pid}/environ: refused", report)
    # The key: gone from memory before the first frame.
    needles = [ln for ln in lines if ln.startswith("key needle")]
    assert len(needles) == len(key_needles(key_pem)) and all(
        ln.endswith("not found") for ln in needles), needles

    assert len(environs) == 2
    for pid, environ in environs.items():
        for name, value in SECRETS.items():
            assert value.encode() not in environ, f"worker {pid} has {name} in its environment"
    for pid, (status, limits) in statuses.items():
        assert re.search(r"^NoNewPrivs:\s+1$", status, re.M), f"worker {pid}: no no_new_privs"
        assert re.search(r"^Max core file size\s+0\s+0\s", limits, re.M), f"worker {pid}: cores"


def test_without_the_sandbox_the_same_worker_opens_the_secrets(
        start_daemon: Callable[..., GpupoolServer], native_build: Path, hold_gpu: Path,  # noqa: F811
        tmp_path: Path) -> None:
    """The control of the test above: with `worker_sandbox = false` the compromised worker opens
    local-admin.token, so the refusals above are the sandbox's doing, and the setting turns it
    off."""
    state = tmp_path / "state"
    config = tmp_path / "gpupoold.toml"
    config.write_text("worker_sandbox = false\n")
    env = {"GPUPOOL_WORKER_TEST_SECRETS": str(state / LOCAL_ADMIN_FILE)}
    server = start_daemon("--config", str(config), "--worker",
                          str(native_build / "tests" / "gpupool-worker-compromise"), "--sim-lib",
                          str(native_build / "libgpupool-sim.so"), native=False, env=env,
                          state_dir=state)
    client = start_client(server, hold_gpu, 1 << 20, 0, 7)
    lines = wait_until("the compromised worker's report",
                       lambda: (ls := compromise_lines(server)) and ls[-1] == "done" and ls)
    out, err = client.communicate(timeout=60)
    assert client.returncode == 0, err
    # The token is gpupoold's user's own file (0600), and the worker runs as that user.
    assert any(ln.startswith(f"open secret {state / LOCAL_ADMIN_FILE}: OPENED") for ln in lines)
    assert "tls key held: no; dumpable: 0" in "\n".join(lines)
