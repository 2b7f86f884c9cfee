"""docs/operator-guide.md's "Try it on one machine" works: every ```sh test block of the guide,
in order, in one bash process, with the installed `gpupoold` and `gpupool` commands."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from conftest import BUILD_DIR, REPO, require

GUIDE = REPO / "docs" / "operator-guide.md"
BLOCK_RE = re.compile(r"^```sh test[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
VENV_BIN = Path(sys.executable).parent
TIMEOUT_S = 60


def guide_blocks() -> list[str]:
    return BLOCK_RE.findall(GUIDE.read_text())


def test_the_guide_has_the_walk_through() -> None:
    blocks = guide_blocks()
    assert len(blocks) >= 4, f"{GUIDE}: expected the ```sh test blocks of the walk-through"
    script = "\n".join(blocks)
    for needed in ("gpupoold serve --simulated 2", "gpupoold token create", "gpupoold status",
                   "/healthz", "gpupool login", "gpupool status", "kill "):
        assert needed in script, f"the walk-through does not run `{needed}`"
    # Only commands a user has: no repository paths, no python -m, no test-only flags.
    for forbidden in ("python -m", "build/", "--worker", "--sim-lib", "PYTHONPATH"):
        assert forbidden not in script, f"the walk-through uses `{forbidden}`"


def test_following_the_operator_guide_works(tmp_path: Path) -> None:
    for command in ("gpupoold", "gpupool"):
        require((VENV_BIN / command).is_file(),
                f"{VENV_BIN / command} missing: install the packages (scripts/bootstrap.sh)")
    require(shutil.which("curl") is not None, "curl is not installed")
    # The development install finds the worker and the simulated device in build/.
    for name in ("gpupool-worker", "gpupool-scrub", "libgpupool-sim.so"):
        require((BUILD_DIR / name).is_file(), f"{BUILD_DIR / name} missing: run make")
    if BUILD_DIR != (REPO / "build").resolve():
        require(False, "the guide's daemon finds the native parts in build/ only "
                "(GPUPOOL_BUILD_DIR is ignored here)")

    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env.update(HOME=str(home), TMPDIR=str(tmp_path), XDG_CONFIG_HOME=str(home / ".config"),
               PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}")
    script = "set -euo pipefail\n" + "\n".join(guide_blocks())
    proc = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the walk-through did not finish in {TIMEOUT_S} s:\n{out}") from None
    finally:
        # Whatever happened, nothing the guide started may outlive the test.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"the walk-through failed (exit {proc.returncode}):\n{out}"
    assert re.search(r"remoting port: 127\.0\.0\.1:\d+, HTTP: 127\.0\.0\.1:\d+", out), out
    assert "alice" in out and "user" in out, out  # token list
    assert re.search(r"^1\s+NVIDIA .*simulated.*\s+free\b", out, re.M), out  # gpupoold status
    assert '"ok": true' in out and '"gpus": 2' in out, out  # /healthz
    assert "logged in to 127.0.0.1:" in out and "2 GPUs (2 free)" in out, out  # gpupool login
    assert "you are alice (user)" in out, out  # gpupool status
    # The client's settings went to the guide's scratch file, not the (temporary) home.
    assert not (home / ".config" / "gpupool" / "config.toml").exists()
    # The guide cleans up after itself: the scratch folder is gone.
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp.")], out
