"""The client configuration's C unit tests (tests/c/test_client_config.c on
client/common/client_config.c): the file lookup, the TOML subset with every refusal naming
FILE:LINE, the environment over the file, per-server tokens and TLS files, the short form,
paths and the warnings. Also run under ASan/UBSan (GPUPOOL_SAN=1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import require, run_client


@pytest.mark.san
def test_client_config_unit(native_build: Path, tmp_path: Path) -> None:
    binary = native_build / "tests" / "test_client_config"
    require(binary.is_file(), f"{binary} not built")
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "ASAN_OPTIONS": "detect_leaks=1"}
    proc = run_client([binary], env=env, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "test_client_config: all checks passed" in proc.stdout, out
    for mark in ("AddressSanitizer", "runtime error:", "LeakSanitizer"):
        assert mark not in out, out
