"""Where the native parts are: the worker and scrub binaries and the simulated device library.

Order: the setting (`worker`, `sim_lib`), then the copies shipped inside the package
(`gpupoold/bin/`, put there by the build), then the repository's `build/` (development checkout).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_BIN = Path(__file__).resolve().parent / "bin"
REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_NAME = "gpupool-worker"
SCRUB_NAME = "gpupool-scrub"
CHECKPOINT_NAME = "gpupool-checkpoint"
SIM_LIB_NAME = "libgpupool-sim.so"


def candidates(name: str) -> list[Path]:
    """Where `name` is looked for when no setting names it."""
    found = [PACKAGE_BIN / name]
    if (REPO_ROOT / "Makefile").is_file():
        found.append(REPO_ROOT / "build" / name)
    return found


def find_native(name: str, configured: Path | None) -> Path | None:
    """The configured path if set (even if missing: the caller reports it), else the first
    candidate that exists, else None."""
    if configured is not None:
        return configured
    return next((p for p in candidates(name) if p.is_file()), None)
