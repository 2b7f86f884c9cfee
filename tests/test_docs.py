"""The documentation keeps up with the code: every setting, every gpupoold command and flag; and
it is well formed: links resolve, no heading is doubled."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

from gpupoold.cli import build_parser
from gpupoold.config.settings import markdown_table, settings_info

DOCS = REPO / "docs"


def all_docs() -> str:
    return "\n".join(p.read_text() for p in [REPO / "README.md", *sorted(DOCS.glob("*.md"))])


def test_configuration_md_has_the_generated_settings_table() -> None:
    text = (DOCS / "configuration.md").read_text()
    assert markdown_table() in text, (
        "docs/configuration.md is out of date: paste the output of "
        "`python -m gpupoold.config.settings` over its settings table")


@pytest.mark.parametrize("name", [info.name for info in settings_info()])
def test_every_setting_is_documented(name: str) -> None:
    assert f"| `{name}` |" in (DOCS / "configuration.md").read_text()


def commands() -> list[tuple[str, list[str]]]:
    """(command, its option strings) for `gpupoold` itself and every subcommand."""
    parser = build_parser()
    out = [("gpupoold", _flags(parser))]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((f"gpupoold {name}", _flags(sub)))
    return out


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings
            if s.startswith("--") and s != "--help"]


@pytest.mark.parametrize(("command", "flags"), commands(), ids=lambda v: str(v))
def test_every_command_and_flag_is_documented(command: str, flags: list[str]) -> None:
    text = all_docs()
    assert f"`{command}" in text, f"`{command}` is not in README.md or docs/"
    missing = [f for f in flags if not re.search(rf"{re.escape(f)}\b", text)]
    assert not missing, f"{command}: flags not documented: {missing}"


def test_readme_has_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


def test_relative_links_resolve() -> None:
    broken = []
    for page in [REPO / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def markdown_files() -> list[Path]:
    """Every markdown file of the project (tracked or new, not ignored: no venv or build output)."""
    if shutil.which("git") and (REPO / ".git").exists():
        names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                                "-z", "*.md"], cwd=REPO, capture_output=True, check=True,
                               ).stdout.decode().split("\0")
        return sorted(REPO / n for n in names if n and (REPO / n).is_file())
    skip = {"build", "build-asan", "build-debs", "dist", "node_modules"}
    return sorted(p for p in REPO.rglob("*.md")
                  if not any(part.startswith(".") or part in skip
                             for part in p.relative_to(REPO).parts))


def headings(text: str) -> list[tuple[int, str]]:
    """(line number, title) of each ATX heading, outside fenced code blocks (where `# ...` is a
    shell comment)."""
    out, fence = [], ""
    for number, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*(`{3,}|~{3,})", line)
        if m:
            if not fence:
                fence = m[1][0] * len(m[1])
            elif line.strip().startswith(fence):
                fence = ""
            continue
        h = re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if h and not fence:
            out.append((number, h[2]))
    return out


def doubled_headings(text: str) -> list[str]:
    """Headings pasted twice: `## A## A` on one line (or any heading marker inside a heading),
    or the same heading twice in a row with nothing between."""
    found = []
    previous: tuple[int, str] | None = None
    lines = text.splitlines()
    for number, title in headings(text):
        if re.search(r"#{2,6}\s", title):
            found.append(f"line {number}: {title!r}")
        if previous is not None and previous[1] == title and not any(
                line.strip() for line in lines[previous[0]:number - 1]):
            found.append(f"lines {previous[0]} and {number}: {title!r} twice")
        previous = (number, title)
    return found


def test_the_doubled_heading_check_sees_both_kinds() -> None:
    assert doubled_headings("# Guide\n\n## Prometheus and Grafana## Prometheus and Grafana\n")
    assert doubled_headings("## Tokens\n\n## Tokens\n\ntext\n")
    assert not doubled_headings("## Tokens\n\ntext\n\n## Tokens\n")  # two sections, one name
    assert not doubled_headings("```sh\n## not a heading## twice\n```\n# C# notes\n")


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_heading_is_doubled(page: Path) -> None:
    assert not doubled_headings(page.read_text()), doubled_headings(page.read_text())


def test_the_protocol_version_the_docs_name_is_the_specs() -> None:
    """docs/architecture.md and docs/protocol.md name the version of protocol/gpupool.toml."""
    import tomllib

    spec = tomllib.loads((REPO / "protocol" / "gpupool.toml").read_text())
    version = f"{spec['protocol']['major']}.{spec['protocol']['minor']}"
    assert f"## Wire protocol (version {version})" in (DOCS / "architecture.md").read_text()
    assert f"The protocol is {version} " in (DOCS / "protocol.md").read_text()
