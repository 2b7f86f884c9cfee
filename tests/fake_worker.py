"""A stand-in for gpupool-worker in control mode (worker/README.md), for the daemon's tests.

    fake_worker.py MODE --control-fd N --driver PATH --device ORDINAL --cache-dir DIR
                   [--simulated] [--adopt-dir DIR --orphan-grace SECONDS]
                   [--sandbox-rw DIR ...] [--sandbox-ro PATH ...] [--no-sandbox]

It never claims its session can outlive the daemon (worker_started has adoptable 0, so gpupoold
stops it with itself, as it stops a worker that cannot listen for adoption). It speaks the
spec's control messages (protocol/gpupool.toml, "control"): sends worker_ready, waits for
worker_session (the client socket comes with it), answers the hello like the real worker and
then, by MODE:
  serve     answer pings (and mem_alloc, reporting the memory in worker_stats) until goodbye
            (ended: client exit) or end of stream (client lost);
            a worker_end message sends the client a notice and ends with "server ended"
  exit3     exit with code 3 right after the hello reply, without worker_ended (a crash)
  stubborn  ignore SIGTERM and sleep (the daemon must SIGKILL it)
  noinit    report a set-up failure (worker_failed) and exit 1 before worker_ready
Each step is printed to stderr (the daemon forwards it to its log).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import struct
import sys
import time

import gpupool_protocol as gp


def say(text: str) -> None:
    print(f"fake-worker: {text}", file=sys.stderr, flush=True)


def event(ctl: socket.socket, msg: object) -> None:
    ctl.send(gp.encode_frame(msg))


def control_message(packet: bytes) -> object:
    """The daemon's message in one packet."""
    length, op, _flags, _req = gp.HEADER.unpack_from(packet)
    assert length == len(packet) - gp.HEADER.size, (length, len(packet))
    return gp.REQUESTS[op].decode(packet[gp.HEADER.size:])


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
    ap.add_argument("mode", choices=["serve", "exit3", "stubborn", "noinit"])
    ap.add_argument("--control-fd", type=int, required=True)
    ap.add_argument("--driver", required=True)
    ap.add_argument("--device", type=int, required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--simulated", action="store_true")
    ap.add_argument("--adopt-dir")
    ap.add_argument("--orphan-grace", type=float, default=0.0)
    # the sandbox's options (worker/sandbox.c): the fake worker confines nothing, but it must
    # take the same command line as the real one
    ap.add_argument("--sandbox-rw", action="append", default=[])
    ap.add_argument("--sandbox-ro", action="append", default=[])
    ap.add_argument("--no-sandbox", action="store_true")
    args = ap.parse_args()
    ctl = socket.socket(fileno=args.control_fd)
    if args.mode == "noinit":
        say("set-up failed (on purpose)")
        event(ctl, gp.WorkerFailed(error="fake set-up failure: the driver is on holiday"))
        return 1
    if args.mode == "stubborn":
        signal.signal(signal.SIGTERM, lambda *_: say("ignoring SIGTERM"))
    say(f"pre-started on device {args.device} simulated={int(args.simulated)} "
        f"CUDA_DEVICE_ORDER={os.environ.get('CUDA_DEVICE_ORDER')}")
    event(ctl, gp.WorkerReady(pid=os.getpid(), init_ms=1.0, device="fake worker (simulated)"))
    msg, fds, _flags, _addr = socket.recv_fds(ctl, 1 << 16, 1)
    if not msg:
        say("daemon gone before a session")
        return 0
    session = control_message(msg)
    assert isinstance(session, gp.WorkerSession) and len(fds) == 1, (session, fds)
    session_id, hello_req, body = session.session_id, session.hello_req, session.hello
    hello = gp.Hello.decode(body, allow_trailing=gp.Hello.decode(body, True).minor > gp.MINOR)
    say(f"session {session_id} hello from {hello.user}@{hello.host} devices "
        f"{list(session.devices)} memory_quota {session.memory_quota}")
    sock = socket.socket(fileno=fds[0])
    sock.setblocking(True)
    reply = gp.HelloReply(result=0, major=gp.MAJOR, minor=gp.MINOR, server="fake-worker",
                          session_id=session_id, simulated=int(args.simulated),
                          name="fake worker (simulated)", total_mem=1 << 30,
                          device_count=max(1, len(session.devices)))
    sock.sendall(gp.encode_frame(reply, hello_req))
    event(ctl, gp.WorkerStarted(session_id=session_id, adoptable=0))
    if args.mode == "exit3":
        return 3
    if args.mode == "stubborn":
        while True:
            time.sleep(1)
    started = time.monotonic()
    held = [0]  # bytes "allocated" (MemAlloc)

    def end(reason: str, detail: str = "") -> int:
        counters = gp.WorkerCounters(calls_other=1, duration_s=time.monotonic() - started,
                                     latency_counts=[1] + [0] * 17,  # the one call
                                     latency_sum_ns=20_000)
        event(ctl, gp.WorkerEnded(in_session=1, session_id=session_id, reason=reason,
                                  detail=detail, counters=counters))
        return 0

    while True:
        ready, _, _ = select.select([sock, ctl], [], [])
        if ctl in ready:
            data = ctl.recv(1 << 16)
            if not data:
                say("daemon gone")
                return 0
            msg = control_message(data)
            if isinstance(msg, gp.WorkerEnd):
                code, text = msg.code, msg.text
                sock.sendall(gp.encode_frame(gp.Notice(code=code, op=0, text=text), 0))
                say(f"ended by the server: {text}")
                return end("server ended", text)
        if sock in ready:
            header = recv_exact(sock, gp.HEADER.size)
            if header is None:
                say("client left")
                return end("client lost", "end of stream without goodbye")
            length, op, _flags, req = gp.HEADER.unpack(header)
            body = recv_exact(sock, length) if length else b""
            if body is None:
                return end("client lost", "end of stream inside a frame")
            if op == gp.Goodbye.OP:
                say("goodbye")
                return end("client exit")
            if op == gp.Ping.OP:
                (token,) = struct.unpack("<Q", body)
                sock.sendall(gp.encode_frame(gp.PingReply(result=0, token=token), req))
            if op == gp.MemAlloc.OP:  # memory it "holds", reported as the real worker does
                size = gp.MemAlloc.decode(body).size
                sock.sendall(gp.encode_frame(gp.MemAllocReply(result=0, dptr=0x300000000000
                                                              + held[0]), req))
                held[0] += size
                event(ctl, gp.WorkerStats(session_id=session_id, counters=gp.WorkerCounters(
                    calls_alloc=1, mem_used=held[0], duration_s=time.monotonic() - started)))


if __name__ == "__main__":
    sys.exit(main())
