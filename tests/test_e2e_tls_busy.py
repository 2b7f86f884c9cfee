"""A server that closes the TLS handshake without a word is retried, and when it stays closed the
client says it may be busy (part K of issues 37/32, item 4). gpupoold closes a connection at
once past its limits on handshakes in progress (max_handshakes, max_handshakes_per_address:
gpupoold/remoting/admission.py); a burst of clients from one address meets them. The client
(client/shim/connect.c, busy_wait) tries again with a short jittered backoff within its connect
timeout. Real gpupoold (TLS, the default) with a per-address cap of 1, real worker, simulated
GPU, hold_gpu through the shim."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from conftest import GpupoolServer
from test_e2e_admission import admission
from test_e2e_leases import hold_gpu, start_client  # noqa: F401 (hold_gpu is a fixture)
from test_metrics import scrape_text

BURST = 6


def test_a_busy_server_is_retried_and_named(start_daemon: Callable[..., GpupoolServer],
                                            native_build: Path, hold_gpu: Path,  # noqa: F811
                                            tmp_path: Path) -> None:
    conf = tmp_path / "caps.toml"
    conf.write_text("max_handshakes_per_address = 1\n")
    server = start_daemon("--config", str(conf), build_dir=native_build)
    assert server.fingerprint is not None  # TLS

    # The one place of 127.0.0.1 held by a connection that never starts its handshake: every
    # client's TLS handshake is closed at once, until its connect timeout is up.
    held = socket.create_connection((server.host, server.port))
    try:
        t0 = time.monotonic()
        client = start_client(server, hold_gpu, 1 << 20, 0, 1,
                              env={"GPUPOOL_CONNECT_TIMEOUT": "1"})
        _, err = client.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        held.close()
    assert client.returncode != 0
    line = [x for x in err.splitlines() if x.startswith("gpupool: cannot use gpupool server")]
    assert len(line) == 1, err
    assert "the server closed the connection during the handshake" in line[0], err
    assert "It may be busy" in line[0] and "max_handshakes_per_address" in line[0], err
    assert "GPUPOOL_TLS_CERT" in line[0], err  # the other possibility, still named
    tries = int(line[0].split("handshake, ")[1].split(" time")[0])
    assert tries >= 2, line[0]  # retried, not given up at the first close
    assert took < 30, took  # within its connect timeout (generous: a loaded machine)
    refused = admission(scrape_text(server), "handshakes_per_address")
    assert refused >= tries, (refused, tries)

    # A burst from the same address: the cap closes most handshakes at first, the retries get
    # every client through (each holds the GPU for a moment, the rest wait in the queue).
    clients = [start_client(server, hold_gpu, 1 << 20, 0, 10 + i) for i in range(BURST)]
    for c in clients:
        out, err = c.communicate(timeout=120)
        assert c.returncode == 0, f"{out}\n{err}"
    more = admission(scrape_text(server), "handshakes_per_address") - refused
    print(f"busy: {tries} closes in {took:.1f} s for the blocked client; the burst of {BURST} "
          f"was closed {more:.0f} times and served")
