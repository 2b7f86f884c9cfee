"""Every gpupoold setting, defined once.

A setting is a field of `Settings`: its name is the key in the TOML config file, its type and
default are the field's, and its metadata carries the help text and, for some, a command-line
flag. The config parser (`config.py`), the CLI (`cli.py`) and `docs/configuration.md` (checked by
`tests/test_docs.py`; `python -m gpupoold.config.settings` prints the table) all read this one list.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path("/etc/gpupoold/gpupoold.toml")
LOG_LEVELS = ("debug", "info", "warning", "error")
AUTH_MODES = ("token", "none")
DETACH_POLICIES = ("when-queued", "always")
RESET_POLICIES = ("never", "on-error", "always")
TLS_MODES = ("on", "off")


def parse_address(text: str) -> tuple[str, int]:
    """'HOST:PORT' or '[IPV6]:PORT' -> (host, port). Raises ValueError with the reason."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, as [::1]:7070")
    if not re.fullmatch(r"[0-9]+", port_text) or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: port must be a number from 0 to 65535")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_address(value: str) -> None:
    parse_address(value)


def _check_positive(value: float) -> None:
    if value <= 0:
        raise ValueError(f"must be greater than 0, got {value}")


def _check_not_negative(value: float) -> None:
    if value < 0:
        raise ValueError(f"must be 0 or more, got {value}")


def _check_gpus(value: list[int]) -> None:
    if any(v < 0 for v in value) or len(set(value)) != len(value):
        raise ValueError(f"must be distinct GPU indices >= 0, got {value}")


def _check_share(value: int) -> None:
    if not 1 <= value <= 64:
        raise ValueError(f"must be from 1 (whole GPUs) to 64 (leases on one GPU), got {value}")


def _check_share_mps(value: str) -> None:
    # gpupoold never starts MPS: the operator's control daemon must be there, with its pipes.
    if not value:
        return
    if not Path(value).is_absolute():
        raise ValueError(f"must be an absolute path (the CUDA_MPS_PIPE_DIRECTORY the operator "
                         f"started nvidia-cuda-mps-control -d with), got {value!r}")
    if not Path(value).is_dir():
        raise ValueError(f"{value} is not a directory: start the MPS control daemon first, as "
                         f"the gpupoold user, with CUDA_MPS_PIPE_DIRECTORY={value} "
                         "nvidia-cuda-mps-control -d (docs/operator-guide.md, \"MPS\"), "
                         "or set share_mps = \"\" (off)")


def settings_conflict(values: dict[str, Any]) -> str | None:
    """What is wrong with settings that are each valid alone but not together (None: nothing),
    in words that say what to write instead."""
    if values.get("share_gpus") and values.get("share", 1) < 2:
        return ("setting 'share_gpus' lists GPUs to share, but 'share' is 1 (whole GPUs): "
                "set share = 2 or more (the leases one GPU may hold), or remove share_gpus")
    if values.get("share_mps") and values.get("share", 1) < 2:
        return ("setting 'share_mps' runs the shares of shared GPUs under MPS, but 'share' is 1 "
                "(whole GPUs): set share = 2 or more, or remove share_mps")
    if values.get("database") and values.get("share", 1) > 1:
        return ("setting 'share' shares GPUs, but 'database' is a shared PostgreSQL store (a "
                "fleet), whose queue grants whole GPUs only: shares are not served in a fleet. "
                "Set share = 1 on the fleet's servers, or give this server a store of its own "
                "(remove database) to share its GPUs")
    return None


def _check_choice(choices: tuple[str, ...]) -> Callable[[str], None]:
    def check(value: str) -> None:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {value!r}")
    return check


def _check_sim_name(value: str) -> None:
    if "simulated" not in value.lower():
        raise ValueError(f"must contain the word 'simulated' (got {value!r}): users must see it")


def _check_sim_memory(value: int) -> None:
    if not 1 <= value <= 16384:
        raise ValueError(f"must be from 1 to 16384 (GiB), got {value}")


def _check_jit_cache(value: int) -> None:
    if not 0 <= value <= 4096:  # the driver's CUDA_CACHE_MAXSIZE stops at 4 GiB
        raise ValueError(f"must be from 0 (off) to 4096 (MiB), got {value}")


def _check_database(value: str) -> None:
    if not value.startswith(("postgresql://", "postgres://")):
        raise ValueError(f"must be a postgresql:// URL (unset: SQLite in state_dir), got {value!r}")
    from gpupoold.store.postgres import check_url

    check_url(value)


def _check_host_names(value: list[str]) -> None:
    for name in value:
        if name != "*" and not re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?", name):
            raise ValueError(f"{name!r} is not a host name (write names only: no scheme, port, "
                             "path or address; IP addresses are always allowed)")


def _check_networks(value: list[str]) -> None:
    for net in value:
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError:
            raise ValueError(f"{net!r} is not an IP address or network (ADDRESS or "
                             "ADDRESS/PREFIX)") from None


def _check_log_level(value: str) -> None:
    if value not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, got {value!r}")


def _setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    check: Callable[[Any], None] | None = None,
) -> Any:
    meta = {"help": help, "flag": flag, "metavar": metavar, "check": check}
    if isinstance(default, list):
        return field(default_factory=functools.partial(list, default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Settings:
    """gpupoold's configuration. Fields without a default value (None) are found automatically."""

    listen: str = _setting(
        "0.0.0.0:7070",
        "Remoting listener (`HOST:PORT`, `[IPv6]:PORT`): where clients' `GPUPOOL_SERVER` points. "
        "Port 0 picks a free port.",
        flag="--listen", metavar="HOST:PORT", check=_check_address)
    http: str = _setting(
        "127.0.0.1:7071",
        "HTTP listener for the API, the dashboard and `/healthz`. Loopback by default; to reach it "
        "from other machines listen on `0.0.0.0:7071` (the API needs a token, see `auth`): off "
        "loopback it speaks HTTPS with the server's own identity (`http_tls`, `http_tls_cert`). "
        "Port 0 picks a free port.",
        flag="--http", metavar="HOST:PORT", check=_check_address)
    auth: str = _setting(
        "token",
        "`token`: every client and every API call needs an API token (`gpupoold token create`). "
        "`none`: no authentication at all, for a single-user test box only (logged loudly at "
        "start).",
        flag="--auth", metavar="MODE", check=_check_choice(AUTH_MODES))
    http_anonymous_read: bool = _setting(
        False,
        "Let the HTTP API's read-only views (GPUs, leases, queue, status) answer without a token. "
        "Tokens and the audit log always need an admin token; `/healthz` never needs one.")
    metrics_anonymous: bool = _setting(
        False,
        "Let `GET /metrics` (Prometheus, docs/metrics.md) answer without a token. Off: Prometheus "
        "scrapes with a token (`authorization: {credentials_file: ...}`). The metrics name token "
        "names and GPU models but no client hosts, users or lease ids.")
    tls: str = _setting(
        "on",
        "`on`: the remoting port speaks TLS, with `tls_cert` if set, else with this server's own "
        "identity (a key and a self-signed certificate made at the first start in "
        "`<state_dir>/identity/`; `gpupoold fingerprint` prints what clients pin). `off`: plain "
        "TCP, every token and all data in clear (warned at every start; clients must say "
        "`tls = false` too).",
        flag="--tls", metavar="on|off", check=_check_choice(TLS_MODES))
    tls_cert: Path | None = _setting(
        None,
        "PEM certificate chain for TLS on the remoting listener (with `tls_key`), instead of the "
        "server's own identity: clients pin its key (`gpupool login`) or trust its CA "
        "(`tls_ca`). The data path's TLS runs in the worker (OpenSSL).",
        metavar="PATH")
    tls_key: Path | None = _setting(None, "PEM private key of `tls_cert`.", metavar="PATH")
    tls_client_ca: Path | None = _setting(
        None,
        "PEM CA bundle: when set, remoting clients must present a certificate signed by it "
        "(`GPUPOOL_TLS_CERT`, `GPUPOOL_TLS_KEY`), in addition to their token.",
        metavar="PATH")
    http_tls_cert: Path | None = _setting(
        None,
        "PEM certificate chain for HTTPS on the `http` listener (with `http_tls_key`), on any "
        "address. Unset: HTTPS with the server's own identity off loopback (`http_tls`), plain "
        "HTTP on loopback.",
        metavar="PATH")
    http_tls_key: Path | None = _setting(
        None, "PEM private key of `http_tls_cert`.", metavar="PATH")
    http_tls_client_ca: Path | None = _setting(
        None,
        "PEM CA bundle: when set, HTTPS clients must present a certificate signed by it "
        "(mutual TLS), in addition to their token.",
        metavar="PATH")
    state_dir: Path = _setting(
        Path("/var/lib/gpupoold"),
        "Directory for the daemon's state: the database (`gpupoold.db`: tokens, lease history, "
        "audit log), the local admin token, simulated GPUs (`sim/`) and the module cache "
        "(unless `cache_dir` is set). Created if missing.",
        flag="--state-dir", metavar="DIR")
    cache_dir: Path | None = _setting(
        None,
        "Module image cache (`<cache_dir>/modules/<token namespace>/<sha256>`): a token finds "
        "only the images it uploaded; at most 4 GiB a token and 16 GiB in all, least recently "
        "used evicted (docs/architecture.md, \"Module images\"). Default: `<state_dir>/cache`.",
        metavar="DIR")
    jit_cache_mib: int = _setting(
        1024,
        "Size of the CUDA driver's PTX JIT cache that the workers share (`<cache_dir>/jit`, "
        "`CUDA_CACHE_PATH` and `CUDA_CACHE_MAXSIZE` in their environment), in MiB (0 to 4096): "
        "a PTX module compiled once on this server is not compiled again, whichever lease "
        "loads it (docs/architecture.md, \"Module images\"; docs/security.md, \"The worker\"). "
        "0: the JIT cache is off. A `CUDA_CACHE_PATH` in gpupoold's environment wins.",
        check=_check_jit_cache)
    database: str | None = _setting(
        None,
        "Where tokens, lease history, the audit log and drained or quarantined GPUs are kept. "
        "Unset: SQLite in `<state_dir>/gpupoold.db` (one server). `postgresql://USER@HOST:PORT/"
        "DATABASE`: PostgreSQL, which several servers can share (docs/operator-guide.md, "
        "\"PostgreSQL\"); needs the `postgresql` extra (`pip install 'gpupoold[postgresql]'`). "
        "Never put the password in the URL (it is refused): give it in the environment "
        "(`PGPASSWORD`, or a `PGPASSFILE` file) or with `database_password_file`. A database on "
        "another host (not loopback, not a Unix socket) needs `?sslmode=verify-full` (with "
        "`sslrootcert=...`) in the URL, or `database_insecure`. Other libpq parameters go in the "
        "URL's query too. A primary with standbys: name every host, "
        "`postgresql://USER@HOST1:PORT1,HOST2:PORT2/DATABASE?target_session_attrs=read-write`; "
        "libpq connects to the one that takes writes, and after a failover gpupoold reconnects "
        "to the new primary by itself (docs/operator-guide.md, \"Large fleets\").",
        flag="--database", metavar="URL", check=_check_database)
    database_password_file: Path | None = _setting(
        None,
        "A file whose first line is the PostgreSQL password (mode 0600, readable by the "
        "daemon's user; or a systemd credential). Unset: libpq's own (`PGPASSWORD`, "
        "`PGPASSFILE`, `~/.pgpass`).",
        metavar="PATH")
    database_insecure: bool = _setting(
        False,
        "Let `database` reach a PostgreSQL on another host without `sslmode=verify-full` in its "
        "URL (warned at every start): tokens and lease records then cross that link unverified. "
        "Off: such a URL is refused at start.")
    advertise: str | None = _setting(
        None,
        "Where clients and the other servers of a fleet reach this server's remoting port "
        "(`HOST:PORT`): a fleet redirects clients here with it. Unset: the `listen` address, "
        "with this machine's host name when `listen` is on every address (`0.0.0.0`, `[::]`).",
        flag="--advertise", metavar="HOST:PORT", check=_check_address)
    http_advertise: str | None = _setting(
        None,
        "Where the other servers of a fleet reach this server's HTTP listener (`HOST:PORT`): they "
        "forward admin actions there. Unset: the `http` address; on every address (`0.0.0.0`, "
        "`[::]`) this machine's host name when it names one of its addresses, else its primary "
        "address. A fleet server on a wildcard address that can derive neither refuses to start.",
        flag="--http-advertise", metavar="HOST:PORT", check=_check_address)
    http_tls: str = _setting(
        "on",
        "`on`: an `http` listener on a non-loopback address speaks HTTPS, with `http_tls_cert` if "
        "set, else with this server's own identity (the remoting port's self-signed certificate; "
        "`gpupoold fingerprint --pem` exports it for Prometheus). A loopback listener stays plain "
        "HTTP unless `http_tls_cert` is set. `off`: plain HTTP on any address (tokens in clear "
        "off loopback; warned at every start).",
        check=_check_choice(TLS_MODES))
    http_allowed_hosts: list[str] = _setting(
        [],
        "Host names, besides its own, under which the HTTP listener is reached: a DNS alias, a "
        "reverse proxy's public name. Its own: any IP address, `localhost`, this machine's host "
        "name and fully qualified name, the hosts of `http` and `http_advertise`. A request for "
        "another host is refused (`421`: DNS rebinding). A POST, PUT or DELETE from a page of another "
        "origin is refused (`403`: CSRF); a page under a name listed here counts as this "
        "server's own. `[\"*\"]` answers to any host name (not advised; origins are still "
        "checked). docs/security.md, \"The dashboard in a browser\".",
        check=_check_host_names)
    trusted_proxies: list[str] = _setting(
        [],
        "Addresses or networks (`10.0.0.5`, `10.0.0.0/24`, `::1`) of reverse proxies in front of "
        "the HTTP listener whose `X-Forwarded-Proto: https` is believed: their requests count as "
        "HTTPS (the dashboard's cookie is `Secure`). Others' `X-Forwarded-Proto` is ignored.",
        check=_check_networks)
    simulated: int = _setting(
        0,
        "Number of simulated GPUs to serve. 0 serves the real GPUs listed in `gpus`; when it "
        "finds none (no NVIDIA driver, no GPU, an NVML error) gpupoold does not start (exit 78, "
        "saying what it found), unless `fallback_to_simulated` is set.",
        flag="--simulated", metavar="N", check=_check_not_negative)
    fallback_to_simulated: bool = _setting(
        False,
        "With `simulated = 0`: when no real GPU can be served (no NVIDIA driver, no GPU, an NVML "
        "error), serve 1 simulated GPU instead of refusing to start (logged loudly; `/healthz` "
        "and the dashboard say \"simulated\"). For trying gpupoold on a machine without a GPU; "
        "never on a GPU server, where a broken driver must stop the daemon rather than lend a "
        "GPU on which no kernel runs.")
    gpus: list[int] = _setting(
        [],
        "Indices (as `nvidia-smi` numbers them) of the real GPUs to serve; empty serves them all. "
        "Real mode only.",
        check=_check_gpus)
    driver: str = _setting(
        "libcuda.so.1",
        "The NVIDIA driver library that workers load for real GPUs (a name for the dynamic "
        "loader or a path).",
        metavar="PATH")
    worker: Path | None = _setting(
        None,
        "The `gpupool-worker` binary. Default: the one shipped in the package "
        "(`gpupoold/bin/`), else the repository's `build/` (development).",
        flag="--worker", metavar="PATH")
    sim_lib: Path | None = _setting(
        None,
        "The simulated device library `libgpupool-sim.so`, found like `worker`.",
        flag="--sim-lib", metavar="PATH")
    sim_name: str = _setting(
        "NVIDIA H100 80GB HBM3 (gpupool simulated)",
        "Device name of the simulated GPUs; it must contain the word 'simulated'.",
        check=_check_sim_name)
    sim_memory_gib: int = _setting(
        80, "Total memory of each simulated GPU, in GiB (1 to 16384).", check=_check_sim_memory)
    queue_timeout: float = _setting(
        600.0,
        "Seconds a client may wait in the queue for a free GPU before it is refused "
        "(it is told its position when it joins and every `queue_notice_interval` seconds).",
        check=_check_positive)
    queue_notice_interval: float = _setting(
        5.0, "Seconds between the position notices sent to a waiting client.",
        check=_check_positive)
    max_queue: int = _setting(
        256,
        "Most clients that may wait in the queue; more are refused at once (0: no queue). With "
        "a shared store the queue is the fleet's: the clients waiting on all its servers count.",
        check=_check_not_negative)
    max_queue_per_token: int = _setting(
        16,
        "Most clients of one token that may wait in the queue; more are refused at once (a "
        "busy error that says why), so one tenant cannot fill the queue everyone shares. "
        "0: no limit of its own (`max_queue` only). With a shared store, on all the fleet's "
        "servers together.",
        check=_check_not_negative)
    max_lease_seconds: float = _setting(
        0.0,
        "Longest a lease may last: the client is told why and disconnected after this many "
        "seconds. 0: no limit.",
        check=_check_not_negative)
    max_gpus_per_token: int = _setting(
        0,
        "Most GPUs one token may hold at once, its idly detached leases included (and, with a "
        "shared store, on all the fleet's servers together); its further clients wait in the "
        "queue. 0: no limit.",
        check=_check_not_negative)
    share: int = _setting(
        1,
        "Leases one GPU may hold at once (issue 32): 1 lends whole GPUs; N > 1 makes the GPUs "
        "of `share_gpus` shared, each taking up to N clients that ask for an amount of memory "
        "(`GPUPOOL_MEMORY`), each in its own worker with that much memory as its exact quota, "
        "as long as their amounts fit in the GPU's memory. A client that asks for no amount "
        "still takes a whole GPU (a shared one once its shares have ended). One worker per "
        "free shared GPU is pre-started (`prestart_workers`), the others start when a share "
        "lands. From 1 to 64 (docs/configuration.md, \"Shared GPUs\"). Not with a shared "
        "PostgreSQL store (`database`): a fleet's queue grants whole GPUs only.",
        check=_check_share)
    share_gpus: list[int] = _setting(
        [],
        "Which GPUs (indices as in `gpus`, or of the simulated GPUs) are shared when "
        "`share` > 1; empty: all of them. Needs `share` of 2 or more.",
        check=_check_gpus)
    share_mps: str = _setting(
        "",
        "The pipe directory (`CUDA_MPS_PIPE_DIRECTORY`) of an MPS control daemon the operator "
        "runs as the gpupoold user: the workers of shared GPUs' shares connect to it, so their "
        "kernels run at the same time in one GPU context instead of time-slicing, and a fatal "
        "fault of one share ends every share of that GPU (docs/operator-guide.md, \"MPS\"). "
        "gpupoold never starts or stops MPS. Empty: off. Needs `share` of 2 or more.",
        check=_check_share_mps)
    prestart_workers: bool = _setting(
        True,
        "Keep one worker per free GPU started and initialised (driver loaded, context created) "
        "so that a new client's first reply does not wait for it.")
    telemetry_interval: float = _setting(
        1.0,
        "Seconds between two readings of every GPU's live values (memory used, utilisation, "
        "temperature, power, clocks) shown by the API, `gpupool smi` and the NVML shim: from "
        "NVML for real GPUs, from the lease's worker for simulated ones.",
        check=_check_positive)
    usage_retention_days: float = _setting(
        90.0,
        "Days the per-GPU, per-minute usage rows (leased and busy seconds, per token) are kept "
        "for `gpupoold report`; older rows are deleted. Each lease's own totals are kept with "
        "its record.",
        check=_check_positive)
    scrub_timeout: float = _setting(
        600.0,
        "Seconds the memory scrub after a lease may take before the GPU is quarantined.",
        check=_check_positive)
    reset_policy: str = _setting(
        "never",
        "When to fully reset a GPU (`nvidia-smi -r`) through the privileged reset helper: "
        "`never`, `on-error` (a failed scrub or health check; the GPU is quarantined if the reset "
        "does not help) or `always` (after every lease). Only when no process holds the GPU.",
        check=_check_choice(RESET_POLICIES))
    reset_socket: Path = _setting(
        Path("/run/gpupoold/reset.sock"),
        "Unix socket of the privileged reset helper (`gpupool-reset-helper`, its own systemd "
        "unit). Used only when `reset_policy` is not `never`.",
        metavar="PATH")
    handshake_timeout: float = _setting(
        10.0,
        "Seconds a new connection has to send its `hello` frame before it is closed.",
        check=_check_positive)
    max_handshakes: int = _setting(
        256,
        "Most remoting connections in their handshake at once (TLS handshake, hello, token "
        "check; not the queued clients). When full, a connection from an address with fewer "
        "handshakes in progress than the busiest one replaces that address's oldest; any other "
        "is closed at once. Counted in `gpupool_admission_refusals`.",
        check=_check_positive)
    max_handshakes_per_address: int = _setting(
        32,
        "Most remoting connections from one peer address in their handshake at once; more are "
        "closed at once.",
        check=_check_positive)
    login_failures_per_address: int = _setting(
        20,
        "Refused tokens from one peer address within `login_failure_window` seconds after which "
        "that address's hellos are refused for `login_block_seconds` (\"too many failed logins "
        "from ADDR; retry in N s\"), without a token check. 0: no limit.",
        check=_check_not_negative)
    login_failure_window: float = _setting(
        10.0, "Seconds over which `login_failures_per_address` counts.", check=_check_positive)
    login_block_seconds: float = _setting(
        60.0, "Seconds an address stays refused after too many failed logins.",
        check=_check_positive)
    http_max_connections: int = _setting(
        256,
        "Most connections the HTTP listener holds at once; more get `503` with `Retry-After` "
        "and are closed. Requests also have bounded headers (8 KiB a line, 64 fields), bodies "
        "(1 MiB) and idle time (15 s between requests).",
        check=_check_positive)
    stop_grace: float = _setting(
        5.0,
        "Seconds workers get to exit after SIGTERM when gpupoold stops, before SIGKILL.",
        check=_check_positive)
    worker_orphan_grace: float = _setting(
        300.0,
        "Seconds a lease outlives gpupoold: when the daemon stops, restarts, is upgraded or "
        "crashes, each worker keeps serving its client and waits this long for a new gpupoold "
        "to adopt it (with its lease, unbroken); then it ends the lease and the next gpupoold "
        "scrubs the GPU. 0: every lease ends when gpupoold stops.",
        check=_check_not_negative)
    worker_sandbox: bool = _setting(
        True,
        "Confine each worker with Landlock (Linux 5.13+) before its driver loads: it may read "
        "its libraries, the driver's parts of /proc and /sys, use the GPU's device files and "
        "write only its own folders, and opens nothing of the state directory or /etc/gpupool "
        "(docs/security.md, \"The worker\"). false: only for a driver that needs more; say so "
        "in an issue.")
    idle_detach_after: float = _setting(
        60.0,
        "Seconds a lease's client may send nothing, its streams all complete, before the lease "
        "gives its GPU back (idle detach, per `detach_policy`): its device memory and objects "
        "wait in server host memory and its next call brings them back, on the same GPU or "
        "another of the same model, at the same addresses. 0: never detach.",
        check=_check_not_negative)
    detach_policy: str = _setting(
        "when-queued",
        "When an idle lease is detached: `when-queued` (only while a client waits for a GPU "
        "it could take) or `always` (as soon as it idles, so that the GPU is free for the next "
        "client at once).",
        check=_check_choice(DETACH_POLICIES))
    detach_memory_limit_gib: float = _setting(
        0.0,
        "GiB of device memory that detached leases may hold in the server's host memory, all "
        "together; a lease that would not fit keeps its GPU (and the API says so). 0: half of "
        "the server's physical memory.",
        check=_check_not_negative)
    log_level: str = _setting(
        "info", "Log level: debug, info, warning or error.",
        flag="--log-level", metavar="LEVEL", check=_check_log_level)

    @property
    def effective_cache_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else self.state_dir / "cache"


@dataclass(frozen=True)
class SettingInfo:
    """What the config parser, the CLI and the docs need to know about one setting."""

    name: str
    type: Any  # the resolved annotation: str, int, float, Path, list[int], Path | None
    default: Any
    help: str
    flag: str | None
    metavar: str | None
    check: Callable[[Any], None] | None

    @property
    def base_type(self) -> Any:
        """The type without `| None`."""
        if typing.get_origin(self.type) in (typing.Union, types.UnionType):
            return next(a for a in typing.get_args(self.type) if a is not type(None))
        return self.type

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.type)

    def default_text(self) -> str:
        """The default as written in the docs."""
        if self.default is None:
            return "(automatic)"
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        if isinstance(self.default, str | Path):
            return f'"{self.default}"'
        return str(self.default)


@functools.cache
def settings_info() -> tuple[SettingInfo, ...]:
    hints = typing.get_type_hints(Settings)
    out = []
    for f in dataclasses.fields(Settings):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append(SettingInfo(
            name=f.name, type=hints[f.name], default=default, help=f.metadata["help"],
            flag=f.metadata["flag"], metavar=f.metadata["metavar"], check=f.metadata["check"]))
    return tuple(out)


def setting(name: str) -> SettingInfo:
    for info in settings_info():
        if info.name == name:
            return info
    raise KeyError(name)


def markdown_table() -> str:
    """The settings table of docs/configuration.md (a test checks the doc contains it)."""
    lines = ["| setting | default | flag | meaning |", "|---|---|---|---|"]
    for info in settings_info():
        flag = f"`{info.flag} {info.metavar}`" if info.flag else ""
        lines.append(f"| `{info.name}` | `{info.default_text()}` | {flag} | {info.help} |")
    return "\n".join(lines) + "\n"


def iter_flags() -> Iterator[SettingInfo]:
    return (info for info in settings_info() if info.flag)


if __name__ == "__main__":
    print(markdown_table(), end="")
