"""The man pages (scripts/man_pages.py): made from the commands' argparse definitions at package
build time, so they list every option and subcommand the commands have; they have the sections a
man page has (FILES, ENVIRONMENT, EXIT STATUS...), name the installed documents rather than the
source tree, show no markdown, and groff and man read them without a warning."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO, require

from gpupoold.cli import build_parser as daemon_parser
from gpupoold.gpu.reset_helper import build_parser as helper_parser


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("man")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "man_pages.py"), str(out)],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "SOURCE_DATE_EPOCH": "1767225600"})
    assert proc.returncode == 0, proc.stderr
    return out


def rendered(page: Path) -> str:
    require(shutil.which("groff"), "groff is needed to render the man pages")
    proc = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-rLL=200n", str(page)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    return re.sub(r".\x08", "", proc.stdout).replace("\u2010", "-").replace("\u2212", "-")


def test_pages_list_every_option_and_command(pages: Path) -> None:
    assert sorted(p.name for p in pages.iterdir()) == ["gpupool-reset-helper.8", "gpupool.1",
                                                       "gpupoold.8"]
    text = rendered(pages / "gpupoold.8")
    assert text.startswith("GPUPOOLD(8)") and "2026-01-01" in text  # SOURCE_DATE_EPOCH
    serve = daemon_parser()._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
    for action in serve._actions:  # noqa: SLF001
        for flag in action.option_strings:
            assert flag in text, flag
    for command in ("gpupoold serve", "gpupoold token create", "gpupoold gpu drain",
                    "gpupoold lease end"):
        assert command in text, command
    helper = rendered(pages / "gpupool-reset-helper.8")
    for action in helper_parser()._actions:  # noqa: SLF001
        for flag in action.option_strings:
            assert flag in helper, flag
    client = rendered(pages / "gpupool.1")
    for command in ("run", "env", "login", "logout", "config", "status", "smi", "doctor",
                    "install", "uninstall"):
        assert f"gpupool {command}" in client, command
    assert "--tls-ca FILE" in client


def test_a_reproducible_build_makes_the_same_pages(pages: Path, tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "scripts" / "man_pages.py"), str(tmp_path)],
                   capture_output=True, check=True, timeout=120,
                   env={"PATH": "/usr/bin:/bin", "SOURCE_DATE_EPOCH": "1767225600"})
    for page in pages.iterdir():
        assert (tmp_path / page.name).read_bytes() == page.read_bytes(), page.name


SECTIONS = ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "FILES", "ENVIRONMENT", "EXIT STATUS",
            "SEE ALSO")


@pytest.mark.parametrize("name", ["gpupoold.8", "gpupool-reset-helper.8", "gpupool.1"])
def test_each_page_has_the_sections_of_a_man_page(pages: Path, name: str) -> None:
    text = rendered(pages / name)
    headings = [line for line in text.splitlines() if re.fullmatch(r"[A-Z][A-Z ]+", line)]
    assert [h for h in headings if h in SECTIONS] == list(SECTIONS), headings
    assert re.search(r"^EXIT STATUS\n\s+0\s", text, re.M), "EXIT STATUS lists the statuses"
    files = text.split("\nFILES\n")[1].split("\nENVIRONMENT\n")[0]
    assert re.search(r"^\s+/\S+", files, re.M), files


@pytest.mark.parametrize("name", ["gpupoold.8", "gpupool-reset-helper.8", "gpupool.1"])
def test_man_renders_each_page_without_a_warning(pages: Path, name: str) -> None:
    require(shutil.which("man"), "man is needed (Debian package man-db)")
    proc = subprocess.run(["man", "--warnings", "-E", "UTF-8", "-l", str(pages / name)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MANWIDTH": "100", "MAN_KEEP_FORMATTING": ""})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    # ...and it would say so (the check is not blind)
    bad = pages.parent / f"bad-{name}"
    bad.write_text((pages / name).read_text() + ".BOGUS macro\n")
    proc = subprocess.run(["man", "--warnings", "-E", "UTF-8", "-l", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert "BOGUS" in proc.stderr


@pytest.mark.parametrize("name", ["gpupoold.8", "gpupool-reset-helper.8", "gpupool.1"])
def test_pages_show_no_markdown_and_no_source_paths(pages: Path, name: str) -> None:
    text = rendered(pages / name)
    assert "`" not in text, [line for line in text.splitlines() if "`" in line]
    source = re.compile(r"(?<![\w/.-])(?:docs|tests|scripts|client|protocol|packaging|systemd|"
                        r"build)/|repository|checkout")
    assert not [line for line in text.splitlines() if source.search(line)]
    # the documents named are the installed ones
    named = set(re.findall(r"/usr/share/doc/([\w-]+)", text))
    assert named and named <= {"gpupoold", "gpupool-client"}, named


def _man_pages_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("man_pages", REPO / "scripts" / "man_pages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["man_pages"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _parser_with_a_source_path() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x", description="see tests/test_x.py")
    p.add_argument("--y", help="as `docs/api.md` says")
    return p


def test_a_help_text_naming_the_source_tree_stops_the_build() -> None:
    mp = _man_pages_module()
    assert mp.installed("see docs/api.md", mp.DAEMON_DOC) == "see /usr/share/doc/gpupoold/api.md"
    assert mp.installed("docs/user-guide.md", mp.CLIENT_DOC) == \
        "/usr/share/doc/gpupool-client/user-guide.md"
    assert mp.text("`a-b` c", mp.DAEMON_DOC) == "\\fBa\\-b\\fR c"
    spec = mp.Page("x", 1, "a test", f"{__name__}:_parser_with_a_source_path", mp.DAEMON_DOC,
                   files=(), environment=(), exit_status=(), see_also="")
    with pytest.raises(SystemExit, match="tests/test_x.py"):
        mp.render(spec, "0", "2026-01-01")
