"""Pieces the benchmark scripts share: a gpupoold of their own (Daemon), stopping a daemon they
started, removing its state, throw-away TLS certificates (TlsFiles), the CPU's name, a plain-text
table, and printing/saving the Markdown section of a run.

bench/ is not a package: each script puts its own folder first on sys.path and imports this.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("GPUPOOL_BUILD_DIR", ROOT / "build")).resolve()


def stop_process_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to a daemon started with start_new_session=True, then SIGKILL to its whole group
    (its workers included) once it has exited or after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove_state(state: Path) -> None:
    """A benchmark daemon's state folder and the memory of its simulated GPUs (kept apart, under
    gpupoold.gpu.sim.sim_memory_dir); missing pieces are fine."""
    try:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        from gpupoold.gpu.sim import sim_memory_dir

        shutil.rmtree(sim_memory_dir(state), ignore_errors=True)
    except ImportError:  # a tree without the daemon package: nothing simulated to remove
        pass
    shutil.rmtree(state, ignore_errors=True)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    import platform

    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def text_table(head: Sequence[str], body: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, a dashed rule under the head."""
    widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]

    def line(cols: Sequence[object]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cols, widths)).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def emit_markdown(lines: list[str], path: Path | None) -> None:
    """Print a run's Markdown section (ready for docs/benchmarks.md) and write it to `path`."""
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    if path:
        path.write_text(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Plain TCP, said explicitly on both ends (TLS is the default on the remoting port, issue 35):
# a benchmark's plain run must stay plain whatever the defaults are.
PLAIN_TCP_CLIENT_ENV = {"GPUPOOL_TLS": "0"}


def plain_tcp_server_config() -> str:
    """gpupoold's setting for a plain-TCP remoting port (`tls = "off"`); empty on a gpupoold
    whose settings have no `tls` key yet (plain was the only default there)."""
    try:
        import dataclasses

        from gpupoold.config.settings import Settings
        known = any(f.name == "tls" for f in dataclasses.fields(Settings))
    except ImportError:
        known = True
    return 'tls = "off"\n' if known else ""


TCP_ULP = 31  # linux/tcp.h


def ktls_status() -> str:
    """Whether this kernel offers kernel TLS (TCP_ULP "tls" on an established connection, which
    also loads the module where it can), said in words for a benchmark's output."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        with socket.create_connection(listener.getsockname()) as conn:
            peer, _ = listener.accept()
            with peer:
                try:
                    conn.setsockopt(socket.IPPROTO_TCP, TCP_ULP, b"tls")
                except OSError as exc:
                    return (f"kTLS: not offered by this kernel ({os.uname().release}: TCP_ULP "
                            f"\"tls\": {exc.strerror}); gpupool's TLS runs in user space "
                            "(OpenSSL) on both ends")
        return ("kTLS: offered by this kernel, not used: gpupool's TLS runs in user space "
                "(OpenSSL, records gathered 256 KiB at a time) on both ends")
    finally:
        listener.close()


class TlsFiles:
    """A throw-away CA and a server certificate for `hosts` (trustme), as files; the server's
    settings and the client's environment that use them."""

    def __init__(self, *hosts: str) -> None:
        try:
            import trustme
        except ImportError:
            sys.exit("benchmarks with TLS need the trustme package (scripts/bootstrap.sh "
                     "installs it into .venv; run the benchmark with .venv/bin/python)")
        self.dir = Path(tempfile.mkdtemp(prefix="gpupool-bench-tls-"))
        ca = trustme.CA()
        leaf = ca.issue_cert(*(hosts or ("127.0.0.1", "localhost")))
        self.ca, self.cert, self.key = (self.dir / n for n in ("ca.pem", "cert.pem", "key.pem"))
        ca.cert_pem.write_to_path(str(self.ca))
        leaf.private_key_pem.write_to_path(str(self.key))
        with self.cert.open("wb") as f:
            for blob in leaf.cert_chain_pems:
                f.write(blob.bytes())

    def server_config(self) -> str:
        return f'tls_cert = "{self.cert}"\ntls_key = "{self.key}"\n'

    def client_env(self) -> dict[str, str]:
        return {"GPUPOOL_TLS": "1", "GPUPOOL_TLS_CA": str(self.ca)}

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def identity_line(log: str) -> str | None | bool:
    """The identity a gpupoold printed at start (`gpupoold: identity SHA256:...`: what its
    clients pin); None for `gpupoold: identity none (...)` (tls = "off": plain TCP); False when
    the log has no identity line (yet)."""
    for line in log.splitlines():
        if line.startswith("gpupoold: identity "):
            value = line.split()[2]
            return value if value.startswith("SHA256:") else None
    return False


def trust_env(fingerprint: str | None) -> dict[str, str]:
    """A client's trust settings for a daemon with this identity: pinned to it (TLS, the
    default), or GPUPOOL_TLS=0 for a daemon with tls = "off"."""
    return {"GPUPOOL_TLS_FINGERPRINT": fingerprint} if fingerprint else {"GPUPOOL_TLS": "0"}


def with_profile(env: dict[str, str], name: str) -> dict[str, str]:
    """env, and with GPUPOOL_PROFILE_DIR set in this process's environment (scripts/gpu-validation.sh
    sets it), GPUPOOL_PROFILE=DIR/NAME.txt: the shim's table of where the run's time went
    (docs/user-guide.md, "Where the time goes")."""
    folder = os.environ.get("GPUPOOL_PROFILE_DIR")
    if folder:
        path = Path(folder).resolve()
        path.mkdir(parents=True, exist_ok=True)
        env = {**env, "GPUPOOL_PROFILE": str(path / f"{name}.txt")}
    return env


class Daemon:
    """gpupoold on fixed ports (clients keep their address across restarts) and one state dir;
    on `gpus` simulated GPUs, or with real=True on the real GPU 0 (reset policy never: a lent
    GPU is never reset). Its clients (client_env) pin the identity it prints at start
    (.fingerprint; None with tls = "off": they say GPUPOOL_TLS=0)."""

    def __init__(self, gpus: int, real: bool = False, config: str = "",
                 name: str = "soak", netns: str | None = None, host: str = "127.0.0.1",
                 port: int = 7070) -> None:
        self.gpus = gpus
        self.real = real
        self.name = name
        # In another network namespace (bench/link_bench.py): its API is reachable only there.
        self.netns = netns
        self.state = Path(tempfile.mkdtemp(prefix=f"gpupool-{name}-"))
        self.config = self.state / "gpupoold.toml"
        self.config.write_text(('simulated = 0\ngpus = [0]\nreset_policy = "never"\n' if real
                                else 'reset_policy = "never"\n') + config)
        # In a namespace of its own, fixed ports: remoting `port`, HTTP the next one.
        self.listen = f"{host}:{free_port() if netns is None else port}"
        self.http = f"{host}:{free_port() if netns is None else port + 1}"
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), str(ROOT / "protocol" / "python"), *filter(None, [self.env.get("PYTHONPATH")])])
        self.generation = 0
        self.fingerprint: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.groups: list[int] = []  # process groups of every daemon started (workers live on)
        self.start()
        made = subprocess.run([sys.executable, "-m", "gpupoold", "token", "create", "--name",
                               name, "--state-dir", str(self.state)], env=self.env, cwd=ROOT,
                              capture_output=True, text=True, check=True)
        self.token = made.stdout.strip().splitlines()[-1]

    @property
    def log_path(self) -> Path:
        return self.state / f"gpupoold-{self.generation}.log"

    def start(self) -> None:
        self.generation += 1
        cmd = [*(["ip", "netns", "exec", self.netns] if self.netns else []),
               sys.executable, "-m", "gpupoold", "serve", "--config", str(self.config),
               *([] if self.real else ["--simulated", str(self.gpus)]),
               "--listen", self.listen, "--http", self.http, "--state-dir", str(self.state),
               "--worker", str(BUILD / "gpupool-worker"), "--sim-lib",
               str(BUILD / "libgpupool-sim.so")]
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.groups.append(self.proc.pid)
        deadline = time.monotonic() + 60
        while "gpupoold: http on" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"{self.name}: gpupoold did not start:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        identity = identity_line(self.log_path.read_text(errors="replace"))
        if identity is False:
            sys.exit(f"{self.name}: gpupoold printed no identity line:\n"
                     f"{self.log_path.read_text()}")
        if self.generation > 1 and identity != self.fingerprint:
            # The same state dir keeps the same identity: its clients' pin must still hold.
            sys.exit(f"{self.name}: gpupoold's identity changed across a restart: "
                     f"{self.fingerprint} then {identity}")
        self.fingerprint = identity or None
        self.admin = (self.state / "local-admin.token").read_text().strip()

    def restart(self, how: str) -> float:
        """Stop (SIGTERM: a clean stop; SIGKILL: a crash) and start again; the seconds without a
        daemon."""
        assert self.proc is not None
        t0 = time.monotonic()
        if how == "SIGTERM":
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        else:
            self.proc.kill()
            self.proc.wait(60)
        self.start()
        return time.monotonic() - t0

    def get(self, path: str) -> Any:
        req = urllib.request.Request(f"http://{self.http}{path}",
                                     headers={"Authorization": f"Bearer {self.admin}"})
        with urllib.request.urlopen(req, timeout=30) as reply:
            return json.loads(reply.read())

    def wait_quiet(self, timeout: float = 60) -> None:
        """Every GPU free with its pre-started worker, nobody queued."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            gpus = self.get("/api/v1/gpus")["gpus"]
            if all(g["state"] == "free" and g["worker_ready"] for g in gpus) and \
                    not self.get("/api/v1/queue")["queue"]:
                return
            time.sleep(0.1)
        raise RuntimeError(f"gpupoold did not become quiet: {self.get('/api/v1/gpus')}")

    def resources(self) -> tuple[int, int]:
        """(open file descriptors, resident memory in bytes) of the daemon process."""
        assert self.proc is not None
        fds = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return fds, int(line.split()[1]) * 1024
        return fds, 0

    def client_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for var in ("GPUPOOL_TLS", "GPUPOOL_TLS_FINGERPRINT", "GPUPOOL_TLS_CA"):
            env.pop(var, None)
        env.update(LD_LIBRARY_PATH=str(BUILD / "client"), GPUPOOL_SERVER=self.listen,
                   GPUPOOL_TOKEN=self.token, GPUPOOL_CONFIG="none",
                   **trust_env(self.fingerprint))
        env.pop("LD_PRELOAD", None)
        return env

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for group in self.groups:  # workers of every generation, whatever is left of them
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        remove_state(self.state)
