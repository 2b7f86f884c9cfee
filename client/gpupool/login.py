"""`gpupool login URL --token T` and `gpupool logout URL`: the [[servers]] entries of the config
file. Login asks the server for `info` with the token first and writes nothing unless the server
answered and accepted it."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gpupool_protocol as gp

from gpupool.config import (
    BLANKS,
    DEFAULT_CONNECT_TIMEOUT,
    PATH_KEYS,
    SYSTEM_FILE,
    ConfigError,
    ServerConfig,
    default_user_file,
    expand_home,
    read_file,
    split_address,
    write_file,
)
from gpupool.wire import WireError, fetch_info

USER_MODES = (0o600, 0o700)
# The system file is read by the shims of every user's programs, so every user must be able
# to read it (its tokens are the machine's, on purpose: `gpupool login --system` is root's
# choice); the user's own file is private.
SYSTEM_MODES = (0o644, 0o755)


def _err(msg: str) -> int:
    print(f"gpupool: error: {msg}", file=sys.stderr)
    return 1


def target_file(env: Mapping[str, str], system: bool) -> Path:
    """The file login/logout change: /etc/gpupool/config.toml with --system, else
    $GPUPOOL_CONFIG when it names a file, else the user's file."""
    if system:
        return SYSTEM_FILE
    explicit = (env.get("GPUPOOL_CONFIG") or "").strip(BLANKS)  # as the readers take it
    if explicit and explicit != "none":
        try:
            return Path(expand_home(explicit, env))
        except ConfigError:
            raise ConfigError(f"GPUPOOL_CONFIG={explicit}: ~ stands for the home folder, and "
                              "HOME is not set") from None
    user = default_user_file(env)
    if user is None:
        raise ConfigError("cannot find the home folder (HOME is not set): set HOME or "
                          "XDG_CONFIG_HOME, or GPUPOOL_CONFIG to the file to write")
    return user


def _existing(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data, _ = read_file(path)
    return data


def _entries(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The file's servers as [[servers]] tables (the short form converted)."""
    servers = data.get("servers", [])
    if not isinstance(servers, list):
        return []
    return [{"address": s} if isinstance(s, str) else dict(s) for s in servers]


def _same(entry: dict[str, Any], key: tuple[str, str]) -> bool:
    try:
        _, host, port, _ = split_address(str(entry.get("address", "")))
    except ValueError:
        return False
    return (host.lower(), port) == key


def _resolve(value: str, base: Path) -> str:
    if not value:
        return ""
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else base / p)


def cmd_login(url: str, token: str, tls_ca: str | None, system: bool,
              env: Mapping[str, str]) -> int:
    try:
        address, host, port, prefix = split_address(url)
    except ValueError as exc:
        print(f"gpupool: error: {exc}; write HOST:PORT or tls://HOST:PORT", file=sys.stderr)
        return 2
    token = token.strip()
    if not token:
        print("gpupool: error: --token is empty: pass the token the server's operator gave you "
              "(`gpupoold token create --name NAME` prints one)", file=sys.stderr)
        return 2
    if tls_ca:
        ca = Path(tls_ca).expanduser().resolve()
        if not ca.is_file():
            return _err(f"--tls-ca {tls_ca}: no such file; give the PEM file of the CA that "
                        "signed the server's certificate")
        tls_ca = str(ca)
    try:
        path = target_file(env, system)
        data = _existing(path)
    except ConfigError as exc:
        return _err(f"{exc}; fix or remove that file, then log in again")
    key = (host.lower(), port)
    entries = _entries(data)
    entry = next((e for e in entries if _same(e, key)), None)
    base = path.resolve().parent  # relative paths: from the real file's folder, as the readers

    # What the entry will say, to check it before writing anything.
    def setting(name: str) -> Any:
        if entry is not None and name in entry:
            return entry[name]
        return data.get(name)

    srv = ServerConfig(address=address, host=host, port=port, token=token, tls_prefix=prefix)
    srv.tls = prefix or bool(setting("tls"))
    for k in PATH_KEYS:
        setattr(srv, k, _resolve(str(setting(k) or ""), base))
    if tls_ca:
        srv.tls_ca = tls_ca
        srv.tls = True
    timeout = data.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
        timeout = DEFAULT_CONNECT_TIMEOUT
    try:
        info = fetch_info(srv, float(timeout))
    except WireError as exc:
        return _err(f"cannot log in to {url}: {exc}; nothing was written")
    if info.result == gp.GP_EAUTH:
        return _err(f"{url} refused the token: {info.message}; nothing was written. Check "
                    "the token with the server's operator (`gpupoold token list`)")
    if info.result == gp.GP_EVERSION:
        return _err(f"{url} speaks protocol {info.major}.{info.minor}, this client "
                    f"{gp.MAJOR}.{gp.MINOR}: {info.message}; nothing was written. Use a "
                    "gpupool client of the server's version, or upgrade gpupoold")
    if info.result != 0:
        return _err(f"{url} refused: {info.message or info.result_name()}; nothing was written")

    new = {"address": url.strip(), "token": token}
    if tls_ca:
        new["tls_ca"] = tls_ca
        if not prefix:
            new["tls"] = True  # a CA for the server's certificate means TLS to it
    if entry is None:
        entries.append(new)
    else:
        entry.update(new)
    data["servers"] = entries
    modes = SYSTEM_MODES if system else USER_MODES
    try:
        write_file(path, data, *modes)
    except PermissionError:
        hint = " (run it as root: sudo gpupool login ... --system)" if system else ""
        return _err(f"cannot write {path}: permission denied{hint}")
    except OSError as exc:
        return _err(f"cannot write {path}: {exc.strerror or exc}")
    you = info.data.get("you") if isinstance(info.data.get("you"), Mapping) else {}
    print(f"gpupool: logged in to {url}: {info.server or 'gpupoold'}, {info.gpus} GPU"
          f"{'' if info.gpus == 1 else 's'} ({info.free_matching} free); token "
          f"{you.get('name') or '?'} ({you.get('role') or '?'}). Wrote {path}")
    if not system and (env.get("GPUPOOL_CONFIG") or "") == "none":
        print("gpupool: note: GPUPOOL_CONFIG=none is set, so programs read no config file "
              "until you unset it", file=sys.stderr)
    if (env.get("GPUPOOL_SERVER") or "").strip():
        print("gpupool: note: GPUPOOL_SERVER is set and replaces the file's server list; unset "
              "it to use the servers of the file", file=sys.stderr)
    if (env.get("GPUPOOL_TOKEN") or "").strip():
        print("gpupool: note: GPUPOOL_TOKEN is set and overrides the token of every server; "
              "unset it to use the file's tokens", file=sys.stderr)
    return 0


def cmd_logout(url: str, system: bool, env: Mapping[str, str]) -> int:
    try:
        _, host, port, _ = split_address(url)
    except ValueError as exc:
        print(f"gpupool: error: {exc}; write HOST:PORT as you logged in", file=sys.stderr)
        return 2
    try:
        path = target_file(env, system)
        if not path.exists():
            return _err(f"{path} does not exist: not logged in to {url}")
        data = _existing(path)
    except ConfigError as exc:
        return _err(f"{exc}; fix or remove that file")
    key = (host.lower(), port)
    entries = _entries(data)
    kept = [e for e in entries if not _same(e, key)]
    if len(kept) == len(entries):
        listed = ", ".join(str(e.get("address")) for e in entries) or "none"
        return _err(f"{url} is not a server of {path} (its servers: {listed})")
    short = isinstance(data.get("servers"), list) and all(
        isinstance(s, str) for s in data["servers"])
    data["servers"] = [e["address"] for e in kept] if short else kept
    if not data["servers"]:
        del data["servers"]
    modes = SYSTEM_MODES if system else USER_MODES
    try:
        write_file(path, data, *modes)
    except OSError as exc:
        return _err(f"cannot write {path}: {exc.strerror or exc}")
    print(f"gpupool: logged out of {url}: removed it and its token from {path}")
    return 0
