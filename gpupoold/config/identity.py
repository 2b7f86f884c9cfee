"""This server's name among the servers sharing a store: `HOST-XXXXXXXX`, the host name and
eight hex digits of the state directory's path, so that it stays the same across restarts and
two servers on one host (two state directories) differ. It names the server in the `servers`
table, in every lease record it writes, and in its local admin token (`local-admin@NAME`)."""

from __future__ import annotations

import hashlib
import ipaddress
import re
import socket
from pathlib import Path

from gpupoold.config.settings import format_address, parse_address


def server_name(state_dir: Path, host: str | None = None) -> str:
    """`host`: the host name to use instead of this machine's (a test naming another host's
    server)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", host if host is not None else socket.gethostname()
                  )[:32] or "host"
    tag = hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:8]
    return f"{host}-{tag}"


WILDCARDS = ("", "0.0.0.0", "::")
# Addresses of documentation networks (RFC 5737, RFC 3849): a UDP socket "connected" there sends
# nothing, but the kernel picks the source address of the route a real packet would take.
_PROBES = ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1"))


def is_loopback(host: str) -> bool:
    """A loopback address or `localhost` (only this machine reaches it)."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _local(address: str) -> bool:
    """`address` is one of this machine's (network namespace's) own: a socket can bind to it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def reachable_host() -> str | None:
    """A name or address by which other machines reach this one, for a listener on every
    address: the host name when it resolves to one of this machine's own non-loopback
    addresses, else the primary address (the source of the default route), else None."""
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    for info in infos:
        address = str(info[4][0])
        if not is_loopback(address) and _local(address):
            return name
    for family, probe in _PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                address = str(s.getsockname()[0])
        except OSError:
            continue
        if not is_loopback(address):
            return address
    return None


def advertised_address(advertise: str | None, bound: str) -> str:
    """Where clients and other servers reach this server's remoting port: the `advertise`
    setting, else the address it listens on; for a wildcard address, this machine's name or
    primary address (reachable_host), the host name when neither can be found."""
    if advertise:
        return advertise
    host, port = parse_address(bound)
    if host in WILDCARDS:
        host = reachable_host() or socket.gethostname()
    return format_address(host, port)


def advertised_http(http_advertise: str | None, bound: str) -> str | None:
    """Where the other servers of a fleet reach this server's HTTP listener: `http_advertise`,
    else the bound address, a wildcard replaced by reachable_host(); None when nothing usable
    can be derived (the caller refuses to start on a shared store). A loopback address stays
    as it is: that listener is reachable from this machine only, and the other servers on it
    use it there."""
    if http_advertise:
        return http_advertise
    host, port = parse_address(bound)
    if host in WILDCARDS:
        found = reachable_host()
        if found is None:
            return None
        host = found
    return format_address(host, port)
