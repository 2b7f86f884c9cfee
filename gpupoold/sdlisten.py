"""systemd socket activation for gpupoold's two listeners (sd_listen_fds(3), without libsystemd).

When systemd starts gpupoold through `gpupoold.socket` / `gpupoold-http.socket` (systemd/), it
passes the listening sockets as file descriptors 3, 4, ... and says so in the environment:
`LISTEN_PID` (the pid they are for: ours, or they are not for us), `LISTEN_FDS` (how many) and
`LISTEN_FDNAMES` (one name per descriptor, `:`-separated, each set by `FileDescriptorName=` in the
socket unit). gpupoold takes the socket named `remoting` for its remoting listener (instead of
binding setting `listen`) and the one named `http` for its HTTP listener (instead of setting
`http`); a listener without a passed socket binds its configured address as usual.

Anything else passed is an error at start-up (`SdListenError`, the message says what to change
in the socket unit): a name other than those two, the same name twice, a descriptor that is not
open, not a socket, not a listening TCP stream socket (`ListenDatagram=`, `Accept=yes`, a Unix
socket). The LISTEN_* variables are removed from the environment once read, so the workers
gpupoold starts never see them, and the descriptors are made close-on-exec for the same reason.

`parse` (the environment) and `check_socket` (one descriptor) are the unit-testable parts;
`take` does both for the running process.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Mapping, MutableMapping

from aiohttp import web

log = logging.getLogger("gpupoold")

SD_LISTEN_FDS_START = 3  # the first descriptor systemd passes
REMOTING = "remoting"
HTTP = "http"
NAMES = (REMOTING, HTTP)  # FileDescriptorName= values gpupoold knows
ENV_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
# `gpupoold serve` puts what `take` returned here; app.py hands the 'remoting' one to the
# RemotingListener. Absent (tests' apps): both listeners bind their settings.
SOCKETS = web.AppKey[dict[str, socket.socket]]("systemd_sockets")
_HINT = ("in the .socket unit, name each socket with FileDescriptorName=remoting (the remoting "
         "port) or FileDescriptorName=http (the HTTP API port), one unit per name "
         "(systemd/gpupoold.socket, systemd/gpupoold-http.socket)")


class SdListenError(Exception):
    """The sockets systemd passed cannot be used; the message says why and what to change."""


def parse(env: Mapping[str, str], pid: int) -> dict[str, int]:
    """FileDescriptorName -> descriptor, from LISTEN_PID/LISTEN_FDS/LISTEN_FDNAMES in `env`.

    Empty when nothing was passed to the process `pid` (no LISTEN_PID, or another process's:
    the variables were inherited, not meant for us). SdListenError when they are for us but
    unusable: LISTEN_FDS not a count, names missing or not one per descriptor, a name gpupoold
    does not know, a name given twice."""
    if env.get("LISTEN_PID", "") != str(pid):
        return {}
    count_text = env.get("LISTEN_FDS", "")
    try:
        count = int(count_text)
    except ValueError:
        count = -1
    if count < 0:
        raise SdListenError(f"systemd socket activation: LISTEN_FDS={count_text!r} is not a "
                            "number of file descriptors (whatever started gpupoold set it wrong)")
    if count == 0:
        return {}
    names_text = env.get("LISTEN_FDNAMES")
    if names_text is None:
        raise SdListenError(f"systemd socket activation: {count} socket(s) passed without names "
                            f"(LISTEN_FDNAMES is not set); {_HINT}")
    names = names_text.split(":")
    if len(names) != count:
        raise SdListenError(f"systemd socket activation: LISTEN_FDS={count} but LISTEN_FDNAMES "
                            f"has {len(names)} name(s) ({names_text!r}); whatever started "
                            "gpupoold must name each descriptor once")
    out: dict[str, int] = {}
    for offset, name in enumerate(names):
        fd = SD_LISTEN_FDS_START + offset
        if name not in NAMES:
            raise SdListenError(f"systemd socket activation: fd {fd} is named {name!r}, but "
                                f"gpupoold takes only 'remoting' and 'http'; {_HINT}")
        if name in out:
            raise SdListenError(f"systemd socket activation: more than one socket named {name!r} "
                                f"(fds {out[name]} and {fd}); gpupoold takes one per listener: "
                                f"give its .socket unit a single ListenStream= (a bare port such "
                                f"as ListenStream=7070 listens on IPv4 and IPv6 at once)")
        out[name] = fd
    return out


def check_socket(fd: int, name: str) -> socket.socket:
    """The passed descriptor `fd` as a socket object, if it is a listening TCP stream socket;
    SdListenError saying what it is otherwise (the descriptor is then left as it was)."""
    what = f"systemd socket activation: fd {fd} (FileDescriptorName={name})"
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        raise SdListenError(f"{what} is not an open file descriptor ({exc.strerror}); whatever "
                            "started gpupoold passed LISTEN_FDS without the descriptors") from None
    if not stat.S_ISSOCK(mode):
        raise SdListenError(f"{what} is not a socket; use ListenStream= in the .socket unit")
    sock = socket.socket(fileno=fd)
    try:
        kind = sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
        if kind != socket.SOCK_STREAM:
            kind_name = {socket.SOCK_DGRAM: "a datagram", socket.SOCK_SEQPACKET:
                         "a sequential-packet"}.get(kind, f"a type {kind}")
            raise SdListenError(f"{what} is {kind_name} socket, not a stream socket; use "
                                "ListenStream= (not ListenDatagram=/ListenSequentialPacket=)")
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            family = getattr(sock.family, "name", sock.family)
            raise SdListenError(f"{what} is not a TCP socket ({family}); gpupoold's "
                                "listeners are TCP: ListenStream=PORT or ADDRESS:PORT")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise SdListenError(f"{what} is not a listening socket (Accept=yes passes one "
                                "connection per process); set Accept=no in the .socket unit")
    except BaseException:
        sock.detach()
        raise
    return sock


def describe(name: str, sock: socket.socket) -> str:
    """How the logs and the status line say where a listener's socket came from."""
    return f"socket from systemd (fd {sock.fileno()}, FileDescriptorName={name})"


def take(env: MutableMapping[str, str] | None = None, pid: int | None = None,
         ) -> dict[str, socket.socket]:
    """The listening sockets systemd passed to this process, by name ('remoting', 'http'):
    empty without socket activation. Removes LISTEN_* from `env` (default os.environ) whatever
    they said, and makes the descriptors close-on-exec. SdListenError when they are unusable."""
    env = os.environ if env is None else env
    pid = os.getpid() if pid is None else pid
    passed_to = env.get("LISTEN_PID")
    try:
        fds = parse(env, pid)
    finally:
        for var in ENV_VARS:
            env.pop(var, None)
    if not fds and passed_to not in (None, str(pid)):
        log.info("LISTEN_PID=%s is another process: not using its sockets (the listeners bind "
                 "their configured addresses)", passed_to)
    sockets: dict[str, socket.socket] = {}
    try:
        for name, fd in fds.items():
            sockets[name] = check_socket(fd, name)
            os.set_inheritable(fd, False)
    except SdListenError:
        for sock in sockets.values():
            sock.detach()
        raise
    return sockets
