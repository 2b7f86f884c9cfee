"""Shared test harness: the native build, a real gpupoold on a simulated GPU, client helpers.

Fixtures
  native_build    (session) runs `make -j2` once (SAN=1 for the sanitizer build) and returns the
                  build directory: $GPUPOOL_BUILD_DIR, default build/ (build-asan/ when
                  GPUPOOL_SAN=1).
  gpupool_server  (function) a `python -m gpupoold serve --simulated 1` on free loopback ports
                  with a temporary state dir, using the worker and simulated device of
                  native_build, TLS on its remoting port as gpupoold's default is (its own
                  identity). A GpupoolServer: .address, .http_url, .fingerprint (the identity
                  clients pin, from the `gpupoold: identity SHA256:...` line; None with
                  `--tls off`), .client_env(extra=None) (with GPUPOOL_TOKEN = .token, a user
                  token made for the tests, and GPUPOOL_TLS_FINGERPRINT = .fingerprint, or
                  GPUPOOL_TLS=0 for a plain-TCP daemon), .admin_token
                  (the daemon's local admin token), .create_token(), .api(method, path, body),
                  .get_json(path), .stop(), .kill(), .log_text(), .wait_for_log(), .build_dir.
                  At teardown it stops the daemon and fails the test if the daemon's log shows a
                  Python traceback or a sanitizer report.
  start_daemon    (function) a factory for daemons with other flags, without building first:
                  start_daemon(*extra_args, simulated=1, build_dir=..., native=True, env=None,
                  state_dir=None, tls=True) (state_dir: reuse a previous daemon's, as a restart
                  does; tls=False: `--tls off`, plain TCP, for the tests that speak the
                  plaintext protocol on raw sockets and say so).
  plain_server    (function) gpupool_server with `--tls off`: plain TCP on the remoting port.

Helpers (import them: `from conftest import require, run_client`)
  tls_connect(server, timeout=10) -> ssl.SSLSocket   a TLS connection to server's remoting port
                               that checks the certificate's key against server.fingerprint
                               (as a pinned client does), for tests that speak the protocol
                               on a socket of their own to a TLS daemon.
  require(condition, reason)   skip the test when condition is false, but FAIL under CI=true:
                               in CI every tier must run.
  run_client(cmd, env, timeout=120, cwd=None) -> CompletedProcess (text, both streams
                               captured); a program still running after `timeout` is killed and
                               the test fails (a hang is a bug).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() == "true"
SAN = os.environ.get("GPUPOOL_SAN") == "1"
BUILD_DIR = (REPO / os.environ.get("GPUPOOL_BUILD_DIR", "build-asan" if SAN else "build")).resolve()
STARTUP_TIMEOUT = 30.0
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:")

# The tests import the working tree's packages, whatever is installed.
for _p in (REPO / "protocol" / "python", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


# ------------------------------------------------------------------------------------ helpers
def require(condition: object, reason: str) -> None:
    """Skip when `condition` is false; under CI=true fail instead (no tier may skip in CI)."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required in CI (CI=true), but: {reason}", pytrace=False)
    pytest.skip(reason)


def run_client(cmd: Sequence[str | os.PathLike[str]], env: dict[str, str] | None = None,
               timeout: float = 120, cwd: str | os.PathLike[str] | None = None,
               ) -> subprocess.CompletedProcess[str]:
    """Run a client program to completion; a hang fails the test with what it printed."""
    try:
        return subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"{' '.join(map(str, cmd))} still running after {timeout} s (killed)\n"
                    f"--- stdout\n{out or ''}\n--- stderr\n{err or ''}", pytrace=False)


def daemon_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a gpupoold started by the tests: the working tree's packages."""
    env = dict(os.environ)
    paths = [str(REPO), str(REPO / "protocol" / "python")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("GPUPOOL_LOG", None)
    env.update(extra or {})
    return env


def wait_until(what: str, predicate: Callable[[], Any], timeout: float = 20,
               interval: float = 0.02) -> Any:
    """predicate()'s first true value, polled every `interval` s; AssertionError naming `what`
    after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _libasan() -> str | None:
    cc = os.environ.get("CC", "cc")
    try:
        out = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True,
                             text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out if os.path.isabs(out) else None


# ------------------------------------------------------------------------------------ daemon
class ApiError(Exception):
    """An error status from the daemon's HTTP API."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class GpupoolServer:
    """A gpupoold process (own process group: .kill() takes its workers with it)."""

    def __init__(self, args: Sequence[str], state_dir: Path, build_dir: Path,
                 env: dict[str, str] | None = None, wrapper: Sequence[str] = (),
                 public_host: str | None = None) -> None:
        """`wrapper`: a command the daemon runs under (e.g. `ip netns exec NS ...`: a server
        on a host of its own); `public_host`: the address the tests reach it at when it listens
        on every address (its HTTP listener then speaks HTTPS with its own identity, as
        gpupoold does off loopback by default)."""
        self.state_dir = state_dir
        self.build_dir = build_dir
        self.sanitized = SAN or build_dir.name == "build-asan"
        state_dir.mkdir(parents=True, exist_ok=True)
        # A restart on the same state dir gets its own log and test token.
        self.generation = len(list(state_dir.glob("gpupoold*.log")))
        suffix = f"-{self.generation}" if self.generation else ""
        self.log_path = state_dir / f"gpupoold{suffix}.log"
        self._log = self.log_path.open("wb")
        self.args = [sys.executable, "-m", "gpupoold", "serve", "--state-dir", str(state_dir),
                     *args]
        self.proc = subprocess.Popen([*wrapper, *self.args], stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=daemon_env(env), cwd=REPO,
                                     start_new_session=True)
        self.returncode: int | None = None
        self.killed = False
        try:
            self.address = self._wait_address("remoting")
            # `gpupoold: identity SHA256:...`, or `identity none (...)` with tls = "off"
            identity = self._wait_address("identity", r"(\S+).*")
            self.fingerprint: str | None = identity if identity.startswith("SHA256:") else None
            self.http_url = "http://" + self._wait_address("http")
            self.ssl_context: ssl.SSLContext | None = None
            if public_host is not None:
                self.address = _public(self.address, public_host)
                self.http_url = "https://" + _public(self.http_url[7:], public_host)
                self.wait_for_log(r"the HTTP listener speaks HTTPS")
                # The HTTPS certificate is the server's own identity: trusted as its own CA.
                self.ssl_context = ssl.create_default_context(
                    cafile=str(state_dir / "identity" / "server.crt"))
                self.ssl_context.check_hostname = False
        except BaseException:
            self.kill()
            raise
        self.host, _, port = self.address.rpartition(":")
        self.port = int(port)
        admin_file = state_dir / "local-admin.token"
        self.admin_token = admin_file.read_text().strip() if admin_file.is_file() else ""
        # Daemons sharing a PostgreSQL store share its token names: one test token each.
        shared = f"-{state_dir.name}" if "--database" in self.args else ""
        self.token = self.create_token(f"tests{suffix}{shared}") if self.admin_token else ""

    def create_token(self, name: str, role: str = "user", *extra: str) -> str:
        """A new API token made with `gpupoold token create` on this daemon's store (its state
        dir, or the PostgreSQL database its --database names)."""
        database = [a for i, a in enumerate(self.args[1:], 1) if self.args[i - 1] == "--database"]
        proc = subprocess.run(
            [sys.executable, "-m", "gpupoold", "token", "create", "--name", name, "--role", role,
             "--state-dir", str(self.state_dir), *(["--database", database[0]] if database else []),
             *extra],
            capture_output=True, text=True, env=daemon_env(), cwd=REPO, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"gpupoold token create failed ({proc.returncode}):\n"
                               f"{proc.stdout}\n{proc.stderr}")
        return proc.stdout.strip().splitlines()[-1]

    def _wait_address(self, what: str, value: str = r"on (\S+)") -> str:
        pattern = re.compile(rf"^gpupoold: {what} {value}$", re.M)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            m = pattern.search(self.log_text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"gpupoold exited with {self.proc.returncode} during start-up:"
                                   f"\n{self.log_text()}")
            time.sleep(0.05)
        raise RuntimeError(f"gpupoold did not announce its {what} address within "
                           f"{STARTUP_TIMEOUT} s:\n{self.log_text()}")

    def log_text(self) -> str:
        """Everything the daemon (and its workers, through it) printed so far."""
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout: float = 10) -> re.Match[str]:
        rx = re.compile(pattern, re.M)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.log_text())
            if m:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not in the daemon log after {timeout} s:\n"
                                     f"{self.log_text()}")
            time.sleep(0.05)

    def client_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """os.environ plus what a client of this daemon needs: our libcuda.so.1 first on
        LD_LIBRARY_PATH, GPUPOOL_SERVER, GPUPOOL_CONFIG=none, no GPUPOOL_LOG; with the sanitizer build, libasan
        preloaded (the shim is instrumented, the program is not) and leak checks off."""
        env = dict(os.environ)
        env.pop("GPUPOOL_LOG", None)
        env.pop("GPUPOOL_TOKEN", None)
        for var in ("GPUPOOL_TLS", "GPUPOOL_TLS_FINGERPRINT", "GPUPOOL_TLS_CA"):
            env.pop(var, None)
        lib = [str(self.build_dir / "client")]
        if env.get("LD_LIBRARY_PATH"):
            lib.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(lib)
        env["GPUPOOL_SERVER"] = self.address
        # No config file: the tests' clients see exactly this environment, never the
        # ~/.config/gpupool/config.toml of whoever runs them (a test may pass its own).
        env["GPUPOOL_CONFIG"] = "none"
        if self.token:
            env["GPUPOOL_TOKEN"] = self.token
        # TLS by default, pinned to this daemon's identity; a daemon with tls = "off" is
        # reached in plain TCP only because the client says so too.
        if self.fingerprint is not None:
            env["GPUPOOL_TLS_FINGERPRINT"] = self.fingerprint
        else:
            env["GPUPOOL_TLS"] = "0"
        if self.sanitized:
            asan = _libasan()
            if asan:
                env["LD_PRELOAD"] = ":".join(filter(None, [asan, env.get("LD_PRELOAD")]))
            env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
        env.update(extra or {})
        return env

    def get_json(self, path: str, timeout: float = 10, token: str | None = None) -> Any:
        """GET an API path as the local admin (or with `token`)."""
        return self.api("GET", path, timeout=timeout, token=token)

    def api(self, method: str, path: str, body: Any = None, token: str | None = None,
            timeout: float = 10) -> Any:
        """Call the HTTP API; raises ApiError (.status, .body) on an error status."""
        token = self.admin_token if token is None else token
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.http_url + path, data=data, method=method)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.ssl_context) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            with exc:  # an HTTPError holds the connection: close it here, not at GC time
                raise ApiError(exc.code, exc.read().decode(errors="replace")) from None

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM and wait; returns the exit status (0 is a clean stop)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"gpupoold did not stop within {timeout} s of SIGTERM:\n"
                                     f"{self.log_text()}") from None
        self.returncode = self.proc.returncode
        self._log.close()
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the daemon and its workers (its whole process group)."""
        self.killed = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.returncode = self.proc.returncode
        self._log.close()

    def kill_daemon_only(self) -> None:
        """SIGKILL the daemon process alone, as a crash would: its workers must notice."""
        self.killed = True
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.returncode = self.proc.returncode
        self._log.close()

    def reap_group(self) -> None:
        """Kill whatever is left in the process group (workers of a killed daemon)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def problems(self) -> list[str]:
        """Lines of the log that mean a daemon bug or a sanitizer report."""
        marks = ("Traceback (most recent call last)", *SANITIZER_MARKS)
        return [line for line in self.log_text().splitlines() if any(m in line for m in marks)]


def _public(address: str, host: str) -> str:
    """`address` (HOST:PORT as a daemon announced it) with `host` for a wildcard host."""
    bound, _, port = address.rpartition(":")
    return f"{host}:{port}" if bound in ("0.0.0.0", "[::]", "") else address


def tls_connect(server: GpupoolServer, timeout: float = 10) -> ssl.SSLSocket:
    """A TLS connection to `server`'s remoting port, refused (ssl.SSLError) unless the key of
    the certificate it presents has `server.fingerprint`: what a pinned client checks."""
    from gpupoold.tls_identity import fingerprint_of_der_cert

    assert server.fingerprint is not None, "the daemon serves plain TCP (tls = \"off\")"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the pin below is the check, as in client/common/tls.c
    raw = socket.create_connection((server.host, server.port), timeout=timeout)
    sock = ctx.wrap_socket(raw, server_hostname=None)
    der = sock.getpeercert(binary_form=True)
    if der is None or fingerprint_of_der_cert(der) != server.fingerprint:
        sock.close()
        raise ssl.SSLError(f"the server's key is not {server.fingerprint}")
    return sock


def native_paths(build_dir: Path) -> list[str]:
    """--worker/--sim-lib flags for the binaries of build_dir that exist."""
    args = []
    for flag, name in (("--worker", "gpupool-worker"), ("--sim-lib", "libgpupool-sim.so")):
        if (build_dir / name).is_file():
            args += [flag, str(build_dir / name)]
    return args


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture
def clients() -> Iterator[list[subprocess.Popen[str]]]:
    """Client processes of a test: killed and reaped at its end, whatever happened."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


@contextlib.contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Held while `out` is checked and built. The test processes of a parallel run
    (pytest-xdist, scripts/test.sh) share the build directory: one must not run a program
    another is still writing, nor build it a second time. A lock file beside it (under build/)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(autouse=True)
def _collect_garbage_after_each_test() -> Iterator[None]:
    """A socket or file a test forgets to close is reported (a ResourceWarning, an error here)
    when the garbage collector finds it. Collected after each test, so the report lands on the
    test that leaked it, not on whichever test of the same process (pytest-xdist runs many
    files in one) happens to be running when the collector comes by."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def native_build() -> Path:
    """Build the native code once per session (make -j2); the build directory. One make at a
    time across the processes of a parallel run (build_lock)."""
    build = BUILD_DIR.relative_to(REPO) if BUILD_DIR.is_relative_to(REPO) else BUILD_DIR
    cmd = ["make", "-C", str(REPO), "-j2", f"BUILD={build}"]
    if SAN or BUILD_DIR.name == "build-asan":
        cmd.append("SAN=1")
    with build_lock(BUILD_DIR / "make"):
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"native build failed: {' '.join(cmd)}\n{proc.stdout[-6000:]}\n"
                    f"{proc.stderr[-6000:]}", pytrace=False)
    return BUILD_DIR


@pytest.fixture
def start_daemon(tmp_path_factory: pytest.TempPathFactory,
                 ) -> Iterator[Callable[..., GpupoolServer]]:
    started: list[GpupoolServer] = []

    def start(*extra: str, simulated: int | None = 1, build_dir: Path = BUILD_DIR,
              native: bool = True, env: dict[str, str] | None = None,
              state_dir: Path | None = None, tls: bool = True) -> GpupoolServer:
        args = ["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"]
        if not tls:  # plain TCP, said explicitly (gpupoold's default is TLS)
            args += ["--tls", "off"]
        if simulated is not None:
            args += ["--simulated", str(simulated)]
        if native:
            args += native_paths(build_dir)
        server = GpupoolServer([*args, *extra], state_dir or tmp_path_factory.mktemp("gpupoold"),
                               build_dir, env)
        started.append(server)
        return server

    yield start
    problems: list[str] = []
    for server in started:
        if server.running:
            code = server.stop()
            if code != 0:
                problems.append(f"gpupoold exited with {code} on SIGTERM")
        server.reap_group()
        problems += server.problems()
    if problems:
        pytest.fail("daemon log shows problems:\n" + "\n".join(problems), pytrace=False)


@pytest.fixture
def gpupool_server(native_build: Path, start_daemon: Callable[..., GpupoolServer],
                   ) -> GpupoolServer:
    """gpupoold on 1 simulated GPU with the worker of native_build, on free loopback ports."""
    return start_daemon(build_dir=native_build)


@pytest.fixture
def plain_server(native_build: Path, start_daemon: Callable[..., GpupoolServer],
                 ) -> GpupoolServer:
    """gpupool_server with `tls = "off"`: plain TCP on the remoting port, for tests that speak
    the plaintext protocol on raw sockets (the clients of client_env() say GPUPOOL_TLS=0)."""
    return start_daemon(build_dir=native_build, tls=False)


@pytest.fixture(scope="session", autouse=True)
def _remove_simulated_gpu_memory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Simulated GPU memory lives in /dev/shm (gpupoold/gpu/sim.py); remove what this session's
    daemons made there (each folder names its state dir), not other runs' folders."""
    yield
    from gpupoold.gpu.sim import SHM, STATE_DIR_NOTE

    base = tmp_path_factory.getbasetemp().resolve()
    for folder in SHM.glob(f"gpupool-sim-{os.getuid()}-*"):
        try:
            owner = Path((folder / STATE_DIR_NOTE).read_text().strip())
        except OSError:
            continue
        if owner.is_relative_to(base):
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(name="run_client")
def run_client_fixture() -> Callable[..., subprocess.CompletedProcess[str]]:
    return run_client


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Any]:
    """A real PostgreSQL for the session (tests/pg_server.py); a test tier that needs one and
    cannot have it is skipped, and fails under CI=true."""
    import pg_server as pgs

    require(not (why := pgs.available()), why)
    server = pgs.PgServer()
    yield server
    server.close()


@pytest.fixture
def pg_url(pg_server: Any) -> str:
    """The URL of a fresh, empty database on the session's PostgreSQL."""
    return pg_server.new_database()


@pytest.fixture(name="require")
def require_fixture() -> Callable[[object, str], None]:
    return require


def have(tool: str) -> bool:
    return shutil.which(tool) is not None
