"""The `gpupoold` command line.

- `serve`: run the daemon. Its flags are generated from the settings that declare one
  (config/settings.py), so a flag and its config key always mean the same thing.
- `fingerprint [--pem]`: the remoting port's TLS identity (what clients pin), read from the
  state directory or the configured `tls_cert`; never made here.
- `token create|list|revoke|set-weight`: API tokens (set-weight: their shares' weight on shared
  GPUs), on the database directly (`<state_dir>/gpupoold.db`), whether the daemon runs or not;
  audited as `cli:<unix user>`.
- `status`, `gpu drain|undrain|clear INDEX`, `lease end ID`, `report`: clients of the running daemon's HTTP
  API (admin_client.py), authenticated with `--token`, `GPUPOOL_ADMIN_TOKEN` or the local admin
  token the daemon writes to `<state_dir>/local-admin.token`.

Exit status: 0 done, 1 failed (the message says why and what to do), 2 bad command line, 78
(EX_CONFIG) `serve` with a configuration that cannot work (systemd then does not restart it).
"""

from __future__ import annotations

import argparse
import datetime
import grp
import json
import os
import pwd
import sqlite3
import stat
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpupoold import __version__
from gpupoold.admin_client import AdminClient, AdminError, base_url, tls_context
from gpupoold.auth.authenticator import LOCAL_ADMIN_FILE
from gpupoold.config.file import EX_CONFIG, ConfigError, load_settings
from gpupoold.config.settings import DEFAULT_CONFIG, Settings, iter_flags
from gpupoold.pool.report import to_csv, to_text
from gpupoold.store.database import DB_NAME, NotFound, SchemaTooNew, StoreDB, TokenExists
from gpupoold.store.postgres import UrlError, driver_errors
from gpupoold.store.tokens import (
    check_token_name,
    check_weight,
    format_local,
    format_utc,
    parse_expiry,
)

ADMIN_TOKEN_ENV = "GPUPOOL_ADMIN_TOKEN"


class CliError(Exception):
    """A failure of an admin command; the message says what happened and what to do."""


def _flag_type(info_type: Any) -> Callable[[str], Any]:
    """The argparse converter of a setting's type (lists have no flag)."""
    return info_type if info_type in (int, float, Path) else str


# ------------------------------------------------------------------------------------ parser
def _config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="PATH",
                   help=f"TOML config file (default {DEFAULT_CONFIG}, if it exists)")


def _local_options() -> argparse.ArgumentParser:
    """Options of the commands that work on the database."""
    p = argparse.ArgumentParser(add_help=False)
    _config_flag(p)
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="the daemon's state directory, which holds gpupoold.db "
                        "[setting `state_dir`]")
    p.add_argument("--database", metavar="URL",
                   help="the shared PostgreSQL store (postgresql://USER@HOST:PORT/DATABASE; the "
                        "password from PGPASSWORD or PGPASSFILE) instead of the state "
                        "directory's SQLite file [setting `database`]")
    return p


def _remote_options() -> argparse.ArgumentParser:
    """Options of the commands that talk to the running daemon."""
    p = argparse.ArgumentParser(add_help=False)
    _config_flag(p)
    p.add_argument("--http", metavar="HOST:PORT|URL",
                   help="the daemon's HTTP API: HOST:PORT (https when the config sets "
                        "http_tls_cert) or a full http:// or https:// URL [setting `http`]")
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="where to find local-admin.token [setting `state_dir`]")
    p.add_argument("--token", metavar="TOKEN",
                   help=f"admin API token (other users can see a command line: prefer "
                        f"{ADMIN_TOKEN_ENV}); default: {ADMIN_TOKEN_ENV}, else "
                        "<state_dir>/local-admin.token")
    p.add_argument("--cacert", type=Path, metavar="PATH",
                   help="PEM CA certificate to verify the daemon's HTTPS certificate "
                        "(default: the system CAs and the daemon's own http_tls_cert)")
    p.add_argument("--cert", type=Path, metavar="PATH",
                   help="PEM client certificate, when the daemon requires one "
                        "(http_tls_client_ca)")
    p.add_argument("--key", type=Path, metavar="PATH", help="the private key of --cert")
    p.add_argument("--json", action="store_true", help="print the API's JSON answer")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpupoold", description="gpupool daemon: lends this server's GPUs to remote clients.")
    parser.add_argument("--version", action="version", version=f"gpupoold {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser(
        "serve", help="run the daemon (remoting listener + HTTP API)",
        description="Run the daemon. Flags override the config file (docs/configuration.md).")
    _config_flag(serve)
    for info in iter_flags():
        serve.add_argument(info.flag, dest=info.name, type=_flag_type(info.base_type),
                           metavar=info.metavar, default=None,
                           help=f"{info.help} [setting `{info.name}`]".replace("%", "%%"))

    local, remote = _local_options(), _remote_options()
    token = sub.add_parser(
        "token", help="create, list and revoke API tokens, set their share weights",
        description="Manage API tokens in the daemon's database (run on the server, as root or "
                    "the user gpupoold runs as; the daemon need not be running).")
    tsub = token.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = tsub.add_parser("create", parents=[local], help="create a token (printed once)",
                             description="Create a token and print it on stdout: the only time "
                                         "it is shown.")
    create.add_argument("--name", required=True, help="1-64 letters, digits and . _ @ -")
    create.add_argument("--role", choices=("user", "admin"), default="user",
                        help="user: GPUs and read-only API; admin: also operator actions "
                             "(default user)")
    create.add_argument("--expires", default="never", metavar="WHEN",
                        help="never (default), a duration (90m, 12h, 30d, 2w) or an ISO date")
    create.add_argument("--weight", type=int, default=1, metavar="N",
                        help="its shares' weight on a shared GPU, 1-1000 (default 1): while "
                             "shares wait for the GPU's time they get it in the ratio of their "
                             "weights")
    create.add_argument("--json", action="store_true",
                        help="print the token and its record as JSON")
    weight = tsub.add_parser("set-weight", parents=[local],
                             help="set a token's share weight on shared GPUs",
                             description="Set the weight (1-1000) of a token's shares on shared "
                                         "GPUs; shares that start from now on get it.")
    weight.add_argument("name", metavar="NAME")
    weight.add_argument("weight", metavar="WEIGHT", type=int)
    listing = tsub.add_parser("list", parents=[local], help="list the tokens (never secrets)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    revoke = tsub.add_parser("revoke", parents=[local], help="revoke a token")
    revoke.add_argument("name", metavar="NAME")

    fingerprint = sub.add_parser(
        "fingerprint", help="print this server's TLS identity (what clients pin)",
        description="Print the fingerprint of the remoting port's certificate (SHA256:..., as "
                    "`ssh-keygen -l` prints a key's): the identity gpupoold made in its state "
                    "directory, or that of the `tls_cert` the configuration names. Clients pin "
                    "it (`gpupool login`, GPUPOOL_TLS_FINGERPRINT).")
    _config_flag(fingerprint)
    fingerprint.add_argument("--state-dir", type=Path, metavar="DIR",
                             help="the daemon's state directory [setting `state_dir`]")
    fingerprint.add_argument("--pem", action="store_true",
                             help="print the certificate (PEM) instead, e.g. for Prometheus' "
                                  "tls_config ca_file")
    sub.add_parser("status", parents=[remote], help="GPUs, leases and queue",
                   description="Ask the running daemon for its GPUs, leases and queue.")
    gpu = sub.add_parser("gpu", help="drain, undrain or clear a GPU",
                         description="Operator actions on one GPU of the running daemon.")
    gsub = gpu.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, text in (("drain", "no new leases on the GPU (the current one may finish)"),
                         ("undrain", "put a drained GPU back in service"),
                         ("clear", "clear a quarantine: the GPU is scrubbed and checked again")):
        p = gsub.add_parser(action, parents=[remote], help=text, description=text)
        p.add_argument("index", type=int, metavar="INDEX", help="GPU index, as `status` shows")
    lease = sub.add_parser("lease", help="end a lease",
                           description="Operator actions on a lease of the running daemon.")
    lsub = lease.add_subparsers(dest="action", metavar="ACTION", required=True)
    end = lsub.add_parser("end", parents=[remote], help="end an active lease",
                          description="Tell the lease's client why and disconnect it; the GPU "
                                      "is scrubbed afterwards.")
    end.add_argument("lease_id", type=int, metavar="ID", help="lease id, as `status` shows")
    end.add_argument("--reason", default="", metavar="TEXT",
                     help="shown to the client and recorded")
    report = sub.add_parser(
        "report", parents=[remote], help="how busy the GPUs were, per GPU, token or server",
        description="The usage report of a period (issue 33): leased and busy share of the "
                    "GPUs' time, GPU-hours per group, queue waits, what idle detach handed on. "
                    "Times are Unix seconds, an ISO 8601 date or time (UTC unless it says), "
                    "or an age such as 7d, 24h or 30m (before now).")
    report.add_argument("--from", dest="since", metavar="TIME", default="7d",
                        help="start of the period (default: 7d, the week before now)")
    report.add_argument("--to", dest="until", metavar="TIME", default="",
                        help="end of the period (default: now)")
    report.add_argument("--by", choices=("gpu", "token", "server"), default="gpu",
                        help="one line per GPU, token or server (default: gpu)")
    report.add_argument("--csv", action="store_true", help="print the groups as CSV")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        overrides = {info.name: getattr(args, info.name) for info in iter_flags()}
        try:
            settings = load_settings(args.config, overrides)
        except ConfigError as exc:
            from gpupoold.log import print_error

            print_error(f"gpupoold: error: {exc}")
            return EX_CONFIG
        from gpupoold.log import setup_logging
        from gpupoold.serve import run

        setup_logging(settings.log_level)
        return run(settings)
    try:
        if args.command == "token":
            return _token_command(args)
        if args.command == "fingerprint":
            return _fingerprint(args)
        return _remote_command(args)
    except ConfigError as exc:
        print(f"gpupoold: error: {_config_error_text(exc, args)}", file=sys.stderr)
        return 1
    except CliError as exc:
        print(f"gpupoold: error: {exc}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------------- helpers
def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    return load_settings(args.config, {"state_dir": args.state_dir, **overrides})


def _fingerprint(args: argparse.Namespace) -> int:
    """`gpupoold fingerprint [--pem]`: the remoting port's identity, read only (never made)."""
    from gpupoold.tls_identity import (
        IdentityError,
        fingerprint_of_pem,
        identity_paths,
        load_identity,
    )

    settings = _settings(args)
    if settings.tls_cert is not None:  # the operator's own certificate
        cert = Path(settings.tls_cert)
        try:
            pem = cert.read_bytes()
            text = fingerprint_of_pem(pem)
        except PermissionError:
            raise _denied("cannot read the certificate (setting 'tls_cert')", cert,
                          _command_words(args)) from None
        except OSError as exc:
            raise CliError(f"cannot read {cert} (setting 'tls_cert'): "
                           f"{exc.strerror or exc}") from None
        except ValueError as exc:
            raise CliError(f"{cert} (setting 'tls_cert') is not a PEM certificate "
                           f"({exc})") from None
    else:
        cert_path = identity_paths(settings.state_dir)[0]
        try:
            with cert_path.open("rb"):
                pass
        except PermissionError:  # the identity is the daemon's user's (0700 folder)
            raise _denied("cannot read the server's certificate", cert_path,
                          _command_words(args)) from None
        except OSError:
            pass  # missing: load_identity says None
        try:
            ident = load_identity(settings.state_dir)
        except IdentityError as exc:
            raise CliError(str(exc)) from None
        if ident is None:
            extra = (" (its configuration has tls = \"off\": it serves plain TCP)"
                     if settings.tls == "off" else "")
            raise CliError(f"no identity in {settings.state_dir} yet{extra}: gpupoold makes it "
                           f"at its first start (start it once, e.g. `systemctl start "
                           f"gpupoold`), or give the right --state-dir")
        try:
            pem = ident.cert_pem()
        except OSError as exc:
            raise CliError(f"cannot read {ident.cert_path}: {exc.strerror or exc}") from None
        text = ident.fingerprint
    if args.pem:
        sys.stdout.write(pem.decode("ascii", errors="replace"))
    else:
        print(text)
    if settings.tls == "off":
        print("gpupoold: warning: the configuration says tls = \"off\": the remoting port "
              "serves plain TCP and presents no certificate", file=sys.stderr)
    return 0


def _unix_user() -> str:
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


# ------------------------------------------------------------------------ rights and messages
# An admin command run without the rights it needs ends in one line that says which file it
# could not use and what to do: sudo, or the group whose members may (only when membership alone
# would do: the daemon's own files are usually its user's only, 0600).
def _command_words(args: argparse.Namespace) -> str:
    """`gpupoold token list`: the command that was run, without its options (one of them may be
    a token)."""
    words = ["gpupoold", str(args.command)]
    action = getattr(args, "action", None)
    if isinstance(action, str):
        words.append(action)
    return " ".join(words)


def _granting_group(path: Path, write: bool) -> str | None:
    """The group whose members could use `path` (read it, or also write it) where this user
    cannot: its group bits and those of each folder on the way (search) grant what is missing.
    None when a group would not be enough, or it cannot be told (a file behind a folder this
    user cannot enter), or the group is root's."""
    need_target = os.R_OK | (os.W_OK if write else 0)
    gids = set()
    for where, need in ((path, need_target), *((p, os.X_OK) for p in path.parents)):
        try:
            st = where.stat()
        except FileNotFoundError:
            continue
        except PermissionError:  # behind a folder we cannot enter: its mode is unknown
            return None
        if os.access(where, need):
            continue
        bits = ((stat.S_IRGRP if need & os.R_OK else 0) | (stat.S_IWGRP if need & os.W_OK else 0)
                | (stat.S_IXGRP if need & os.X_OK else 0))
        if st.st_mode & bits != bits:
            return None
        gids.add(st.st_gid)
    if len(gids) != 1 or 0 in gids:
        return None
    try:
        return grp.getgrgid(gids.pop()).gr_name
    except KeyError:
        return None


def _rights_fix(path: Path, command: str, write: bool = False) -> str:
    """What to do when this user may not use `path`: sudo, or membership of a group that may."""
    fix = f"run it with sudo (`sudo {command}`)"
    group = _granting_group(path, write)
    if group is not None:
        fix += (f" or as a member of the group {group} (`sudo adduser {_unix_user()} {group}`, "
                "then log in again)")
    return fix


def _denied(what: str, path: Path, command: str, write: bool = False) -> CliError:
    """The one-line error of a file this user may not use."""
    return CliError(f"{what} {path}: permission denied for {_unix_user()}; "
                    f"{_rights_fix(path, command, write)}")


def _config_error_text(exc: ConfigError, args: argparse.Namespace) -> str:
    """A configuration error; one this user may not read says how to run the command."""
    config = args.config if getattr(args, "config", None) is not None else DEFAULT_CONFIG
    try:
        unreadable = config.exists() and not os.access(config, os.R_OK)
    except PermissionError:
        unreadable = True
    if unreadable:
        return str(_denied("cannot read the configuration", config, _command_words(args)))
    return str(exc)


def cli_actor() -> str:
    """The audit log's actor of a CLI action: `cli:<unix user>` (and who used sudo)."""
    user = _unix_user()
    sudo = os.environ.get("SUDO_USER", "") if os.geteuid() == 0 else ""
    return f"cli:{user}" + (f" (sudo by {sudo})" if sudo and sudo != user else "")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in (headers, *rows)]
    return "\n".join(lines)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


# ---------------------------------------------------------------------------- token commands
def _token_command(args: argparse.Namespace) -> int:
    settings = _settings(args, database=args.database)
    if args.action == "create":
        try:
            check_token_name(args.name)
        except ValueError as exc:
            raise CliError(f"bad token name {args.name!r}: {exc}") from None
        try:
            expires = parse_expiry(args.expires)
        except ValueError as exc:
            raise CliError(f"bad --expires {args.expires!r}: {exc}") from None
    if args.action in ("create", "set-weight"):
        try:
            check_weight(args.weight)
        except ValueError as exc:
            raise CliError(f"bad weight {args.weight}: {exc}") from None
    if settings.database:  # the shared PostgreSQL store: a token made here is the fleet's
        try:
            db = StoreDB(settings.database, settings.database_password_file)
        except (SchemaTooNew, UrlError) as exc:
            raise CliError(f"setting 'database': {exc}") from None
    else:
        db = open_db(settings.state_dir, create=args.action == "create",
                     command=_command_words(args))
    try:
        if args.action == "create":
            return _token_create(db, args, expires)
        if args.action == "list":
            return _token_list(db, args)
        if args.action == "set-weight":
            return _token_set_weight(db, args)
        return _token_revoke(db, args)
    except (sqlite3.Error, *driver_errors()) as exc:
        raise CliError(f"database {db.where}: {exc}") from None
    finally:
        db.close()


def open_db(state_dir: Path, create: bool, command: str = "gpupoold token") -> StoreDB:
    """The store of `state_dir` for this process, or CliError saying why not. With `create`,
    the directory and the database are made if missing (a token can be made before the daemon
    first starts); without, a missing database is an error (most likely a wrong directory).
    `command` (`gpupoold token list`) goes into the advice when this user lacks the rights."""
    path = state_dir / DB_NAME
    what = "cannot open the database (tokens, lease history)"
    try:
        exists = path.exists()
    except PermissionError:  # the state directory is not ours to enter (0750 gpupoold)
        raise _denied(what, path, command, write=True) from None
    if not create and not exists:
        raise CliError(f"there is no database {path}: no token was made and gpupoold never ran "
                       "with this state directory; check --state-dir (or `state_dir` in the "
                       "config given with --config)")
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    except PermissionError:
        raise _denied("cannot create the state directory", state_dir, command,
                      write=True) from None
    except OSError as exc:
        raise CliError(f"cannot create the state directory {state_dir}: {exc.strerror}; choose "
                       "another with --state-dir or `state_dir` in the config (--config)"
                       ) from None
    # SQLite writes next to the database (its -wal and -shm files), even to read it.
    if not os.access(state_dir, os.W_OK | os.X_OK):
        raise _denied(what, path, command, write=True)
    if exists and not os.access(path, os.R_OK | os.W_OK):
        raise _denied(what, path, command, write=True)
    if not exists:
        _create_owned_like(path, state_dir)
    try:
        return StoreDB(path)
    except SchemaTooNew as exc:
        raise CliError(str(exc)) from None
    except sqlite3.Error as exc:
        text = str(exc)
        if "readonly" in text or "unable to open" in text:
            raise CliError(f"cannot open the database {path}: {text}; "
                           f"{_rights_fix(path, command, write=True)}") from None
        raise CliError(f"cannot open the database {path}: {text}; is it a gpupoold database? "
                       "(keep a copy and move it away to start afresh)") from None


def _create_owned_like(path: Path, state_dir: Path) -> None:
    """Create the empty database file (0600). Run as root in a state directory owned by the
    daemon's user, give the file to that user: a root-owned database would lock the daemon out.
    SQLite itself gives the -wal and -shm files the database file's owner."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    try:
        st = state_dir.stat()
        if os.geteuid() == 0 and st.st_uid != 0:
            os.fchown(fd, st.st_uid, st.st_gid)
    finally:
        os.close(fd)


def _token_create(db: StoreDB, args: argparse.Namespace, expires: float | None) -> int:
    try:
        record, text = db.create_token(args.name, args.role, expires, cli_actor(),
                                       weight=args.weight)
    except TokenExists:
        raise CliError(f"a token named {args.name!r} already exists (revoked tokens keep their "
                       "name): choose another name; `gpupoold token list` shows them") from None
    note = "the token is shown only this once: store it now"
    if args.json:
        _print_json({"token": record.to_json(), "secret": text, "note": note})
    else:
        print(text)
    print(f"Created {record.role} token '{record.name}' (id {record.id}, expires "
          f"{format_local(record.expires)}).\nNote: {note} (a client sets it as GPUPOOL_TOKEN).",
          file=sys.stderr)
    return 0


def _token_list(db: StoreDB, args: argparse.Namespace) -> int:
    tokens = db.list_tokens()
    if args.json:
        _print_json({"tokens": [t.to_json() for t in tokens]})
        return 0
    if not tokens:
        print("No tokens yet: create one with `gpupoold token create --name NAME`.")
        return 0
    now = time.time()
    rows = [(t.name, t.role, t.id, format_local(t.created), format_local(t.expires),
             format_local(t.last_used, "never"), str(t.weight), t.state(now)) for t in tokens]
    print(_table(("NAME", "ROLE", "ID", "CREATED", "EXPIRES", "LAST USED", "WEIGHT", "STATE"),
                 rows))
    return 0


def _token_set_weight(db: StoreDB, args: argparse.Namespace) -> int:
    try:
        record = db.set_token_weight(args.name, args.weight, cli_actor())
    except NotFound:
        raise CliError(f"no token named {args.name!r}; `gpupoold token list` shows the "
                       "tokens") from None
    print(f"Token '{record.name}' has share weight {record.weight} now: its shares that start "
          "from now on get it (running shares keep theirs).")
    return 0


def _token_revoke(db: StoreDB, args: argparse.Namespace) -> int:
    before = db.get_token(args.name)
    if before is not None and before.revoked is not None:
        print(f"Token '{args.name}' was already revoked on {format_local(before.revoked)}.")
        return 0
    try:
        record = db.revoke_token(args.name, cli_actor())
    except NotFound:
        raise CliError(f"no token named {args.name!r}; `gpupoold token list` shows the "
                       "tokens") from None
    print(f"Revoked {record.role} token '{record.name}' (id {record.id}): it is refused from "
          "now on. Leases it holds go on until they end; end one with `gpupoold lease end ID`.")
    return 0


# ------------------------------------------------------------------- commands to the daemon
def _remote_command(args: argparse.Namespace) -> int:
    client, token, source = _admin_client(args)
    try:
        if args.command == "status":
            return _status(client, args)
        if args.command == "gpu":
            return _gpu(client, args)
        if args.command == "report":
            return _report(client, args)
        return _lease_end(client, args)
    except AdminError as exc:
        if exc.status == 401:
            raise CliError(_refused_text(client.url, exc, token, source)) from None
        raise CliError(str(exc)) from None


def _refused_text(url: str, exc: AdminError, token: str, source: str) -> str:
    """One line for a 401 of the daemon: where this command looked for its admin token and what
    to do. (The daemon's own words are for remoting clients: they name GPUPOOL_TOKEN, which
    these commands do not read, and repeat the hint.)"""
    if not token:
        return f"gpupoold at {url} needs an admin token and this command found none: {source}"
    what = exc.message
    for advice in (": check ", "; check ", "; ask "):  # keep what happened, not their advice
        what = what.split(advice)[0]
    if source == "--token":
        fix = ("pass an admin token (`sudo gpupoold token create --name NAME --role admin` "
               "makes one)")
    elif source == ADMIN_TOKEN_ENV:
        fix = (f"set {ADMIN_TOKEN_ENV} to an admin token (`sudo gpupoold token create --name "
               f"NAME --role admin` makes one), or unset it to use the daemon's local admin "
               "token (as root)")
    else:
        fix = ("the running daemon rewrites it at every start: is --state-dir (or `state_dir` "
               "in the config) its state directory?")
    return f"gpupoold at {url} refused the admin token from {source}: {what}; {fix}"


def _admin_client(args: argparse.Namespace) -> tuple[AdminClient, str, str]:
    """The API client, its token ("" when none was found) and where the token came from (or,
    without one, why none was found and what to do)."""
    http = args.http
    overrides = {} if http is None or "://" in http else {"http": http}
    settings = _settings(args, **overrides)
    tls = settings.http_tls_cert is not None
    try:
        url = base_url(http if http and "://" in http else settings.http, tls)
    except ValueError as exc:
        raise CliError(f"bad --http {http!r}: {exc}") from None
    context = None
    if url.startswith("https://"):
        try:
            context = tls_context(args.cacert, settings.http_tls_cert, args.cert, args.key)
        except AdminError as exc:
            raise CliError(str(exc)) from None
    token, source = _admin_token(args, settings)
    return AdminClient(url, token, context=context), token, source


def _admin_token(args: argparse.Namespace, settings: Settings) -> tuple[str, str]:
    """(token, where it came from); an empty token with the reason and the fix when none was
    found (the request then goes without one: the daemon may not need it, `auth = "none"`)."""
    if args.token:
        return args.token.strip(), "--token"
    env = os.environ.get(ADMIN_TOKEN_ENV, "").strip()
    if env:
        return env, ADMIN_TOKEN_ENV
    path = settings.state_dir / LOCAL_ADMIN_FILE
    other = f"set {ADMIN_TOKEN_ENV} to an admin token"
    try:
        return path.read_text().strip(), f"the local admin token {path}"
    except FileNotFoundError:
        return "", (f"{path} does not exist (gpupoold writes it when it starts: is this its "
                    f"state directory? --state-dir, or `state_dir` in --config); or {other}")
    except PermissionError:
        return "", (f"{path}: permission denied for {_unix_user()} (it is the daemon's); "
                    f"{_rights_fix(path, _command_words(args))}, or {other}")
    except OSError as exc:
        return "", f"cannot read {path}: {exc.strerror}; {other}"


def _ago(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _since(ts: Any, now: float) -> str:
    if not isinstance(ts, int | float):
        return "-"
    return f"{format_local(ts)} ({_ago(now - ts)} ago)"


def _client_text(client: Any) -> str:
    if not isinstance(client, dict):
        return "?"
    text = f"{client.get('user') or '?'}@{client.get('host') or '?'} pid {client.get('pid', '?')}"
    if client.get("program"):
        text += f" ({client['program']})"
    return text


_AGE_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def report_time(text: str, now: float) -> float:
    """A report's --from/--to: Unix seconds, ISO 8601 (UTC unless it says), or an age (7d)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    if len(text) > 1 and text[-1] in _AGE_UNITS:
        try:
            return now - float(text[:-1]) * _AGE_UNITS[text[-1]]
        except ValueError:
            pass
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"{text!r} is not a time: give Unix seconds, an ISO 8601 date or time "
                       "(2026-12-01, 2026-12-01T08:00) or an age (7d, 24h, 30m)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def _report(client: AdminClient, args: argparse.Namespace) -> int:
    now = time.time()
    until = report_time(args.until, now) if args.until else now
    since = report_time(args.since, now)
    if not until > since:
        raise CliError("the report's period is empty: --to must come after --from")
    query = urllib.parse.urlencode({"from": f"{since:.3f}", "to": f"{until:.3f}", "by": args.by})
    report = client.get(f"/api/v1/report?{query}")["report"]
    if args.json:
        _print_json(report)
    elif args.csv:
        print(to_csv(report), end="")
    else:
        print(f"{format_utc(since)} to {format_utc(until)}, by {args.by}")
        print(to_text(report), end="")
    return 0


def _status(client: AdminClient, args: argparse.Namespace) -> int:
    status = client.get("/api/v1/status")
    gpus = client.get("/api/v1/gpus").get("gpus", [])
    queue = client.get("/api/v1/queue").get("queue", []) if status.get("queue") else []
    if args.json:
        _print_json({"status": status, "gpus": gpus, "queue": queue})
        return 0
    now = float(status.get("time") or time.time())
    you = status.get("you") or {}
    print(f"gpupoold {status.get('version', '?')} at {client.url}: remoting "
          f"{status.get('remoting', '?')}, auth {status.get('auth', '?')}, you are "
          f"{you.get('name') or '?'} ({you.get('role') or '?'})")
    if status.get("tls") == "off":
        print("WARNING: the remoting port serves PLAIN TCP (tls = \"off\"): tokens and data "
              "cross the network in clear")
    elif status.get("fingerprint"):
        own = " (tls_cert)" if status.get("certificate") == "tls_cert" else ""
        print(f"identity {status['fingerprint']}{own}: what clients pin (`gpupool login`)")
    rows, notes = [], []
    for g in gpus:
        name = str(g.get("name", "?"))
        if g.get("simulated") and "simulated" not in name.lower():
            name += " [simulated]"
        state = str(g.get("state", "?"))
        if g.get("draining") and state != "drained":
            state += " (draining)"
        holder, since = "-", "-"
        lease = g.get("lease")
        if isinstance(lease, dict):
            holder = f"{lease.get('token') or '?'}: {_client_text(lease.get('client'))}"
            since = _since(lease.get("started"), now)
        quarantine = g.get("quarantine")
        if isinstance(quarantine, dict):
            since = _since(quarantine.get("since"), now)
            notes.append(f"GPU {g.get('index')} is quarantined: {quarantine.get('reason') or '?'}"
                         f"; once fixed: `gpupoold gpu clear {g.get('index')}`")
        lease_id = f"#{lease.get('id')}" if isinstance(lease, dict) else "-"
        rows.append((str(g.get("index", "?")), name, state, lease_id, holder, since))
    print()
    if rows:
        print(_table(("GPU", "NAME", "STATE", "LEASE", "HOLDER", "SINCE"), rows))
    else:
        print("No GPUs.")
    for note in notes:
        print(note)
    print()
    print(f"Leases: {status.get('leases', 0)} active. Queue: {status.get('queue', 0)} waiting.")
    for q in queue:
        print(f"  {q.get('position', '?')}. {q.get('token') or '?'}: "
              f"{_client_text(q.get('client'))} wants {q.get('request') or 'any GPU'}, waiting "
              f"{_ago(float(q.get('waiting_s') or 0))}")
    return 0


def _gpu(client: AdminClient, args: argparse.Namespace) -> int:
    index = args.index
    view = client.post(f"/api/v1/gpus/{index}/{args.action}")
    if args.json:
        _print_json(view)
        return 0
    state = view.get("state", "?")
    if args.action == "drain":
        if state == "drained":
            print(f"GPU {index} is drained: no new leases until `gpupoold gpu undrain {index}`.")
        else:
            print(f"GPU {index} will be drained when its current work ends (state now: {state});"
                  f" no new leases meanwhile.")
    elif args.action == "undrain":
        print(f"GPU {index} is back in service (state: {state}).")
    else:
        print(f"GPU {index}: quarantine cleared; it is scrubbed and checked again (state: "
              f"{state}). `gpupoold status` shows the result.")
    return 0


def _lease_end(client: AdminClient, args: argparse.Namespace) -> int:
    body = {"reason": args.reason} if args.reason else {}
    view = client.post(f"/api/v1/leases/{args.lease_id}/end", body)
    if args.json:
        _print_json(view)
        return 0
    print(f"Lease {args.lease_id} on GPU {view.get('gpu', '?')} (token {view.get('token') or '?'}"
          f", {_client_text(view.get('client'))}) is ending: the client is told and "
          "disconnected, then the GPU is scrubbed.")
    return 0
