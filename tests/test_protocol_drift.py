"""The generated protocol code must be exactly what the generator makes from the spec, and the C
side must reproduce the Python side's golden bytes."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, require, run_client

GENERATOR = REPO / "protocol" / "gen_protocol.py"


def test_generated_protocol_matches_the_spec(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(GENERATOR), "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    generated = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "the generator wrote nothing"
    stale = []
    for path in generated:
        rel = path.relative_to(tmp_path)
        checked_in = REPO / rel
        if not checked_in.is_file() or checked_in.read_bytes() != path.read_bytes():
            stale.append(str(rel))
    assert not stale, (f"generated files differ from protocol/gpupool.toml: {stale}; "
                       "run `make gen` and commit the result")


def test_generated_python_is_what_the_package_imports() -> None:
    import gpupool_protocol as gp

    assert Path(gp.__file__).resolve().parent == REPO / "protocol" / "python" / "gpupool_protocol"
    spec = (REPO / "protocol" / "gpupool.toml").read_bytes()
    assert gp.SPEC_SHA256 == hashlib.sha256(spec).hexdigest()


@pytest.mark.san
def test_c_golden(native_build: Path) -> None:
    binary = native_build / "tests" / "test_protocol"
    require(binary.is_file(), f"{binary} not built")
    proc = run_client([binary, REPO / "protocol" / "golden" / "samples.hex"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_client_wire_module_is_the_same_generated_code() -> None:
    """The `gpupool` client package carries its own copy (gpupool_protocol is not shipped with it):
    the same bytes, and it encodes an info request exactly as gpupool_protocol does."""
    import gpupool_protocol as gp
    from gpupool import _wire_generated as wire

    ours = REPO / "protocol" / "python" / "gpupool_protocol" / "_generated.py"
    theirs = REPO / "client" / "gpupool" / "_wire_generated.py"
    assert theirs.read_bytes() == ours.read_bytes(), "run `make gen`"
    assert Path(wire.__file__).read_bytes() == ours.read_bytes()  # what `gpupool` imports
    assert (wire.MAJOR, wire.MINOR) == (gp.MAJOR, gp.MINOR) == (1, 2)
    req = wire.Info(magic=wire.MAGIC, major=1, minor=1, token="t", gpu="0", min_memory=5, host="h")
    assert req.encode() == gp.Info(magic=gp.MAGIC, major=1, minor=1, token="t", gpu="0",
                                   min_memory=5, host="h").encode()
    reply = wire.InfoReply(result=0, major=1, minor=1, gpus=2, matching=1, json="{}")
    assert gp.InfoReply.decode(reply.encode()) == gp.InfoReply(
        result=0, major=1, minor=1, gpus=2, matching=1, json="{}")
