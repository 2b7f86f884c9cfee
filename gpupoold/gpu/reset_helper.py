"""gpupool-reset-helper: the small privileged program that fully resets a GPU for gpupoold.

`nvidia-smi -r` needs root, and gpupoold faces the network, so the reset lives here: a root
process (its own systemd unit) that does one thing. It listens on a Unix socket (`--socket`, or
the socket systemd passes with LISTEN_FDS/LISTEN_PID), mode 0660, group `--group`, and takes one
JSON request per connection:

    {"gpu_uuid": "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"}

It answers `{"ok": bool, "error": "...", "duration_s": F, "output": "..."}` and closes. Before a
reset it checks the preconditions (NVIDIA's, see docs): the UUID is a GPU of this machine; no
compute or graphics process uses it; no process uses any other GPU either, unless
`--allow-busy-peers` (some systems cannot reset one GPU while others compute); no other reset is
running. It then releases its own NVML session (a reset fails while any NVML client holds the GPU)
and runs exactly `nvidia-smi -r -i <index>` (fixed argv, no shell, `--reset-timeout`). A GPU that
was in persistence mode is put back in it afterwards if the reset turned it off.

Every request and its outcome is logged to stderr (the journal). Standard library and pynvml
only (through gpupoold.nvml, which imports nothing else).
"""

from __future__ import annotations

import argparse
import grp
import json
import logging
import os
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from gpupoold.gpu.nvml import GpuProcess, Nvml, NvmlUnavailable
from gpupoold.log import handler as log_handler

log = logging.getLogger("gpupool-reset-helper")

DEFAULT_SOCKET = Path("/run/gpupoold/reset.sock")
DEFAULT_RESET_TIMEOUT = 90.0  # below gpupoold's own wait (120 s), so the daemon gets the answer
MAX_REQUEST = 4096
READ_TIMEOUT = 10.0  # seconds a client has to send its request
MAX_CONNECTIONS = 8  # connection threads at once; more are closed unanswered
MAX_OUTPUT = 4000
SD_LISTEN_FDS_START = 3
UUID_RE = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# nvidia-smi runs with this environment only: nothing from whoever started us leaks into it.
CHILD_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def _proc_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _describe(procs: tuple[GpuProcess, ...]) -> str:
    return ", ".join(f"pid {p.pid} ({_proc_name(p.pid)})" for p in procs)


class ResetHelper:
    """The request handler and accept loop; `nvml` and `nvidia_smi` are injectable for tests."""

    def __init__(self, nvml: Nvml, nvidia_smi: str, *, allow_busy_peers: bool = False,
                 reset_timeout: float = DEFAULT_RESET_TIMEOUT) -> None:
        self.nvml = nvml
        self.nvidia_smi = nvidia_smi
        self.allow_busy_peers = allow_busy_peers
        self.reset_timeout = reset_timeout
        self._busy = threading.Lock()  # held for the whole of one reset
        self._busy_with = ""
        self._busy_since = 0.0
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.poll_interval = 0.5  # seconds between looks at the stop flag

    # ----------------------------------------------------------------- requests
    def handle(self, raw: bytes) -> dict[str, Any]:
        """One request (the bytes a client sent) -> the reply. Never raises."""
        t0 = time.monotonic()
        try:
            req = json.loads(raw)
        except ValueError:
            return self._reply(False, t0, 'the request is not JSON: send {"gpu_uuid": "GPU-..."}')
        uuid = req.get("gpu_uuid") if isinstance(req, dict) else None
        if not isinstance(uuid, str) or not UUID_RE.fullmatch(uuid):
            return self._reply(False, t0, 'the request needs "gpu_uuid": "GPU-xxxxxxxx-xxxx-xxxx-'
                                          f'xxxx-xxxxxxxxxxxx" (got {req!r:.120})')
        if not self._busy.acquire(blocking=False):
            return self._reply(False, t0, f"another reset is running ({self._busy_with}, for "
                                          f"{time.monotonic() - self._busy_since:.1f} s): try again "
                                          "when it is done")
        self._busy_with, self._busy_since = uuid, time.monotonic()
        try:
            return self._reset(uuid, t0)
        except NvmlUnavailable as exc:
            return self._reply(False, t0, f"NVML is not available to the reset helper: {exc}")
        except Exception as exc:  # a bug must answer the daemon, not hang it
            log.exception("reset of %s failed", uuid)
            return self._reply(False, t0, f"internal error in the reset helper: {exc}")
        finally:
            with suppress(Exception):
                self.nvml.shutdown()
            self._busy_with = ""
            self._busy.release()

    @staticmethod
    def _reply(ok: bool, t0: float, error: str = "", output: str = "") -> dict[str, Any]:
        return {"ok": ok, "error": error, "duration_s": round(time.monotonic() - t0, 3),
                "output": output[-MAX_OUTPUT:]}

    def _reset(self, uuid: str, t0: float) -> dict[str, Any]:
        errors: list[str] = []
        index = self.nvml.index_of_uuid(uuid, errors)
        if index is None:
            why = f" (NVML: {'; '.join(errors)})" if errors else ""
            return self._reply(False, t0, f"no GPU with UUID {uuid} on this machine{why}")
        procs = self.nvml.processes(index, graphics=True, errors=errors)
        if procs is None:
            return self._reply(False, t0, f"cannot list the processes on GPU {index} "
                                          f"({'; '.join(errors) or 'not supported'}): refusing to "
                                          "reset a GPU that may be in use")
        if procs:
            return self._reply(False, t0, f"GPU {index} is in use by {_describe(procs)}: a reset "
                                          "needs the GPU idle; stop those processes first")
        if not self.allow_busy_peers:
            busy = []
            for other in range(self.nvml.device_count()):
                if other == index:
                    continue
                peer_procs = self.nvml.processes(other, graphics=True, errors=errors)
                if peer_procs is None:
                    busy.append(f"GPU {other}: cannot list its processes")
                elif peer_procs:
                    busy.append(f"GPU {other}: {_describe(peer_procs)}")
            if busy:
                return self._reply(False, t0, "other GPUs are in use (" + "; ".join(busy) + "); "
                                   "on many systems nvidia-smi -r needs every GPU idle: retry "
                                   "when they are, or start the helper with --allow-busy-peers "
                                   "if this system resets GPUs individually")
        persistent = self.nvml.persistence_mode(index)
        # Our own NVML session would make the reset fail ("in use by another client").
        self.nvml.shutdown()
        argv = [self.nvidia_smi, "-r", "-i", str(index)]
        log.warning("resetting GPU %d (%s): %s", index, uuid, " ".join(argv))
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, env=CHILD_ENV,
                                  timeout=self.reset_timeout, check=False)
        except subprocess.TimeoutExpired as exc:  # run() has killed it
            out = (exc.output or b"").decode(errors="replace")
            return self._reply(False, t0, f"nvidia-smi -r -i {index} did not finish within "
                                          f"{self.reset_timeout:g} s and was killed; the GPU may "
                                          "be unusable: check `nvidia-smi` and `dmesg`", out)
        except OSError as exc:
            return self._reply(False, t0, f"cannot run {self.nvidia_smi}: {exc.strerror}; "
                                          "pass the right path with --nvidia-smi")
        output = done.stdout.decode(errors="replace")
        if done.returncode != 0:
            last = output.strip().splitlines()[-1] if output.strip() else "no output"
            return self._reply(False, t0, f"nvidia-smi -r -i {index} failed (exit "
                                          f"{done.returncode}): {last}", output)
        if persistent:
            output += self._restore_persistence(index)
        return self._reply(True, t0, "", output)

    def _restore_persistence(self, index: int) -> str:
        try:
            if self.nvml.persistence_mode(index) is False:
                err = self.nvml.set_persistence_mode(index, True)
                if err:
                    log.warning("GPU %d: cannot restore persistence mode: %s", index, err)
                    return f"\nwarning: persistence mode was on and could not be restored: {err}\n"
                return "\npersistence mode restored\n"
        except NvmlUnavailable as exc:
            return f"\nwarning: persistence mode was on; NVML unavailable after the reset: {exc}\n"
        return ""

    # ------------------------------------------------------------- connections
    def serve_connection(self, conn: socket.socket) -> None:
        with conn:
            peer = "peer unknown"
            with suppress(OSError):
                pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
                peer = f"pid {pid} uid {uid}"
            try:
                raw = _read_request(conn)
            except (OSError, ValueError) as exc:
                log.warning("request from %s: not read (%s)", peer, exc)
                return
            log.info("request from %s: %s", peer, raw[:200].decode(errors="replace").strip())
            reply = self.handle(raw)
            log.log(logging.INFO if reply["ok"] else logging.WARNING,
                    "reply to %s: ok=%s %s(%.1f s)", peer, reply["ok"],
                    f"{reply['error']} " if reply["error"] else "", reply["duration_s"])
            with suppress(OSError):
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def serve(self, listener: socket.socket, stop: threading.Event) -> None:
        """Accept connections until `stop` is set, then wait for a running reset to finish."""
        listener.settimeout(self.poll_interval)  # to notice `stop`
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if stop.is_set():
                    break
                log.error("accept failed: %s", exc)
                time.sleep(0.5)
                continue
            if not self._slots.acquire(blocking=False):
                log.warning("too many connections at once: closing one unanswered")
                conn.close()
                continue
            threading.Thread(target=self._run_connection, args=(conn,), daemon=True).start()
        if self._busy.acquire(timeout=self.reset_timeout + 5):
            self._busy.release()

    def _run_connection(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(READ_TIMEOUT)
            self.serve_connection(conn)
        finally:
            self._slots.release()


def _read_request(conn: socket.socket) -> bytes:
    """Bytes up to the first newline or the end of the stream; ValueError when too long."""
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(MAX_REQUEST)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST:
            raise ValueError(f"request longer than {MAX_REQUEST} bytes")
    return data.split(b"\n", 1)[0]


# ---------------------------------------------------------------------- start-up
class SetupError(Exception):
    pass


def systemd_socket() -> socket.socket | None:
    """The listening socket systemd passed (socket activation), or None."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    count = int(os.environ.get("LISTEN_FDS", "0") or 0)
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    if count < 1:
        return None
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise SetupError("systemd passed a socket that is not a Unix stream socket: set "
                         "ListenStream=/run/gpupoold/reset.sock in gpupool-reset-helper.socket")
    return sock


def bind_socket(path: Path, group: str | None) -> socket.socket:
    """A listening Unix socket at `path`, mode 0660, group `group`."""
    gid = -1
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise SetupError(f"--group {group}: no such group (create it, or give gpupoold's "
                             "group)") from None
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        st = path.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise SetupError(f"--socket {path}: exists and is not a socket; remove it or choose "
                             "another path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale socket of a helper that is gone
        else:
            raise SetupError(f"--socket {path}: another reset helper is listening there")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # no moment where the socket is open to everyone
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chown(path, -1, gid)
    os.chmod(path, 0o660)
    sock.listen(16)
    return sock


def find_nvidia_smi(configured: str | None) -> str:
    if configured:
        if not (os.path.isfile(configured) and os.access(configured, os.X_OK)):
            raise SetupError(f"--nvidia-smi {configured}: not an executable file")
        return os.path.abspath(configured)
    found = shutil.which("nvidia-smi", path=os.environ.get("PATH", CHILD_ENV["PATH"]))
    if not found:
        raise SetupError("nvidia-smi not found on PATH: install the NVIDIA driver utilities, "
                         "or pass --nvidia-smi PATH")
    return found


def build_parser() -> argparse.ArgumentParser:
    """The command line (also the source of its man page, scripts/man_pages.py)."""
    p = argparse.ArgumentParser(prog="gpupool-reset-helper",
                                description="Privileged GPU reset helper for gpupoold (run as root).")
    p.add_argument("--socket", type=Path, default=DEFAULT_SOCKET,
                   help=f"Unix socket to listen on (default {DEFAULT_SOCKET}); ignored when "
                        "systemd passes one (socket activation)")
    p.add_argument("--group", help="group owning the socket (gpupoold's group); mode is 0660")
    p.add_argument("--nvidia-smi", help="path of nvidia-smi (default: found on PATH)")
    p.add_argument("--allow-busy-peers", action="store_true",
                   help="reset a GPU even while processes use other GPUs (only where the system "
                        "supports resetting one GPU alone)")
    p.add_argument("--reset-timeout", type=float, default=DEFAULT_RESET_TIMEOUT,
                   help=f"seconds nvidia-smi -r may take (default {DEFAULT_RESET_TIMEOUT:g})")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None, nvml: Nvml | None = None) -> int:
    args = parse_args(argv)
    root = logging.getLogger()
    root.handlers[:] = [log_handler(sys.stderr, "gpupool-reset-helper: %(levelname)s %(message)s",
                                    journal_prefix="", identifier="gpupool-reset-helper")]
    root.setLevel(logging.INFO)
    try:
        smi = find_nvidia_smi(args.nvidia_smi)
        listener = systemd_socket()
        bound = listener is None
        if listener is None:
            listener = bind_socket(args.socket, args.group)
    except (SetupError, OSError) as exc:
        log.error("%s", exc)
        return 2
    if os.geteuid() != 0:
        log.warning("not running as root: nvidia-smi -r will be refused")
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    helper = ResetHelper(nvml if nvml is not None else Nvml(), smi,
                         allow_busy_peers=args.allow_busy_peers, reset_timeout=args.reset_timeout)
    where = args.socket if bound else "the socket from systemd"
    log.info("listening on %s (nvidia-smi: %s%s)", where, smi,
             ", busy peers allowed" if args.allow_busy_peers else "")
    try:
        helper.serve(listener, stop)
    finally:
        listener.close()
        if bound:
            with suppress(OSError):
                args.socket.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
