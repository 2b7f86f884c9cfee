#!/usr/bin/env python3
"""Man pages for gpupoold(8), gpupool-reset-helper(8) and gpupool(1), made from the commands'
argparse definitions at package build time (scripts/build-debs.sh), so a page never says
anything the command does not do: nothing of them is committed.

    scripts/man_pages.py OUT_DIR     writes OUT_DIR/gpupoold.8, gpupool-reset-helper.8, gpupool.1
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "client"), str(REPO / "protocol" / "python")]

# Where the packages install what a page refers to (scripts/build-debs.sh), so that a page names
# no file of the source tree: the daemon's documents (all of docs/ that its guides link to) and
# the client's own.
DAEMON_DOC = "/usr/share/doc/gpupoold"
CLIENT_DOC = "/usr/share/doc/gpupool-client"
CLIENT_DOCS = ("user-guide.md", "client-configuration.md")
# Texts of the commands' help that describe a checkout, and what they mean in the package.
REWRITES = (
    (r"\(`gpupoold/bin/`\), else the repository's `build/` \(development\)",
     "(/usr/lib/gpupoold/python/gpupoold/bin/)"),
)
# What a page must not contain once written: a path of the source tree.
SOURCE_PATH = re.compile(r"(?<![\w/.-])(?:docs|tests|scripts|client|protocol|worker|common|bench|"
                         r"packaging|systemd|build)/|\brepository\b|\bcheckout\b")


@dataclass(frozen=True)
class Page:
    name: str
    section: int
    what: str
    parser: str  # module:function that builds the command's argparse parser
    doc: str  # where the package that ships the command keeps its documents
    files: tuple[tuple[str, str], ...]
    environment: tuple[tuple[str, str], ...]
    exit_status: tuple[tuple[str, str], ...]
    see_also: str


PAGES = (
    Page("gpupoold", 8, "the gpupool GPU pooling daemon", "gpupoold.cli:build_parser", DAEMON_DOC,
         files=(
             ("/etc/gpupoold/gpupoold.toml",
              "The configuration (`serve`, and the admin commands, which find the daemon's "
              "state directory and HTTP address in it); every setting is listed in "
              f"{DAEMON_DOC}/configuration.md."),
             ("/var/lib/gpupoold/",
              "The state directory (setting `state_dir`): `gpupoold.db` (tokens, lease "
              "history, audit log), `local-admin.token` (the admin token the admin commands "
              "use, rewritten at every start), `identity/` (the remoting port's key and "
              "certificate), `workers/`, `cache/`, `sim/`. Readable by the daemon's user "
              "(`gpupoold`) and root only."),
             ("/run/gpupoold/reset.sock",
              "The socket of gpupool-reset-helper(8) (setting `reset_socket`)."),
             ("/usr/lib/systemd/system/gpupoold.service",
              "The unit: `gpupoold serve --config /etc/gpupoold/gpupoold.toml` as the user "
              "`gpupoold`; change it with `systemctl edit gpupoold`."),
             (DAEMON_DOC + "/",
              "README.md (the quick start), operator-guide.md, configuration.md, security.md, "
              "api.md, metrics.md and the other guides."),
         ),
         environment=(
             ("GPUPOOL_ADMIN_TOKEN",
              "The admin token of `status`, `gpu` and `lease` when `--token` is not given "
              "(else the state directory's `local-admin.token`)."),
             ("PGPASSWORD, PGPASSFILE",
              "The PostgreSQL password when `database` is set and `database_password_file` "
              "is not (libpq's own variables)."),
             ("NOTIFY_SOCKET, WATCHDOG_USEC, LISTEN_FDS, LISTEN_PID, JOURNAL_STREAM",
              "Set by systemd: readiness and watchdog notifications, socket activation, "
              "logging to the journal."),
         ),
         exit_status=(
             ("0", "Done; `serve`: stopped by SIGTERM or SIGINT."),
             ("1", "Failed: the message says why and what to do (another try may work)."),
             ("2", "A mistake on the command line."),
             ("78", "`serve`: the configuration cannot work (EX_CONFIG); the unit does not "
                    "restart it (`RestartPreventExitStatus=78`)."),
         ),
         see_also="gpupool(1), gpupool-reset-helper(8), systemctl(1), journalctl(1)"),
    Page("gpupool-reset-helper", 8, "privileged GPU reset helper for gpupoold",
         "gpupoold.gpu.reset_helper:build_parser", DAEMON_DOC,
         files=(
             ("/run/gpupoold/reset.sock",
              "Where gpupoold asks for a reset (mode 0660, group `gpupoold`); under systemd "
              "the socket of gpupool-reset-helper.socket."),
             ("/usr/lib/systemd/system/gpupool-reset-helper.socket",
              "Starts the helper, as root, at gpupoold's first request."),
         ),
         environment=(
             ("LISTEN_FDS, LISTEN_PID",
              "Set by systemd: the listening socket to take instead of binding `--socket`."),
             ("PATH", "Where `nvidia-smi` is looked for, without `--nvidia-smi`."),
         ),
         exit_status=(
             ("0", "Stopped by SIGTERM or SIGINT."),
             ("2", "It cannot start (no `nvidia-smi`, the socket cannot be bound), or a mistake "
                   "on the command line."),
         ),
         see_also="gpupoold(8), nvidia-smi(1)"),
    Page("gpupool", 1, "run CUDA programs on the GPUs of gpupool servers",
         "gpupool.cli:build_parser", CLIENT_DOC,
         files=(
             ("~/.config/gpupool/config.toml",
              "The user's configuration: servers, tokens, pinned identities "
              "(`gpupool login` writes it, mode 0600); `$XDG_CONFIG_HOME/gpupool/config.toml` "
              "when that is set."),
             ("/etc/gpupool/config.toml",
              "The configuration of every user without one of their own (`--system`)."),
             ("/usr/lib/gpupool-client/python/gpupool/lib/",
              "The shims `libcuda.so.1` and `libnvidia-ml.so.1` that `gpupool run` puts "
              "first."),
             ("/usr/local/lib/gpupool/", "Where `gpupool install --system` copies the shims."),
             (CLIENT_DOC + "/",
              "README.md, user-guide.md (every key and variable), client-configuration.md."),
         ),
         environment=(
             ("GPUPOOL_CONFIG",
              "The configuration file to read instead (`none`: none at all)."),
             ("GPUPOOL_SERVER, GPUPOOL_TOKEN",
              "The servers (comma-separated HOST:PORT) and the token, over the file's."),
             ("GPUPOOL_TLS, GPUPOOL_TLS_CA, GPUPOOL_TLS_CERT, GPUPOOL_TLS_KEY, "
              "GPUPOOL_TLS_FINGERPRINT",
              "TLS: on or off, the CA, a client certificate, the pinned identity."),
             ("GPUPOOL_GPU, GPUPOOL_GPU_MODEL, GPUPOOL_MIN_MEMORY, GPUPOOL_KEEP_GPU",
              "Which GPU a program asks for, and whether its lease may be detached."),
             ("GPUPOOL_COMPRESSION, GPUPOOL_CONNECT_TIMEOUT, GPUPOOL_PROBE_TIMEOUT",
              "Compressed copies, and how long to wait for a server."),
         ),
         exit_status=(
             ("0", "Done."),
             ("1", "Failed: the message says why and what to do."),
             ("2", "A mistake on the command line."),
             ("other", "`gpupool run`: the program's own exit status."),
         ),
         see_also="gpupoold(8), nvidia-smi(1)"),
)


def escape(text: str) -> str:
    """Text for roff: backslashes and hyphens escaped, no line starting with a control
    character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line[:1] in (".", "'") else line for line in text.split("\n"))


def installed(text: str, doc: str) -> str:
    """The help's references to the source tree as the package installs them: docs/NAME.md is
    a document in `doc` (the client's own guides) or in gpupoold's."""
    for pattern, replacement in REWRITES:
        text = re.sub(pattern, replacement, text)

    def document(m: re.Match[str]) -> str:
        name = m[1]
        return f"{CLIENT_DOC if doc == CLIENT_DOC and name in CLIENT_DOCS else DAEMON_DOC}/{name}"

    return re.sub(r"\bdocs/([\w.-]+\.md)", document, text)


def text(raw: str, doc: str) -> str:
    """Help text as roff: the package's paths, roff escapes, and `code` in bold (markdown's
    backticks mean nothing to man)."""
    return re.sub(r"`([^`\n]+)`", r"\\fB\1\\fR", escape(installed(raw, doc)))


def parser_of(spec: str) -> argparse.ArgumentParser:
    module, _, func = spec.partition(":")
    mod = __import__(module, fromlist=[func])
    parser = getattr(mod, func)()
    assert isinstance(parser, argparse.ArgumentParser), spec
    return parser


def options(parser: argparse.ArgumentParser, doc: str) -> Iterator[str]:
    """.TP entries for the parser's options and positionals."""
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its actions
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:  # noqa: SLF001
            continue
        if action.option_strings:
            metavar = ""
            if action.nargs != 0:
                metavar = " " + (action.metavar or action.dest.upper())
            head = ", ".join(f"\\fB{escape(o)}\\fR" for o in action.option_strings) + \
                (f"\\fI{escape(metavar)}\\fR" if metavar else "")
        else:
            head = f"\\fI{escape(str(action.metavar or action.dest))}\\fR"
        yield ".TP"
        yield head
        yield text((action.help or "").replace("%(default)s", str(action.default)) or "-", doc)


def usage(parser: argparse.ArgumentParser) -> list[str]:
    """The usage lines as argparse wraps them, not filled again by roff."""
    lines = parser.format_usage().replace("usage: ", "").strip()
    return [".nf", escape("\n".join(line.strip() for line in lines.split("\n"))), ".fi"]


def subcommands(parser: argparse.ArgumentParser, prefix: str, doc: str) -> Iterator[str]:
    for action in parser._actions:  # noqa: SLF001
        if not isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            continue
        helps = {a.dest: a.help for a in action._choices_actions}  # noqa: SLF001
        for name, sub in action.choices.items():
            words = f"{prefix} {name}"
            yield ".SS " + escape(words)
            yield from usage(sub)
            yield ".PP"
            yield text(sub.description or helps.get(name) or "", doc)
            listed = list(options(sub, doc))
            if len(listed) > 3:  # more than --help
                yield from listed
            yield from subcommands(sub, words, doc)


def entries(pairs: tuple[tuple[str, str], ...], doc: str, bold: bool = True) -> list[str]:
    """.TP entries of a FILES, ENVIRONMENT or EXIT STATUS section."""
    out = []
    for head, body in pairs:
        out += [".TP", f"\\fB{escape(head)}\\fR" if bold else escape(head), text(body, doc)]
    return out


def render(spec: Page, version: str, date: str) -> str:
    parser = parser_of(spec.parser)
    doc = spec.doc
    lines = [f'.TH {spec.name.upper()} {spec.section} "{date}" "gpupool {version}" "gpupool"',
             ".SH NAME", f"{escape(spec.name)} \\- {escape(spec.what)}",
             ".SH SYNOPSIS", *usage(parser),
             ".SH DESCRIPTION", text(parser.description or spec.what, doc)]
    if parser.epilog:
        lines += [".PP", text(parser.epilog, doc)]
    lines += [".SH OPTIONS", *options(parser, doc)]
    commands = list(subcommands(parser, spec.name, doc))
    if commands:
        lines += [".SH COMMANDS", *commands]
    lines += [".SH FILES", *entries(spec.files, doc),
              ".SH ENVIRONMENT", *entries(spec.environment, doc),
              ".SH \"EXIT STATUS\"", *entries(spec.exit_status, doc),
              ".SH \"SEE ALSO\"", escape(spec.see_also),
              ".PP", f"The documentation in {escape(spec.doc)}."]
    page = "\n".join(lines) + "\n"
    # A man page of the installed command names no file of the source tree and shows no
    # markdown: a help text that does needs a REWRITES entry (or other words).
    leftovers = [line for line in page.splitlines()
                 if SOURCE_PATH.search(line.replace("\\-", "-")) or "`" in line]
    if leftovers:
        raise SystemExit(f"man_pages: {spec.name}.{spec.section} would show source paths or "
                         "markdown; reword the help or add a REWRITES entry in "
                         f"scripts/man_pages.py:\n  " + "\n  ".join(leftovers))
    return page


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    from gpupoold import __version__
    # SOURCE_DATE_EPOCH (reproducible builds): two builds of one commit make the same pages.
    stamp = int(os.environ.get("SOURCE_DATE_EPOCH", "0")) or None
    when = datetime.datetime.fromtimestamp(stamp, datetime.UTC) if stamp else \
        datetime.datetime.now(datetime.UTC)
    for spec in PAGES:
        path = out / f"{spec.name}.{spec.section}"
        path.write_text(render(spec, __version__, when.strftime("%Y-%m-%d")))
        print(f"man_pages: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
