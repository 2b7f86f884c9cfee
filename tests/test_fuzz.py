"""The fuzz targets (tests/fuzz/README.md) as a regression pass: each target runs a fixed number
of executions from a fixed seed (reproducible) on its seed inputs and its regression inputs, and
every regression input (a crash the fuzzer once found, kept after the fix) is replayed on its
own. A crash, a leak, a sanitizer report or a timeout fails the test with the fuzzer's output.

Long runs are `make fuzz` (scripts/fuzz.sh), not tests. Needs clang with libFuzzer (Debian's
clang and libclang-rt-14-dev; scripts/bootstrap.sh installs them).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, require

sys.path.insert(0, str(REPO / "tests" / "fuzz"))
import seeds  # noqa: E402

FUZZ = REPO / "build-fuzz"
REGRESSIONS = REPO / "tests" / "fuzz" / "regressions"
RUNS = 10_000  # per target and test run: the CI floor the issue sets
TARGETS = list(seeds.TARGETS)


@pytest.fixture(scope="session")
def fuzz_build() -> Path:
    require(shutil.which("clang"), "clang not found (Debian packages clang, libclang-rt-14-dev; "
                                   "scripts/bootstrap.sh installs them)")
    proc = subprocess.run(["make", "-s", "-j2", "fuzz-build"], cwd=REPO, capture_output=True,
                          text=True, timeout=1200)
    if proc.returncode != 0 and "fuzzer" in proc.stderr and "cannot find" in proc.stderr:
        require(False, "clang cannot link libFuzzer: install libclang-rt-14-dev")
    assert proc.returncode == 0, f"make fuzz-build failed:\n{proc.stdout}\n{proc.stderr}"
    return FUZZ


@pytest.fixture(scope="session")
def seed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fuzz-seeds")
    counts = seeds.write(out)
    assert all(n > 0 for n in counts.values()), counts
    return out


def fuzzer_output(proc: subprocess.CompletedProcess[str]) -> str:
    return "\n".join(line for line in (proc.stdout + proc.stderr).splitlines()
                     if not line.startswith("#"))[-8000:]


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_target_runs_clean(fuzz_build: Path, seed_dir: Path, tmp_path: Path,
                                target: str) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    regressions = REGRESSIONS / target
    regressions.mkdir(parents=True, exist_ok=True)
    cmd = [str(fuzz_build / target), f"-runs={RUNS}", "-seed=1", "-max_len=65536",
           "-timeout=30", "-print_final_stats=1", f"-artifact_prefix={tmp_path}/",
           str(corpus), str(seed_dir / target), str(regressions)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          errors="replace", timeout=900)
    assert proc.returncode == 0, f"{target} found a problem:\n{fuzzer_output(proc)}"
    m = re.search(r"^stat::number_of_executed_units: (\d+)$", proc.stderr, re.M)
    assert m and int(m[1]) >= RUNS, fuzzer_output(proc)
    print(f"{target}: {m[1]} executions")


def test_every_regression_input_replays_clean(fuzz_build: Path, tmp_path: Path) -> None:
    """Inputs that once crashed a target (and the hand-written ones, such as the 2^63-byte copy
    that once took a GPU out of service): each on its own, as `build-fuzz/<target> FILE` replays a crash."""
    replayed = 0
    for target in TARGETS:
        files = sorted(p for p in (REGRESSIONS / target).glob("*") if p.is_file())
        if not files:
            continue
        # A crash's input goes to tmp_path, not into the working directory (the checkout).
        proc = subprocess.run([str(fuzz_build / target), f"-artifact_prefix={tmp_path}/",
                               *map(str, files)], capture_output=True,
                              text=True, errors="replace", timeout=600)
        assert proc.returncode == 0, f"{target} regression inputs:\n{fuzzer_output(proc)}"
        replayed += len(files)
    assert replayed >= 2
