"""client/shim/gp_cuda_launch.h against the toolkit's cuda.h: every constant of its driver API
part (the enumerators before "part 2") and the size of its types, by one probe compiled twice,
as tests/test_cuda_header.py does for cudaapi/gp_cuda.h.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEADER = REPO / "client" / "shim" / "gp_cuda_launch.h"
CUDA_INCLUDE = Path(os.environ.get("GPUPOOL_CUDA_INCLUDE", "/usr/local/cuda/include"))
CC = os.environ.get("CC", "cc")
TYPES = ["CUfunctionLoadingState", "CUjitInputType", "CUfunc_cache"]


def names() -> list[str]:
    text = HEADER.read_text()
    part1 = text.split("part 2:", 1)[0]
    found = re.findall(r"^\s+(CU_[A-Z0-9_]+)\s*=", part1, re.M)
    assert len(found) > 20, "no enumerators found: did the header's layout change?"
    return found


def probe(tmp: Path, include: str, extra_flags: list[str]) -> str:
    lines = [include, "#include <stdio.h>", "int main(void) {"]
    for n in names():
        lines.append(f'    printf("%s %lld\\n", "{n}", (long long){n});')
    for t in TYPES:
        lines.append(f'    printf("sizeof %s %zu\\n", "{t}", sizeof({t}));')
    lines += ["    return 0;", "}"]
    src = tmp / f"probe_{abs(hash(include))}.c"
    src.write_text("\n".join(lines) + "\n")
    exe = src.with_suffix("")
    proc = subprocess.run([CC, "-std=c11", "-D_GNU_SOURCE", *extra_flags, "-o", str(exe), str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout


def test_constants_match_cuda_h(tmp_path: Path) -> None:
    if not (CUDA_INCLUDE / "cuda.h").is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CUDA toolkit header not found in {CUDA_INCLUDE}; CI must have it")
        pytest.skip(f"CUDA toolkit header not found in {CUDA_INCLUDE}")
    ours = probe(tmp_path, '#include "gp_cuda_launch.h"',
                 [f"-I{REPO / 'client' / 'shim'}", f"-I{REPO / 'cudaapi'}",
                  f"-I{REPO / 'protocol' / 'generated'}"])
    theirs = probe(tmp_path, "#include <cuda.h>", [f"-I{CUDA_INCLUDE}"])
    assert ours == theirs
