"""End to end (issue 37, item 4; acceptance 'two processes on one server exchange a buffer
through CUDA IPC'): gpupoold on 2 simulated GPUs, one GPU per process. Process A fills a buffer
and writes its cuIpcGetMemHandle bytes to a file; process B of the same token opens the handle
on its own GPU's worker, reads the buffer bit-exact and writes another pattern, which A then reads
bit-exact (cuMemFree of the opened memory and a second close are CUDA_ERROR_INVALID_VALUE); a
process of another token gets CUDA_ERROR_INVALID_VALUE with the broker's words and no pointer
(tests/c/ipc_share.c). The memory goes worker to gpupoold to worker (docs/multi-gpu.md,
"CUDA IPC between the workers of one job")."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import GpupoolServer, wait_until

SIZE = 1 << 20 | 4093  # more than one page, not a multiple of the granularity


@pytest.mark.san
def test_two_processes_of_one_job_share_a_buffer(
        native_build: Path, start_daemon: Callable[..., GpupoolServer], tmp_path: Path) -> None:
    exe = native_build / "tests" / "ipc_share"
    assert exe.is_file(), f"{exe} not built"
    # Idle detach on, and due long before the exporter's next call: a session that shares
    # memory through CUDA IPC must keep its GPU (its memory is mapped by another process).
    conf = tmp_path / "gpupoold.toml"
    conf.write_text('idle_detach_after = 0.3\ndetach_policy = "always"\n')
    server = start_daemon("--simulated", "2", "--config", str(conf), build_dir=native_build,
                          simulated=None)
    wait_until("2 free GPUs", lambda: [g["state"] for g in server.get_json("/api/v1/gpus")["gpus"]]
               == ["free"] * 2)
    handle = tmp_path / "handle"
    env = server.client_env()
    exporter = subprocess.Popen([str(exe), "export", str(handle), str(SIZE)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        assert exporter.stdout is not None and exporter.stdin is not None
        first = exporter.stdout.readline()
        assert first.strip() == "READY", first + exporter.stdout.read() + (
            exporter.stderr.read() if exporter.stderr else "")
        assert handle.stat().st_size == 64
        # The exporter idles (it waits for "check"): it is asked to detach and says never.
        wait_until("the exporter's lease keeps its GPU for CUDA IPC", lambda: any(
            "CUDA IPC" in (lease["detach"]["keep_gpu"] or "")
            for lease in server.get_json("/api/v1/leases?state=active")["leases"]))

        imp = subprocess.run([str(exe), "import", str(handle), str(SIZE)], env=env,
                             capture_output=True, text=True, timeout=60)
        assert imp.returncode == 0 and "PASS ipc_share import" in imp.stdout, (
            imp.stdout + imp.stderr)

        other = server.create_token("ipc-stranger")
        stranger = subprocess.run([str(exe), "stranger", str(handle), str(SIZE)],
                                  env={**env, "GPUPOOL_TOKEN": other},
                                  capture_output=True, text=True, timeout=60)
        assert stranger.returncode == 0 and "PASS ipc_share stranger" in stranger.stdout, (
            stranger.stdout + stranger.stderr)
        assert "not one of this job's open handles" in stranger.stderr, stranger.stderr

        out, err = exporter.communicate("check\n", timeout=60)
        assert exporter.returncode == 0 and "PASS ipc_share export" in out, out + err
    finally:
        if exporter.poll() is None:
            exporter.kill()
            exporter.wait()
    wait_until("both GPUs scrubbed and free", lambda: [
        g["state"] for g in server.get_json("/api/v1/gpus")["gpus"]] == ["free"] * 2)


WORDS = 1 << 18  # the buffer the exporter's kernel writes: 1 MiB of 32-bit words


def _line(proc: subprocess.Popen[str], want: str) -> None:
    assert proc.stdout is not None
    got = proc.stdout.readline()
    if got.strip() != want:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"expected {want!r}, got {got!r}\n{out}{err}")


def _tell(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


@pytest.mark.san
@pytest.mark.parametrize("graph", [False, True], ids=["record", "graph"])
def test_an_ipc_event_orders_two_processes_work(
        native_build: Path, start_daemon: Callable[..., GpupoolServer], tmp_path: Path,
        graph: bool) -> None:
    """Issue 37, item 4, events (tests/c/ipc_event.c): A's slow kernel, then a kernel writing the
    buffer, then A records an IPC event and says so at once; B, told then, waits for the event
    (cuStreamWaitEvent, cuEventSynchronize) and reads the buffer bit-exact through the IPC memory
    handle; a process of another token cannot open the event handle. Without the wait on the
    event (or if A's record returned before A's worker recorded it) B would read 0xEE bytes.
    `graph`: A captures the kernels and the record in a CUDA graph and launches it, which must
    wait for A's worker as the record does (ipc_event.c checks the shim's call counts)."""
    exe = native_build / "tests" / "ipc_event"
    assert exe.is_file(), f"{exe} not built"
    server = start_daemon("--simulated", "2", build_dir=native_build, simulated=None)
    wait_until("2 free GPUs", lambda: [g["state"] for g in server.get_json("/api/v1/gpus")["gpus"]]
               == ["free"] * 2)
    env = server.client_env()
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE,
             "text": True}
    args = [str(tmp_path), str(WORDS)]
    exporter_env = {**env, "IPC_EVENT_GRAPH": "1", "GPUPOOL_CALL_COUNTS": "1"} if graph else env
    exporter = subprocess.Popen([str(exe), "export", *args], env=exporter_env, **pipes)  # type: ignore[call-overload]
    importer = None
    try:
        _line(exporter, "READY")
        other = server.create_token("ipc-event-stranger")
        stranger = subprocess.run([str(exe), "stranger", *args],
                                  env={**env, "GPUPOOL_TOKEN": other},
                                  capture_output=True, text=True, timeout=60)
        assert stranger.returncode == 0 and "PASS ipc_event stranger" in stranger.stdout, (
            stranger.stdout + stranger.stderr)
        assert "not one of this job's open handles" in stranger.stderr, stranger.stderr

        importer = subprocess.Popen([str(exe), "import", *args], env=env, **pipes)  # type: ignore[call-overload]
        _line(importer, "OPENED")
        _tell(exporter, "go")
        _line(exporter, "RECORDED")
        _tell(importer, "recorded")
        out, err = importer.communicate(timeout=60)
        assert importer.returncode == 0 and "PASS ipc_event import" in out, out + err
        _tell(exporter, "end")
        out, err = exporter.communicate(timeout=60)
        assert exporter.returncode == 0 and "PASS ipc_event export" in out, out + err
    finally:
        for proc in (exporter, importer):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
