"""The man pages (scripts/man_pages.py): made from the commands' argparse definitions at package
build time, so they list every option and subcommand the commands have; groff reads them without
a warning."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

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
