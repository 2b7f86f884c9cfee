"""End to end: a token's limits hold against its own clients (issue 29, items 1 and 2).

With `max_gpus_per_token = 1` and idle detach (policy when-queued), five processes of one token
never hold more than one GPU, attached or detached, at any moment (the lease history), while
another token's client is served through the idle holder's detach. One token's 200 queued
hellos fill only its own share of the queue (`max_queue_per_token`), and another token's client,
queued after them, is served as soon as the holder ends (the queue's turn is by token). Real
gpupoold, workers, gpupool-checkpoint and clients on a simulated GPU.
"""

from __future__ import annotations

import os
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
from conftest import GpupoolServer, wait_until
from gpupool.wire.frames import read_frame
from test_e2e_detach import finish
from test_e2e_leases import MIB, gpu_states, hold_gpu, start_client  # noqa: F401 (fixture)


def limited_server(start_daemon: Any, native_build: Path, tmp_path: Path, tls: bool = True,
                   **settings: Any) -> GpupoolServer:
    conf = tmp_path / "gpupoold.toml"
    conf.write_text("".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in settings.items()))
    server = start_daemon("--config", str(conf), build_dir=native_build, tls=tls)
    wait_until("the GPU free", lambda: gpu_states(server) == ["free"])
    return server


def ended_history(server: GpupoolServer, token: str, n: int) -> list[dict[str, Any]] | None:
    """`token`'s lease records once there are `n` and all have ended, else None."""
    history = server.get_json(f"/api/v1/leases?state=all&token={token}&limit=100")["leases"]
    return history if len(history) == n and all(le["ended"] is not None for le in history) else None


def holding(proc: subprocess.Popen[str]) -> None:
    """Wait until hold_gpu says it has its GPU."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "holding" in line, f"{line}{proc.stderr.read() if proc.stderr else ''}"


def test_five_clients_of_one_token_never_hold_two_gpus_through_idle_detach(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    server = limited_server(start_daemon, native_build, tmp_path, max_gpus_per_token=1,
                            idle_detach_after=0.5, detach_policy="when-queued")
    tenant = {"GPUPOOL_TOKEN": server.create_token("tenant")}
    other = {"GPUPOOL_TOKEN": server.create_token("other")}
    # The first idles with its GPU for 6 s; the four after it queue behind its token's limit.
    procs = [start_client(server, hold_gpu, 16 * MIB, 6000, seed=1, env=tenant)]
    clients.append(procs[0])
    holding(procs[0])
    for n in range(2, 6):
        procs.append(start_client(server, hold_gpu, 16 * MIB, 300, seed=n, env=tenant))
        clients.append(procs[-1])
        wait_until(f"tenant client {n} queued",
                   lambda n=n: len(server.get_json("/api/v1/queue")["queue"]) == n - 1)
    # Idle for longer than idle_detach_after with its own token's clients waiting: the holder
    # keeps its GPU (before issue 29 it gave it to the next of its token, and so on).
    wait_until("the holder idle", lambda: not server.get_json("/api/v1/queue")["queue"][0]
               ["waiting_s"] < 1.5)
    # Another token's client may take the GPU: the idle holder detaches for it.
    visitor = start_client(server, hold_gpu, 16 * MIB, 200, seed=9, env=other)
    clients.append(visitor)
    facts = [finish(p, f"tenant client {i + 1}", timeout=120) for i, p in enumerate(procs)]
    v = finish(visitor, "the other token's client")
    for f in [*facts, v]:
        assert f["exact"] == "1" and f["nonzero_before"] == "0", f
    # A client's exit comes before gpupoold records its lease's end: wait for the records.
    history = wait_until("the five leases ended", lambda: ended_history(server, "tenant", 5))
    spans = sorted((le["started"], le["ended"], le["detaches"]) for le in history)
    assert len(spans) == 5 and all(end is not None for _, end, _ in spans), history
    for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
        assert start >= end, f"the token held two GPUs at once: {spans}"
    assert spans[0][2] >= 1, f"the holder never detached for the other token: {spans}"
    # The visitor was served while the tenant's first client held (detached) its GPU, ahead of
    # the tenant's clients that its limit held back.
    (visit,) = server.get_json("/api/v1/leases?state=all&token=other")["leases"]
    assert spans[0][0] < visit["started"] < spans[1][0], (visit, spans)


def raw_hello(server: GpupoolServer, token: str, pid: int) -> tuple[socket.socket, Any]:
    """A plain-TCP hello from `token`; its first answer: a queue notice (None) or a reply."""
    s = socket.create_connection((server.host, server.port), timeout=20)
    hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=pid, host="flood",
                     user="mallory", program="queued_hello", token=token,
                     va_base=0x200000000000, va_size=1 << 40)
    s.sendall(gp.encode_frame(hello, 1))
    frame = read_frame(s)
    if frame.op == gp.Notice.OP and not frame.flags & gp.FLAG_REPLY:
        return s, None
    return s, gp.HelloReply.decode(frame.body)


def test_one_tokens_200_queued_hellos_make_another_token_wait_no_longer_than_the_holder(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    """The flooder's client holds the one GPU and the flooder opens 200 hellos: 16 queue
    (max_queue_per_token's default) and 184 are refused; another token's client, which comes
    after all of them, is next in the queue's turn (pool/waitqueue.py) and is served as soon as
    the holder ends, while the flooder's 16 still wait."""
    server = limited_server(start_daemon, native_build, tmp_path, tls=False, queue_timeout=60.0)
    flooder = server.create_token("flooder")
    other = {"GPUPOOL_TOKEN": server.create_token("other")}
    holder = start_client(server, hold_gpu, 16 * MIB, 1500, seed=1, env={"GPUPOOL_TOKEN": flooder})
    clients.append(holder)
    holding(holder)
    queued, refused = [], []
    try:
        for n in range(200):
            s, reply = raw_hello(server, flooder, os.getpid() * 1000 + n)
            if reply is None:
                queued.append(s)
            else:
                s.close()
                refused.append(reply)
        assert len(queued) == 16 and len(refused) == 184
        for reply in refused:
            assert reply.result == gp.GP_EBUSY, reply
            assert "this token already has 16 clients waiting" in reply.message, reply.message
            assert "max_queue_per_token = 16" in reply.message and "try again" in reply.message
        visitor = start_client(server, hold_gpu, 16 * MIB, 100, seed=2, env=other)
        clients.append(visitor)
        wait_until("the other token's client queued, first in turn", lambda: [
            w["token"] for w in server.get_json("/api/v1/queue")["queue"]] == ["other"]
            + ["flooder"] * 16)
        finish(holder, "the holder")
        finish(visitor, "the other token's client")
        # The lease history: the visitor's lease came right after the holder's.
        starts = sorted((le["started"], token) for token in ("flooder", "other") for le in
                        server.get_json(f"/api/v1/leases?state=all&token={token}")["leases"])
        assert [t for _, t in starts[:2]] == ["flooder", "other"], starts
        queue = server.get_json("/api/v1/queue")["queue"]
        assert len(queue) >= 15 and {w["token"] for w in queue} == {"flooder"}, queue
    finally:
        for s in queued:
            s.close()
    req = urllib.request.Request(server.http_url + "/metrics",
                                 headers={"Authorization": f"Bearer {server.admin_token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    line = ('gpupool_admission_refusals_total{interface="remoting",reason="queue_per_token"} '
            '184.0')
    assert line in text, [ln for ln in text.splitlines() if "admission" in ln]
