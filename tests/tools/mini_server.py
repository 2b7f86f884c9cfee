#!/usr/bin/env python3
"""A minimal stand-in for gpupoold's remoting listener, for testing the client shim alone.

It accepts TCP connections, reads each client's hello frame and hands the socket to a new
gpupool-worker (the hello body on its stdin), as the daemon does, without authentication,
scheduling or leases. It prints "listening on HOST:PORT" once it is ready. It speaks plain TCP
(no TLS, unlike gpupoold's default): its clients must say so with GPUPOOL_TLS=0.

    python3 tests/tools/mini_server.py --worker build/gpupool-worker \
        --driver build/libgpupool-sim.so --simulated [--port 0] [--cache-dir DIR] \
        [--hello-log FILE] [--queue-notices N] [--devices 0,1,2,3] [--spread-parts JSON]

--hello-log appends each decoded hello to FILE as one JSON line (what the client asked for);
--queue-notices sends N GP_INFO_QUEUED notices before the worker answers, as the daemon does
while a client waits in its queue; --devices gives each client a lease of those GPUs (the
worker's --devices, what gpupoold's worker_session says).
--spread-parts answers a hello that is not a part's (spread_group 0) as a fleet answers one it
serves in parts (protocol 1.8, issue 37): GP_EREDIRECT with redirect_parts, from a JSON list of
{"server", "gpus"[, "fingerprint", "first_device", "refuse"]} ("self" is this server's address;
a part's first_device is the sum of the gpus before it unless given, so a test can give a wrong
one). A part's hello (spread_group != 0) goes to a worker with devices 0..gpus-1, unless its
part has "refuse": then it is refused (GP_EREFUSED) with that text, as a server whose part is no
longer held refuses it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "protocol" / "python"))
import gpupool_protocol as gp  # noqa: E402

HEADER = struct.Struct("<IHHQ")  # len, op, flags, req
OP_HELLO = 1
MAX_HELLO = 64 << 10


def read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("client closed the connection before its hello")
        buf += chunk
    return bytes(buf)


def serve_one(conn: socket.socket, args: argparse.Namespace, session_id: int) -> None:
    try:
        conn.settimeout(10)
        length, op, _flags, req = HEADER.unpack(read_exact(conn, HEADER.size))
        if op != OP_HELLO or length > MAX_HELLO:
            print(f"mini_server: first frame is op {op} ({length} bytes), not hello", file=sys.stderr)
            return
        body = read_exact(conn, length)
        conn.settimeout(None)
        if args.hello_log:
            hello = gp.Hello.decode(body)
            record = {k: getattr(hello, k) for k in (
                "pid", "host", "user", "program", "gpu", "model", "min_memory", "va_base",
                "va_size", "flags", "gpus", "spread_group", "part", "parts")}
            with args.log_lock, open(args.hello_log, "a") as f:
                f.write(json.dumps(record) + "\n")
        address = "%s:%d" % conn.getsockname()[:2]
        devices = args.devices
        if args.spread_parts:
            hello = gp.Hello.decode(body)
            if not hello.spread_group:
                conn.sendall(gp.encode_frame(spread_redirect(args.spread_parts, address), req))
                return
            spec = json.loads(args.spread_parts)
            if hello.part < len(spec) and spec[hello.part].get("refuse"):
                conn.sendall(gp.encode_frame(gp.HelloReply(
                    result=gp.GP_EREFUSED, major=gp.MAJOR, minor=gp.MINOR,
                    message=spec[hello.part]["refuse"]), req))
                conn.recv(1)  # until the client closes: it must not wait for anything else
                return
            devices = ",".join(str(d) for d in range(hello.gpus)) if hello.gpus > 1 else ""

        for i in range(args.queue_notices):  # as if one went out every 5 s
            position = args.queue_notices - i
            text = (f"waiting for a GPU on {address}: position {position} of "
                    f"{args.queue_notices} in the queue (waited {5 * i} s)")
            conn.sendall(gp.encode_frame(gp.Notice(code=gp.GP_INFO_QUEUED, op=0, text=text), 0))
        cmd = [
            args.worker, "--fd", str(conn.fileno()), "--driver", args.driver,
            "--device", str(args.device), "--cache-dir", args.cache_dir,
            "--session-id", str(session_id), "--hello-req", str(req),
        ]
        if args.simulated:
            cmd.append("--simulated")
        if devices:
            cmd += ["--devices", devices]
        env = dict(os.environ)
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(conn.fileno(),), env=env)
        assert proc.stdin is not None
        proc.stdin.write(body)
        proc.stdin.close()
        conn.close()  # the worker owns the connection now
        rc = proc.wait()
        if args.verbose:
            print(f"mini_server: session {session_id} ended, worker exit {rc}", file=sys.stderr)
    except (OSError, ConnectionError, gp.ProtocolError) as exc:
        print(f"mini_server: {exc}", file=sys.stderr)
    finally:
        try:
            conn.close()
        except OSError:
            pass


def spread_redirect(spec: str, address: str) -> gp.HelloReply:
    """The fleet's answer naming the parts of a spread lease (--spread-parts)."""
    parts, first = [], 0
    for item in json.loads(spec):
        server = address if item["server"] == "self" else item["server"]
        parts.append(gp.RedirectPart(server=server, fingerprint=item.get("fingerprint", ""),
                                     gpus=item["gpus"],
                                     first_device=item.get("first_device", first)))
        first += item["gpus"]
    return gp.HelloReply(result=gp.GP_EREDIRECT, major=gp.MAJOR, minor=gp.MINOR,
                         message=f"no one server has {first} free GPUs: {len(parts)} parts",
                         spread_group=0x5EED, redirect_parts=parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--worker", default="build/gpupool-worker")
    ap.add_argument("--driver", default="build/libgpupool-sim.so")
    ap.add_argument("--simulated", action="store_true")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--devices", default="",
                    help="a lease of several GPUs for each client, e.g. 0,1,2,3 (issue 37)")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--max-sessions", type=int, default=0, help="exit after this many (0: never)")
    ap.add_argument("--hello-log", default=None, help="append each hello as a JSON line here")
    ap.add_argument("--queue-notices", type=int, default=0,
                    help="queue notices to send before the worker answers each hello")
    ap.add_argument("--spread-parts", default="",
                    help="answer a hello that is not a part's with these parts (JSON list)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    args.log_lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="gpupool-mini-") as tmp:
        if args.cache_dir is None:
            args.cache_dir = tmp
        os.makedirs(args.cache_dir, exist_ok=True)
        return serve(args)


def serve(args: argparse.Namespace) -> int:

    lsock = socket.create_server((args.host, args.port), reuse_port=False)
    host, port = lsock.getsockname()[:2]
    print(f"listening on {host}:{port}", flush=True)
    session_id = 0
    threads = []
    try:
        while True:
            conn, _ = lsock.accept()
            session_id += 1
            t = threading.Thread(target=serve_one, args=(conn, args, session_id), daemon=True)
            t.start()
            threads.append(t)
            if args.max_sessions and session_id >= args.max_sessions:
                break
    except KeyboardInterrupt:
        pass
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
