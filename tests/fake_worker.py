"""A stand-in for gpupool-worker that follows the worker contract, for the daemon's tests.

    fake_worker.py MODE --fd N --driver PATH --device ORDINAL --cache-dir DIR --session-id ID
                   --hello-req REQ [--simulated]

It reads the hello body from stdin, checks it, answers the hello on fd N (like the real worker)
and then, by MODE:
  serve     answer pings until goodbye or EOF, exit 0
  exit3     exit with code 3 right after the hello reply
  stubborn  ignore SIGTERM and sleep (the daemon must SIGKILL it)
  noreply   print a setup error and exit 1 without answering
Each step is printed to stderr (the daemon forwards it to its log).
"""

from __future__ import annotations

import argparse
import signal
import socket
import struct
import sys
import time

import gpupool_protocol as gp


def say(text: str) -> None:
    print(f"fake-worker: {text}", file=sys.stderr, flush=True)


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["serve", "exit3", "stubborn", "noreply"])
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--driver", required=True)
    ap.add_argument("--device", type=int, required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--session-id", type=int, required=True)
    ap.add_argument("--hello-req", type=int, required=True)
    ap.add_argument("--simulated", action="store_true")
    args = ap.parse_args()
    if args.mode == "stubborn":
        signal.signal(signal.SIGTERM, lambda *_: say("ignoring SIGTERM"))
    hello = gp.Hello.decode(sys.stdin.buffer.read())
    say(f"session {args.session_id} hello from {hello.user}@{hello.host} "
        f"device {args.device} simulated={int(args.simulated)}")
    if args.mode == "noreply":
        say("setup failed (on purpose)")
        return 1
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(True)
    reply = gp.HelloReply(result=0, major=gp.MAJOR, minor=gp.MINOR, server="fake-worker",
                          session_id=args.session_id, simulated=int(args.simulated),
                          name="fake worker (simulated)", total_mem=1 << 30)
    sock.sendall(gp.encode_frame(reply, args.hello_req))
    say("ready")
    if args.mode == "exit3":
        return 3
    if args.mode == "stubborn":
        while True:
            time.sleep(1)
    while True:
        header = recv_exact(sock, gp.HEADER.size)
        if header is None:
            say("client left")
            return 0
        length, op, _flags, req = gp.HEADER.unpack(header)
        body = recv_exact(sock, length) if length else b""
        if body is None:
            return 0
        if op == gp.Goodbye.OP:
            say("goodbye")
            return 0
        if op == gp.Ping.OP:
            (token,) = struct.unpack("<Q", body)
            sock.sendall(gp.encode_frame(gp.PingReply(result=0, token=token), req))


if __name__ == "__main__":
    sys.exit(main())
