"""The `gpupool` command. Exit status: 0 ok, 1 failure, 2 usage (a program run with `gpupool run`
exits with its own status).

  run -- CMD...            CMD with gpupool's libcuda.so.1 / libnvidia-ml.so.1 first
  env [--format F]         the same setting for a shell (sh) or a notebook (python, ipython)
  login HOST:PORT          pin the server's identity (shown for you to check), check it accepts
                           the token, then save both in the config file
  logout URL               remove a server and its token from the config file
  config                   the effective settings and where each comes from
  status [--json]          every server: GPUs, my leases, the queue
  smi [--json]             an nvidia-smi-like table of the pool's GPUs
  doctor                   checks, each with a fix
  install --system         register the shims for every program of this machine (root)
  uninstall --system       undo install
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpupool import __version__, config_keys
from gpupool.config import ClientConfig, ConfigError, format_number, load
from gpupool.shim import NVML_NAME, SHIM_NAME, ShimNotFound, client_env

ENV_HELP = """\
Print how to make programs use gpupool without `gpupool run`.

  --format sh (default)   `export LD_LIBRARY_PATH=...`, for a shell:  eval "$(gpupool env)"
  --format python         lines for the first cell of a Jupyter notebook (or the top of a
                          script), before anything imports torch or CUDA: they load gpupool's
                          libcuda.so.1 and libnvidia-ml.so.1 into the running kernel (ctypes)
                          and set os.environ["LD_LIBRARY_PATH"] for the processes it starts
  --format ipython        the same as a `%env LD_LIBRARY_PATH=...` line plus the ctypes line

Why the ctypes line in a notebook: the dynamic loader reads LD_LIBRARY_PATH only when a process
starts, so setting it in a running kernel (os.environ, %env) changes nothing for that kernel;
a library that is already loaded, however, is the one every later dlopen("libcuda.so.1") gets.
Alternatively, start Jupyter itself with `gpupool run -- jupyter lab`.
"""


class _Parser(argparse.ArgumentParser):
    """A parser whose help may end with text made only when the help is shown: `gpupool config
    --help` lists the keys from the reader's own table (libgpupool-config.so), which no other
    command needs to load."""

    def __init__(self, *args: Any, help_tail: Callable[[], str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help_tail = help_tail

    def format_help(self) -> str:
        text = super().format_help()
        return f"{text}\n{self.help_tail()}\n" if self.help_tail else text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpupool", description="Run unmodified CUDA programs on remote GPUs (gpupoold).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Configuration: ~/.config/gpupool/config.toml (gpupool login writes it) and the "
               "GPUPOOL_* environment variables; `gpupool config` shows the result.")
    parser.add_argument("--version", action="version", version=f"gpupool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=_Parser)
    run = sub.add_parser("run", help="run a program with gpupool's libcuda.so.1",
                         description="Run CMD with gpupool's libcuda.so.1 and libnvidia-ml.so.1 "
                                     "first on LD_LIBRARY_PATH, so its CUDA and NVML calls go "
                                     "to the configured GPU servers.")
    run.add_argument("--server", metavar="HOST:PORT",
                     help="use this gpupoold remoting address (sets GPUPOOL_SERVER)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    env = sub.add_parser("env", help="print the settings that make programs use gpupool "
                                     "(shell or notebook)",
                         description=ENV_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    env.add_argument("--format", choices=("sh", "python", "ipython"), default="sh",
                     help="sh (default), python or ipython (see above)")
    login = sub.add_parser(
        "login", help="pin a server's identity and save it with your token in the config file",
        description="Like ssh's first connection: connect with TLS, show the server's identity "
                    "(its key's fingerprint) for you to check against `gpupoold fingerprint` on "
                    "the server and confirm (yes/no), or compare it with --fingerprint; only "
                    "then send the token, and when the server accepts it, write the token and "
                    "the pinned identity (tls_fingerprint) to its [[servers]] entry in "
                    "~/.config/gpupool/config.toml (mode 0600), or /etc/gpupool/config.toml "
                    "with --system. A key that differs from the one already pinned is refused. "
                    "The other servers of its fleet are pinned too, as it lists them. Nothing "
                    "is sent before the identity is settled, and nothing written when a check "
                    "fails.")
    login.add_argument("url", metavar="HOST:PORT",
                       help="gpupoold's remoting address (host:7070 by default)")
    token = login.add_mutually_exclusive_group()
    token.add_argument("--token-file", metavar="FILE",
                       help="read the token from FILE's first line; '-': from standard input "
                            "(default: ask for it on the terminal, not shown)")
    token.add_argument("--token", metavar="TOKEN",
                       help="the token (gpt_...) itself: visible to other users in `ps` and "
                            "kept in the shell's history; prefer --token-file")
    login.add_argument("--fingerprint", metavar="SHA256:...",
                       help="the identity the server must have, as `gpupoold fingerprint` "
                            "prints it there: no question asked (scripts); also the way to "
                            "pin a new identity after the server's key changed")
    login.add_argument("--tls-ca", metavar="FILE",
                       help="PEM file of the CA that signed the server's certificate (an "
                            "operator's own tls_cert): the CA vouches for the server instead")
    login.add_argument("--plain", action="store_true",
                       help="plain TCP, for a server run with tls = \"off\": the token and all "
                            "data cross the network unencrypted (writes tls = false; needed at "
                            "every login in plain TCP)")
    login.add_argument("--system", action="store_true",
                       help="write /etc/gpupool/config.toml (root) for every user")
    logout = sub.add_parser("logout", help="remove a server and its token from the config file")
    logout.add_argument("url", metavar="URL")
    logout.add_argument("--system", action="store_true", help="change /etc/gpupool/config.toml")
    sub.add_parser("config", help="show the effective settings and where each comes from",
                   formatter_class=argparse.RawDescriptionHelpFormatter,
                   help_tail=config_keys.help_text)
    status = sub.add_parser("status", help="servers, GPUs, my leases and the queue")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    smi = sub.add_parser("smi", help="an nvidia-smi-like table of the pool's GPUs")
    smi.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("doctor", help="check the configuration, the servers and the shims, with fixes")
    install = sub.add_parser("install", help="register the shims for every program (root)",
                             description="Copy gpupool's libcuda.so.1 and libnvidia-ml.so.1 to "
                                         "/usr/local/lib/gpupool and register that folder with "
                                         "the dynamic loader (/etc/ld.so.conf.d/gpupool.conf, "
                                         "ldconfig). Refuses when the machine has a real NVIDIA "
                                         "driver, unless --force.")
    install.add_argument("--system", action="store_true", required=True,
                         help="required: the install is for the whole machine")
    install.add_argument("--force", action="store_true",
                         help="install even over a real NVIDIA driver's libcuda.so.1")
    install.add_argument("--root", metavar="DIR", help="install into DIR instead of / (images)")
    uninstall = sub.add_parser("uninstall", help="undo `gpupool install --system`")
    uninstall.add_argument("--system", action="store_true", required=True,
                           help="required: the install is for the whole machine")
    uninstall.add_argument("--root", metavar="DIR", help="uninstall from DIR instead of /")
    return parser


# ------------------------------------------------------------------------------------ run, env
def _cmd_env(fmt: str) -> int:
    try:
        env = client_env()
    except ShimNotFound as exc:
        print(f"gpupool: error: {exc}", file=sys.stderr)
        return 1
    value = env["LD_LIBRARY_PATH"]
    lib = value.split(":")[0]
    if fmt == "sh":
        print(f"export LD_LIBRARY_PATH={shlex.quote(value)}")
        return 0
    libs = [os.path.join(lib, n) for n in (SHIM_NAME, NVML_NAME)
            if os.path.exists(os.path.join(lib, n))]
    load = "; ".join(f"ctypes.CDLL({p!r}, mode=ctypes.RTLD_GLOBAL)" for p in libs)
    if fmt == "python":
        print("# gpupool: run this before anything imports torch or another CUDA library")
        print("import ctypes, os")
        print(f"os.environ[\"LD_LIBRARY_PATH\"] = {lib + ':'!r} + "
              "os.environ.get(\"LD_LIBRARY_PATH\", \"\")  # for the processes it starts")
        print(f"{load}  # for this process")
    else:
        print(f"%env LD_LIBRARY_PATH={value}")
        print(f"import ctypes; {load}")
    return 0


def _cmd_run(cmd: list[str], server: str | None) -> int:
    try:
        env = client_env()
    except ShimNotFound as exc:
        print(f"gpupool: error: {exc}", file=sys.stderr)
        return 1
    cmd = cmd[1:] if cmd[:1] == ["--"] else cmd
    if not cmd:
        print("gpupool: error: nothing to run (gpupool run -- CMD...)", file=sys.stderr)
        return 2
    if server:
        env["GPUPOOL_SERVER"] = server
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        print(f"gpupool: error: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - execvpe does not return


# -------------------------------------------------------------------------------------- config
def redact(token: str) -> str:
    """A token's public part: "gpt_<id>_..." (the id names it in logs), never the secret."""
    if not token:
        return "(none)"
    m = re.match(r"gpt_[0-9a-f]{12}_", token)
    return (m.group(0) if m else token[:4]) + "..."


def _row(key: str, value: str, source: str) -> str:
    return f"  {key:<24} {value:<34} {source}"


def show_config(cfg: ClientConfig) -> None:
    print(f"config file: {cfg.file + ' (' + cfg.file_reason + ')' if cfg.file else cfg.file_reason}")
    print()
    print(_row("SETTING", "VALUE", "FROM"))
    for key in ("connect_timeout", "probe_timeout"):
        print(_row(key, format_number(getattr(cfg, key)) + " s", cfg.sources.get(key, "default")))
    # The servers' default; each server's own value is shown with it below.
    print(_row("compression", cfg.compression, cfg.sources.get("compression", "default")))
    print(_row("requirements.gpu", cfg.gpu or "(any)", cfg.sources.get("gpu", "default")))
    print(_row("requirements.model", cfg.model or "(any)", cfg.sources.get("model", "default")))
    print(_row("requirements.min_memory", f"{cfg.min_memory} bytes" if cfg.min_memory else "(any)",
               cfg.sources.get("min_memory", "default")))
    print(_row("requirements.gpus", str(cfg.gpus), cfg.sources.get("gpus", "default")))
    print(_row("requirements.spread",
               "yes (from several servers if need be)" if cfg.spread else "no",
               cfg.sources.get("spread", "default")))
    print(_row("requirements.spread_copy", cfg.spread_copy,
               cfg.sources.get("spread_copy", "default")))
    print(_row("requirements.memory", f"{cfg.memory} bytes" if cfg.memory else "(a whole GPU)",
               cfg.sources.get("memory", "default")))
    print(_row("keep_gpu", "yes (never detached while idle)" if cfg.keep_gpu else "no",
               cfg.sources.get("keep_gpu", "default")))
    print()
    if not cfg.servers:
        print("servers: none. `gpupool login HOST:PORT` adds one (or set GPUPOOL_SERVER)")
        return
    print(f"servers, in order of preference (from {cfg.sources.get('servers') or cfg.file}):")
    for n, srv in enumerate(cfg.servers, 1):
        print(f"  {n}. {srv.written}")
        print(_row("  address", f"{srv.host}:{srv.port}", srv.sources.get("address", "?")))
        print(_row("  token", redact(srv.token), srv.sources.get("token", "default (none)")))
        print(_row("  tls", "yes" if srv.tls else "no (plain TCP, unencrypted)",
                   srv.sources.get("tls", "default")))
        if srv.tls:  # how the server's identity is checked: the pin, a CA, or not at all
            print(_row("  tls_fingerprint", srv.tls_fingerprint or "(none)",
                       srv.sources.get("tls_fingerprint", "default")))
        for key in ("tls_ca", "tls_cert", "tls_key"):
            value = getattr(srv, key)
            if value or key in srv.sources:
                print(_row(f"  {key}", value or '""', srv.sources.get(key, "default")))
        print(_row("  compression", srv.compression, srv.sources.get("compression", "default")))


def _cmd_config(env: Mapping[str, str]) -> int:
    try:
        cfg = load(env)
    except ConfigError as exc:
        print(f"gpupool: error: {exc}", file=sys.stderr)
        return 1
    show_config(cfg)
    return 0


# ---------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except BrokenPipeError:  # `gpupool status | head`: the reader is gone, nothing to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    env = os.environ
    if args.command == "run":
        return _cmd_run(args.cmd, args.server)
    if args.command == "env":
        return _cmd_env(args.format)
    if args.command == "config":
        return _cmd_config(env)
    if args.command == "login":
        from gpupool.login import LoginArgs, cmd_login
        return cmd_login(LoginArgs(url=args.url, token=args.token, token_file=args.token_file,
                                   fingerprint=args.fingerprint, tls_ca=args.tls_ca,
                                   plain=args.plain, system=args.system), env)
    if args.command == "logout":
        from gpupool.login import cmd_logout
        return cmd_logout(args.url, args.system, env)
    if args.command in ("status", "smi"):
        from gpupool.status import cmd_smi, cmd_status
        return (cmd_status if args.command == "status" else cmd_smi)(args.json, env)
    if args.command == "doctor":
        from gpupool.doctor import cmd_doctor
        return cmd_doctor(env)
    if args.command == "install":
        from gpupool.install import cmd_install
        return cmd_install(args.root, args.force, env)
    if args.command == "uninstall":
        from gpupool.install import cmd_uninstall
        return cmd_uninstall(args.root, env)
    raise AssertionError(args.command)  # pragma: no cover - argparse allows no other
