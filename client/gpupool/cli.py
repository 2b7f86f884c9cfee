"""The `gpupool` command: `gpupool run -- CMD...` and `gpupool env` (more in issue 5)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

from gpupool import __version__
from gpupool.shim import ShimNotFound, client_env


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpupool", description="Run unmodified CUDA programs on a remote GPU (gpupoold).")
    parser.add_argument("--version", action="version", version=f"gpupool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="run a program with the gpupool libcuda.so.1",
                         description="Run CMD with gpupool's libcuda.so.1 first on "
                                     "LD_LIBRARY_PATH, so its CUDA calls go to GPUPOOL_SERVER.")
    run.add_argument("--server", metavar="HOST:PORT",
                     help="the gpupoold remoting address (sets GPUPOOL_SERVER)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    sub.add_parser("env", help="print the shell lines that make programs use gpupool",
                   description="Print `export LD_LIBRARY_PATH=...` for eval in a shell.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        env = client_env()
    except ShimNotFound as exc:
        print(f"gpupool: error: {exc}", file=sys.stderr)
        return 1
    if args.command == "env":
        print(f"export LD_LIBRARY_PATH={shlex.quote(env['LD_LIBRARY_PATH'])}")
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("gpupool: error: nothing to run (gpupool run -- CMD...)", file=sys.stderr)
        return 2
    if args.server:
        env["GPUPOOL_SERVER"] = args.server
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        print(f"gpupool: error: cannot run {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - execvpe does not return
