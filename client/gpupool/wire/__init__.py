"""The gpupool wire protocol in blocking Python, for the `gpupool` command: frame I/O over a
socket (plain TCP, or TLS with the `ssl` module) and the `info` request (protocol 1.1), on the
message classes of the gpupool-protocol distribution (gpupool_protocol, generated from
protocol/gpupool.toml)."""

from gpupool.wire.frames import Frame, read_frame, send_message
from gpupool.wire.info import (
    TRUST_KINDS,
    InfoResult,
    PeerIdentity,
    WireError,
    connect,
    fetch_info,
    peer_identity,
)

__all__ = ["TRUST_KINDS", "Frame", "InfoResult", "PeerIdentity", "WireError", "connect",
           "fetch_info", "peer_identity", "read_frame", "send_message"]
