"""The C unit tests that need nothing but their own binary (tests/c/tests.mk): MD2 and SHA-256,
cuGetProcAddress against the measured facts, the export tables. Marked `san`: scripts/test.sh
also runs them built with AddressSanitizer + UBSan. And a guard: every test program the
makefiles build is run by some test of this suite (these four were built and never run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO, run_client

UNITS = ["test_md2", "test_sha256", "test_procaddr", "test_export_tables"]


@pytest.mark.san
@pytest.mark.parametrize("name", UNITS)
def test_unit(native_build: Path, name: str) -> None:
    path = native_build / "tests" / name
    assert path.is_file(), f"{path} not built (tests/c/tests.mk)"
    proc = run_client([path], timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"{name}: all checks passed" in proc.stdout, out
    for mark in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
        assert mark not in out, out


def test_every_test_program_the_makefiles_build_is_run() -> None:
    makefiles = [p for p in REPO.rglob("*.mk")
                 if not {"build", "build-asan", "build-fuzz", ".venv"} & set(p.parts)]
    # Every program has its rule: "$(BUILD)/tests/NAME: ...".
    built = {name for mk in makefiles
             for name in re.findall(r"^\$\(BUILD\)/tests/([\w-]+):", mk.read_text(), re.M)}
    assert {"test_md2", "test_protocol", "test_nvml_view"} <= built, built
    suite = "\n".join(p.read_text() for p in (REPO / "tests").glob("*.py"))
    never = sorted(n for n in built if not re.search(rf"\b{re.escape(n)}\b", suite))
    assert never == [], f"built by the makefiles but run by no test: {never}"
