"""This server's name among the servers sharing a store: `HOST-XXXXXXXX`, the host name and
eight hex digits of the state directory's path, so that it stays the same across restarts and
two servers on one host (two state directories) differ. It names the server in the `servers`
table, in every lease record it writes, and in its local admin token (`local-admin@NAME`)."""

from __future__ import annotations

import hashlib
import re
import socket
from pathlib import Path

from gpupoold.config.settings import format_address, parse_address


def server_name(state_dir: Path) -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:32] or "host"
    tag = hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:8]
    return f"{host}-{tag}"


def advertised_address(advertise: str | None, bound: str) -> str:
    """Where clients and other servers reach this server's remoting port: the `advertise`
    setting, else the address it listens on, with the host name for a wildcard address."""
    if advertise:
        return advertise
    host, port = parse_address(bound)
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return format_address(host, port)
