"""The NVML shim's C unit test (client/nvml/test_nvml_view.c): the mapping from an `info` reply
(the spec's info_gpu and info_lease records, encoded by the test itself with the generated C) to
NVML's answers, without a server. Marked `san`: scripts/test.sh also runs it built with
AddressSanitizer + UBSan (leak checks on: the program frees everything it decodes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_client


@pytest.mark.san
def test_unit(native_build: Path) -> None:
    path = native_build / "tests" / "test_nvml_view"
    assert path.is_file(), f"{path} not built (client/nvml/nvml_tests.mk)"
    proc = run_client([path], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "all checks passed" in proc.stdout, out
    for mark in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
        assert mark not in out, out
