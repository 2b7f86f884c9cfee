"""Pieces the benchmark scripts share: stopping a daemon they started, removing its state, the
CPU's name, a plain-text table, and printing/saving the Markdown section of a run.

bench/ is not a package: each script puts its own folder first on sys.path and imports this.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stop_process_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM to a daemon started with start_new_session=True, then SIGKILL to its whole group
    (its workers included) once it has exited or after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove_state(state: Path) -> None:
    """A benchmark daemon's state folder and the memory of its simulated GPUs (kept apart, under
    gpupoold.gpu.sim.sim_memory_dir); missing pieces are fine."""
    try:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        from gpupoold.gpu.sim import sim_memory_dir

        shutil.rmtree(sim_memory_dir(state), ignore_errors=True)
    except ImportError:  # a tree without the daemon package: nothing simulated to remove
        pass
    shutil.rmtree(state, ignore_errors=True)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    import platform

    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def text_table(head: Sequence[str], body: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, a dashed rule under the head."""
    widths = [max(len(str(row[i])) for row in [head, *body]) for i in range(len(head))]

    def line(cols: Sequence[object]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cols, widths)).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def emit_markdown(lines: list[str], path: Path | None) -> None:
    """Print a run's Markdown section (ready for docs/benchmarks.md) and write it to `path`."""
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    if path:
        path.write_text(text)
