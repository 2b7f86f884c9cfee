"""`gpupool login HOST:PORT` and `gpupool logout HOST:PORT`: the [[servers]] entries of the config
file.

Login trusts like ssh's first connection (docs/user-guide.md, "Install and first run"):
1. connect with TLS without checking who answers, take the certificate, close: nothing but the
   handshake crosses (wire.peer_identity);
2. the fingerprint of its key is checked: against the pin the entry already has (a different key
   is refused loudly: nothing is sent, nothing written), against --fingerprint when given (for
   scripts: no terminal needed), else shown to the user, who answers yes or no on the terminal;
3. only then is the token sent, on a new connection that checks that pin like every later one
   (wire.fetch_info), and only when the server accepts it are the token and the pin written.
With a CA (--tls-ca or the entry's tls_ca) the CA vouches for the server: no question. Plain
TCP only with --plain, each time: the token then crosses in clear, and login says so; an entry's
tls = false is not enough (its server may have turned TLS on since, and the token would cross
in clear before the server could say so), and a TLS login writes tls = true over it.

A server of a fleet lists its members and their identities in its info reply (protocol 1.4);
that list arrived over the channel just verified, so login pins the members too, as [[servers]]
entries with the same token: `gpupool status` reaches them, and programs may pick them directly
(the shims also follow a fleet's redirects to them with that pin)."""

from __future__ import annotations

import getpass
import io
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import gpupool_protocol as gp

from gpupool.config import (
    BLANKS,
    DEFAULT_CONNECT_TIMEOUT,
    PATH_KEYS,
    SYSTEM_FILE,
    ConfigError,
    ServerConfig,
    check_fingerprint,
    check_pin,
    default_user_file,
    expand_home,
    read_file,
    server_desc,
    split_address,
    write_file,
)
from gpupool.wire import InfoResult, PeerIdentity, WireError, fetch_info, peer_identity

USER_MODES = (0o600, 0o700)
# The system file is read by the shims of every user's programs, so every user must be able
# to read it (its tokens are the machine's, on purpose: `gpupool login --system` is root's
# choice); the user's own file is private.
SYSTEM_MODES = (0o644, 0o755)


class LoginRefused(Exception):
    """Login stops here: the message (maybe several lines) says why and what to do; nothing was
    written. `code` is the exit status (1, or 2 for a usage error)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class LoginArgs:
    url: str
    token: str | None = None  # --token (visible in ps and the shell's history)
    token_file: str | None = None  # --token-file FILE, "-" for standard input
    fingerprint: str | None = None  # --fingerprint SHA256:...
    tls_ca: str | None = None
    plain: bool = False
    system: bool = False


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


def _key(address: str) -> tuple[str, str] | None:
    """(host in lower case, port) of an address as the reader matches them; None if not one."""
    try:
        _, host, port, _ = split_address(address)
    except ValueError:
        return None
    return (host.lower(), port)


def _same(entry: dict[str, Any], key: tuple[str, str]) -> bool:
    return _key(str(entry.get("address", ""))) == key


def _resolve(value: str, base: Path) -> str:
    if not value:
        return ""
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else base / p)


# ------------------------------------------------------------------------------ the terminal
class Terminal:
    """Where the identity question is asked: the controlling terminal (/dev/tty, so standard
    input may carry the token), else standard input when it is a terminal. `open` gives None
    without either (a script, a pipe, CI): then only --fingerprint or a CA can vouch."""

    def __init__(self, reader: TextIO, writer: TextIO, owned: bool) -> None:
        self.reader, self.writer, self.owned = reader, writer, owned

    @classmethod
    def open(cls) -> Terminal | None:
        try:
            fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
        except OSError:
            if sys.stdin is not None and sys.stdin.isatty():
                return cls(sys.stdin, sys.stderr, owned=False)
            return None
        tty = io.TextIOWrapper(io.FileIO(fd, "r+"), encoding="utf-8", errors="replace",
                               line_buffering=True)
        return cls(tty, tty, owned=True)

    def say(self, text: str) -> None:
        self.writer.write(text)
        self.writer.flush()

    def ask(self, prompt: str) -> str:
        """One line typed by the user, stripped ("" at end of input)."""
        self.say(prompt)
        return self.reader.readline().strip(BLANKS)

    def secret(self, prompt: str) -> str:
        """A line typed without echo (getpass: the terminal itself, else standard input)."""
        return getpass.getpass(prompt, stream=self.writer)

    def close(self) -> None:
        if self.owned:
            self.reader.close()


# ------------------------------------------------------------------------------ the token
def _read_token(args: LoginArgs) -> str | None:
    """The token from --token or --token-file (None: ask for it later). LoginRefused (2) when
    a source gives nothing usable."""
    if args.token is not None:
        token, where = args.token, "--token"
    elif args.token_file is not None:
        where = "standard input" if args.token_file == "-" else args.token_file
        try:
            if args.token_file == "-":
                token = sys.stdin.readline()
            else:
                with open(os.path.expanduser(args.token_file), encoding="utf-8") as f:
                    token = f.readline()
        except OSError as exc:
            raise LoginRefused(f"--token-file {args.token_file}: {exc.strerror or exc}; give "
                               "the file that holds the token (its first line)", 2) from None
        except UnicodeDecodeError:
            raise LoginRefused(f"--token-file {args.token_file}: not a text file; give the "
                               "file that holds the token (its first line)", 2) from None
    else:
        return None
    token = token.strip(BLANKS)
    if not token:
        raise LoginRefused(f"{where} gave an empty token: pass the token the server's operator "
                           "gave you (`gpupoold token create --name NAME` prints one)", 2)
    return token


def _ask_token(term: Terminal, desc: str) -> str:
    token = term.secret(f"Token for {desc} (gpt_..., not shown): ").strip(BLANKS)
    if not token:
        raise LoginRefused("no token typed: nothing was sent and nothing was written; run "
                           "`gpupool login` again with the token the server's operator gave you",
                           2)
    return token


# ------------------------------------------------------------------------------ the identity
def _changed(desc: str, seen: PeerIdentity, pinned: str, path: Path) -> LoginRefused:
    """The loud refusal of a key that is not the pinned one: the shims' own message (the same
    words a program prints), then what login can do about it."""
    loud = check_pin(seen.der, pinned, desc)
    return LoginRefused(
        f"{loud}\n"
        f"  The pin is in {path}; nothing was sent to the server and the file is unchanged.\n"
        "  Only once the server's operator confirms the new identity (`gpupoold fingerprint` on "
        "the server), pin it deliberately:\n"
        f"      gpupool login {desc} --fingerprint SHA256:...   (the new one, as the operator "
        "read it)\n"
        f"  or remove the old pin first: `gpupool logout {desc}`, then `gpupool login {desc}`.")


def _confirm(term: Terminal | None, desc: str, seen: PeerIdentity) -> None:
    """The user's yes, after seeing the fingerprint; LoginRefused otherwise."""
    if term is None:
        raise LoginRefused(
            f"the identity of gpupool server {desc} ({seen.fingerprint}) cannot be confirmed "
            "without a terminal: nothing was sent and nothing was written; check it against "
            "what `gpupoold fingerprint` prints on the server, then run `gpupool login "
            f"{desc} --fingerprint SHA256:...` with that value")
    term.say(f"The identity of gpupool server {desc} is\n"
             f"    {seen.fingerprint}\n"
             "Check it against what `gpupoold fingerprint` prints on the server: if they differ, "
             "another machine is answering, and your token would go to it.\n")
    prompt = "Pin it and continue (yes/no)? "
    while True:
        answer = term.ask(prompt)
        if answer.lower() == "yes" or answer == seen.fingerprint:
            return
        if answer.lower() in ("no", "") or answer.startswith("SHA256:"):
            why = ("that is not the fingerprint the server presents" if
                   answer.startswith("SHA256:") else "not confirmed")
            raise LoginRefused(f"{why}: {desc} is not pinned; nothing was sent and nothing "
                               "was written")
        prompt = "Please type 'yes', 'no' or the fingerprint: "


def _pin(args: LoginArgs, srv: ServerConfig, pinned: str, path: Path,
         term: Terminal | None, timeout: float) -> str:
    """The identity to pin for `srv`, checked (see the module's docstring), before anything
    secret is sent."""
    desc = server_desc(srv)
    try:
        seen = peer_identity(srv, timeout)
    except WireError as exc:
        raise LoginRefused(f"cannot log in to {args.url}: {exc}; nothing was written") from None
    given = args.fingerprint
    if given and check_pin(seen.der, given, desc):
        also = f" (and {path} pins {pinned})" if pinned and pinned != given else ""
        raise LoginRefused(
            f"the identity of gpupool server {desc} is {seen.fingerprint}, not the "
            f"--fingerprint {given} you gave{also}: nothing was sent and nothing was written. "
            "Check what `gpupoold fingerprint` prints on the server; a different key means "
            "another server, or someone in the middle of the connection")
    if pinned and check_pin(seen.der, pinned, desc):
        if not given:
            raise _changed(desc, seen, pinned, path)
        print(f"gpupool: replacing the pinned identity of {desc} ({pinned}) with "
              f"{seen.fingerprint}, as --fingerprint says", file=sys.stderr)
    elif not pinned and not given:
        _confirm(term, desc, seen)
    return seen.fingerprint


# ------------------------------------------------------------------------------ the fleet
@dataclass
class FleetPins:
    """What login did with the members of a fleet its server listed."""

    added: list[str]  # "name at address (fingerprint)"
    kept: list[str]  # already pinned with the same identity
    conflicts: list[str]  # pinned with another identity: left alone, said loudly


def _fleet_members(info: InfoResult, key: tuple[str, str]) -> list[dict[str, Any]]:
    members = []
    for s in info.data.get("fleet_servers") or []:
        if not isinstance(s, Mapping) or s.get("this") or not s.get("address"):
            continue
        if _key(str(s["address"])) in (None, key):
            continue
        members.append(dict(s))
    return members


def _pin_fleet(info: InfoResult, key: tuple[str, str], entries: list[dict[str, Any]],
               template: dict[str, Any], path: Path) -> FleetPins:
    """The fleet's other servers into `entries`: a new entry (address, the token, the client
    certificate of `template`, the pin the fleet registered) for each the file lacks; an entry
    without a pin gets the fleet's; a different pin is never overwritten (a key changed, or the
    fleet's record is wrong: the user must find out which)."""
    out = FleetPins([], [], [])
    for m in _fleet_members(info, key):
        address, name = str(m["address"]), str(m.get("server") or m["address"])
        try:
            fp = check_fingerprint(str(m.get("fingerprint") or ""))
        except ConfigError:
            continue  # a member without TLS (or an old server): nothing to pin
        shown = f"{name} at {address} ({fp})"
        mkey = _key(address)
        assert mkey is not None
        entry = next((e for e in entries if _same(e, mkey)), None)
        if entry is None:
            new = {"address": address, **template, "tls_fingerprint": fp}
            entries.append(new)
            out.added.append(shown)
        elif entry.get("tls") is False:
            continue  # plain TCP by the user's choice: not ours to change
        elif not entry.get("tls_fingerprint"):
            entry["tls_fingerprint"] = fp
            for k, v in template.items():
                entry.setdefault(k, v)
            out.added.append(shown)
        elif entry["tls_fingerprint"] == fp:
            out.kept.append(shown)
        else:
            out.conflicts.append(
                f"the fleet lists {name} at {address} with the identity {fp}, but {path} pins "
                f"{entry['tls_fingerprint']} for it: left as it is; ask the operator what "
                f"`gpupoold fingerprint` prints on {name} (programs sent there by a redirect "
                "are refused until the two agree)")
    return out


def _say_fleet(url: str, pins: FleetPins, path: Path) -> None:
    if pins.added:
        print(f"gpupool: pinned {len(pins.added)} other server{'s' if len(pins.added) != 1 else ''}"
              f" of its fleet, as {url} listed them over the pinned connection, with the same "
              f"token: {'; '.join(pins.added)}. Added to {path}: `gpupool status` asks them "
              "too, and programs may use them directly")
    if pins.kept:
        print(f"gpupool: already pinned in its fleet: {'; '.join(pins.kept)}")
    for line in pins.conflicts:
        print(f"gpupool: WARNING: {line}", file=sys.stderr)


# ------------------------------------------------------------------------------ login
def _usage(args: LoginArgs, prefix: bool) -> None:
    """LoginRefused (2) for options that contradict each other; the fingerprint made canonical."""
    if args.plain and (prefix or args.fingerprint or args.tls_ca):
        what = "tls://" if prefix else "--fingerprint" if args.fingerprint else "--tls-ca"
        raise LoginRefused(f"--plain (no TLS) contradicts {what}: drop one of them", 2)
    if args.fingerprint is not None:
        try:
            args.fingerprint = check_fingerprint(args.fingerprint)
        except ConfigError as exc:
            raise LoginRefused(f"--fingerprint {exc}", 2) from None


def _plain_warning(desc: str) -> None:
    print(f"gpupool: WARNING: plain TCP to {desc} (--plain): the token and everything your "
          "programs send cross the network unencrypted, and nothing checks that the server is "
          "the one you mean; use it only on a network you trust (with TLS on the server, log in "
          "without --plain)", file=sys.stderr)


def cmd_login(args: LoginArgs, env: Mapping[str, str]) -> int:
    term: Terminal | None = None
    try:
        term = None if _non_interactive(args) else Terminal.open()
        return _login(args, env, term)
    except LoginRefused as exc:
        print(f"gpupool: error: {exc}", file=sys.stderr)
        return exc.code
    finally:
        if term is not None:
            term.close()


def _non_interactive(args: LoginArgs) -> bool:
    """Nothing to ask: the identity is vouched for by --fingerprint or a CA (or there is none,
    --plain), and the token is given."""
    has_token = args.token is not None or args.token_file is not None
    return has_token and bool(args.fingerprint or args.tls_ca or args.plain)


def _login(args: LoginArgs, env: Mapping[str, str], term: Terminal | None) -> int:
    try:
        address, host, port, prefix = split_address(args.url)
    except ValueError as exc:
        raise LoginRefused(f"{exc}; write HOST:PORT", 2) from None
    _usage(args, prefix)
    token = _read_token(args)
    if token is None and term is None:
        raise LoginRefused(
            "no token and no terminal to ask for it: give it with --token-file FILE, or "
            "--token-file - on standard input (`--token TOKEN` works too, but is visible in "
            "`ps` and the shell's history)", 2)
    tls_ca = args.tls_ca
    if tls_ca:
        ca = Path(tls_ca).expanduser().resolve()
        if not ca.is_file():
            raise LoginRefused(f"--tls-ca {tls_ca}: no such file; give the PEM file of the CA "
                               "that signed the server's certificate")
        tls_ca = str(ca)
    try:
        path = target_file(env, args.system)
        data = _existing(path)
    except ConfigError as exc:
        raise LoginRefused(f"{exc}; fix or remove that file, then log in again") from None
    key = (host.lower(), port)
    entries = _entries(data)
    entry = next((e for e in entries if _same(e, key)), None)
    base = path.resolve().parent  # relative paths: from the real file's folder, as the readers

    def setting(name: str) -> Any:
        """What the entry will say (its own, else the file's top level)."""
        if entry is not None and name in entry:
            return entry[name]
        return data.get(name)

    plain = args.plain
    srv = ServerConfig(address=address, host=host, port=port, tls=not plain, tls_prefix=prefix)
    for k in PATH_KEYS:
        setattr(srv, k, _resolve(str(setting(k) or ""), base))
    srv.tls_ca = tls_ca or srv.tls_ca
    pinned = str(entry.get("tls_fingerprint") or "") if entry is not None else ""
    timeout = data.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
        timeout = DEFAULT_CONNECT_TIMEOUT
    desc = server_desc(srv)

    # The identity first: nothing secret goes before it is settled.
    if plain:
        _plain_warning(desc)
    elif srv.tls_ca:
        srv.tls_fingerprint = args.fingerprint or pinned  # checked with the chain, if any
    else:
        srv.tls_fingerprint = _pin(args, srv, pinned, path, term, float(timeout))
    if token is None:
        assert term is not None
        token = _ask_token(term, desc)
    srv.token = token
    info = _ask_info(args, srv, float(timeout), path)

    new = _written(args, srv, tls_ca, turn_tls_on=not prefix and setting("tls") is False)
    if entry is None:
        entries.append(new)
    else:
        entry.update(new)
    fleet = None
    if not plain:  # only a verified channel may vouch for other servers
        template = {"token": token, **{k: entry[k] for k in ("tls_cert", "tls_key")
                                       if entry is not None and entry.get(k)}}
        fleet = _pin_fleet(info, key, entries, template, path)
    data["servers"] = entries
    _write(path, data, args.system)
    _say_done(args, srv, info, path, env)
    if fleet is not None:
        _say_fleet(args.url, fleet, path)
    return 0


def _written(args: LoginArgs, srv: ServerConfig, tls_ca: str | None, turn_tls_on: bool,
             ) -> dict[str, Any]:
    """The settings login writes into the server's entry (over what it had)."""
    new: dict[str, Any] = {"address": args.url.strip(), "token": srv.token}
    if not srv.tls:
        new["tls"] = False
        return new
    if srv.tls_fingerprint:
        new["tls_fingerprint"] = srv.tls_fingerprint
    if tls_ca:
        new["tls_ca"] = tls_ca
    if turn_tls_on:
        new["tls"] = True  # TLS now: the entry (or the file's top level) said false
    return new


def _ask_info(args: LoginArgs, srv: ServerConfig, timeout: float, path: Path) -> InfoResult:
    """The server's answer to info with the token: LoginRefused unless it accepts it."""
    url = args.url
    try:
        info = fetch_info(srv, timeout)
    except WireError as exc:
        if exc.kind == "identity" and "HAS CHANGED" in str(exc):
            raise LoginRefused(
                f"{exc}\n  Nothing was sent and {path} is unchanged; to pin the new identity "
                f"deliberately, once the server's operator confirms it: `gpupool login "
                f"{server_desc(srv)} --fingerprint SHA256:...`") from None
        raise LoginRefused(f"cannot log in to {url}: {exc}; nothing was written") from None
    if info.result == gp.GP_EAUTH:
        raise LoginRefused(f"{url} refused the token: {info.message}; nothing was written. "
                           "Check the token with the server's operator (`gpupoold token list`)")
    if info.result == gp.GP_EVERSION:
        raise LoginRefused(f"{url} speaks protocol {info.major}.{info.minor}, this client "
                           f"{gp.MAJOR}.{gp.MINOR}: {info.message}; nothing was written. Use a "
                           "gpupool client of the server's version, or upgrade gpupoold")
    if info.result != 0:
        if "requires TLS" in info.message:
            raise LoginRefused(f"{url} refused: {info.message}; nothing was written. Log in "
                               f"with TLS: `gpupool login {url}` without --plain")
        raise LoginRefused(f"{url} refused: {info.message or info.result_name()}; nothing was "
                           "written")
    return info


def _write(path: Path, data: dict[str, Any], system: bool) -> None:
    modes = SYSTEM_MODES if system else USER_MODES
    try:
        write_file(path, data, *modes)
    except PermissionError:
        hint = " (run it as root: sudo gpupool login ... --system)" if system else ""
        raise LoginRefused(f"cannot write {path}: permission denied{hint}") from None
    except OSError as exc:
        raise LoginRefused(f"cannot write {path}: {exc.strerror or exc}") from None


def _say_done(args: LoginArgs, srv: ServerConfig, info: InfoResult, path: Path,
              env: Mapping[str, str]) -> None:
    you = info.data.get("you") if isinstance(info.data.get("you"), Mapping) else {}
    if not srv.tls:
        how = "plain TCP, unencrypted"
    elif srv.tls_fingerprint:
        how = f"{info.tls_version or 'TLS'}, identity {srv.tls_fingerprint} pinned"
    else:
        how = f"{info.tls_version or 'TLS'}, certificate verified with {srv.tls_ca}"
    print(f"gpupool: logged in to {args.url}: {info.server or 'gpupoold'}, {info.gpus} GPU"
          f"{'' if info.gpus == 1 else 's'} ({info.free_matching} free); token "
          f"{you.get('name') or '?'} ({you.get('role') or '?'}); {how}. Wrote {path}")
    if not args.system and (env.get("GPUPOOL_CONFIG") or "") == "none":
        print("gpupool: note: GPUPOOL_CONFIG=none is set, so programs read no config file "
              "until you unset it", file=sys.stderr)
    if (env.get("GPUPOOL_SERVER") or "").strip():
        print("gpupool: note: GPUPOOL_SERVER is set and replaces the file's server list; unset "
              "it to use the servers of the file", file=sys.stderr)
    if (env.get("GPUPOOL_TOKEN") or "").strip():
        print("gpupool: note: GPUPOOL_TOKEN is set and overrides the token of every server; "
              "unset it to use the file's tokens", file=sys.stderr)
    if (env.get("GPUPOOL_TLS") or "").strip() in ("0", "no", "false", "off") and info.tls_version:
        print("gpupool: note: GPUPOOL_TLS=0 is set and makes programs use plain TCP to every "
              "server; unset it", file=sys.stderr)


# ------------------------------------------------------------------------------ logout
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
    print(f"gpupool: logged out of {url}: removed it, its token and its pinned identity from "
          f"{path}")
    return 0
