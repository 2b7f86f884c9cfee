"""The NVML shim's C unit tests (client/nvml/test_json.c, client/nvml/test_nvml_view.c): the
strict JSON parser, and the mapping from an `info` document to NVML's answers, both without a
server. Marked `san`: scripts/test.sh also runs them built with AddressSanitizer + UBSan (leak
checks on: these programs free everything they parse)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_client


@pytest.mark.san
@pytest.mark.parametrize("name", ["test_nvml_json", "test_nvml_view"])
def test_unit(native_build: Path, name: str) -> None:
    path = native_build / "tests" / name
    assert path.is_file(), f"{path} not built (client/nvml/nvml_tests.mk)"
    proc = run_client([path], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "all checks passed" in proc.stdout, out
    for mark in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
        assert mark not in out, out
