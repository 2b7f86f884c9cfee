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
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "client"), str(REPO / "protocol" / "python")]

# name, section, what, the parser's builder, SEE ALSO
PAGES = (
    ("gpupoold", 8, "the gpupool GPU pooling daemon", "gpupoold.cli:build_parser",
     "gpupool(1), gpupool-reset-helper(8), systemctl(1), journalctl(1)"),
    ("gpupool-reset-helper", 8, "privileged GPU reset helper for gpupoold",
     "gpupoold.gpu.reset_helper:build_parser", "gpupoold(8), nvidia-smi(1)"),
    ("gpupool", 1, "run CUDA programs on the GPUs of gpupool servers", "gpupool.cli:build_parser",
     "gpupoold(8), nvidia-smi(1)"),
)


def escape(text: str) -> str:
    """Text for roff: backslashes and hyphens escaped, no line starting with a control
    character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line[:1] in (".", "'") else line for line in text.split("\n"))


def parser_of(spec: str) -> argparse.ArgumentParser:
    module, _, func = spec.partition(":")
    mod = __import__(module, fromlist=[func])
    parser = getattr(mod, func)()
    assert isinstance(parser, argparse.ArgumentParser), spec
    return parser


def options(parser: argparse.ArgumentParser) -> Iterator[str]:
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
        yield escape((action.help or "").replace("%(default)s", str(action.default)) or "-")


def usage(parser: argparse.ArgumentParser) -> list[str]:
    """The usage lines as argparse wraps them, not filled again by roff."""
    text = parser.format_usage().replace("usage: ", "").strip()
    return [".nf", escape("\n".join(line.strip() for line in text.split("\n"))), ".fi"]


def subcommands(parser: argparse.ArgumentParser, prefix: str) -> Iterator[str]:
    for action in parser._actions:  # noqa: SLF001
        if not isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            continue
        helps = {a.dest: a.help for a in action._choices_actions}  # noqa: SLF001
        for name, sub in action.choices.items():
            words = f"{prefix} {name}"
            yield ".SS " + escape(words)
            yield from usage(sub)
            yield ".PP"
            yield escape(sub.description or helps.get(name) or "")
            listed = list(options(sub))
            if len(listed) > 3:  # more than --help
                yield from listed
            yield from subcommands(sub, words)


def page(name: str, section: int, what: str, spec: str, see_also: str, version: str,
         date: str) -> str:
    parser = parser_of(spec)
    lines = [f'.TH {name.upper()} {section} "{date}" "gpupool {version}" "gpupool"',
             ".SH NAME", f"{escape(name)} \\- {escape(what)}",
             ".SH SYNOPSIS", *usage(parser),
             ".SH DESCRIPTION", escape(parser.description or what)]
    if parser.epilog:
        lines += [".PP", escape(parser.epilog)]
    lines += [".SH OPTIONS", *options(parser)]
    commands = list(subcommands(parser, name))
    if commands:
        lines += [".SH COMMANDS", *commands]
    lines += [".SH SEE ALSO", escape(see_also),
              ".PP", "The documentation in /usr/share/doc/gpupoold and /usr/share/doc/"
              "gpupool\\-client (or docs/ of the sources)."]
    return "\n".join(lines) + "\n"


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
    for name, section, what, spec, see_also in PAGES:
        path = out / f"{name}.{section}"
        path.write_text(page(name, section, what, spec, see_also, __version__,
                             when.strftime("%Y-%m-%d")))
        print(f"man_pages: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
