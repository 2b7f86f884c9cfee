"""The documentation keeps up with the code: every setting, every gpupoold command and flag."""

from __future__ import annotations

import argparse
import re

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
