"""GPU reset: the daemon-side client (gpupoold/gpu/reset.py) and the privileged helper
(gpupoold/gpu/reset_helper.py), end to end over Unix sockets, with a fake NVML and a fake nvidia-smi."""

from __future__ import annotations

import asyncio
import ctypes.util
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from fake_nvml import MIB, FakePynvml, gpus

from gpupoold.gpu import reset_helper
from gpupoold.gpu.inventory import Gpu
from gpupoold.gpu.nvml import Nvml
from gpupoold.gpu.reset import request_reset, should_reset
from gpupoold.gpu.reset_helper import ResetHelper, SetupError, bind_socket

REPO = Path(__file__).resolve().parent.parent
OK_OUTPUT = "GPU 00000000:28:00.0 was successfully reset."
NO_NVML = ctypes.util.find_library("nvidia-ml") is None


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A short directory: Unix socket paths must stay under 108 bytes."""
    d = Path(tempfile.mkdtemp(prefix="gpr", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def wait_for(cond: Any, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def fake_smi(tmp: Path, body: str = f'echo "{OK_OUTPUT}"') -> Path:
    """A fake nvidia-smi that appends its argv to tmp/argv.log (the helper clears the
    environment, so the path is written into the script)."""
    script = tmp / "nvidia-smi"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{tmp}/argv.log"\n{body}\n')
    script.chmod(0o755)
    return script


def smi_argv(tmp: Path) -> list[str]:
    log = tmp / "argv.log"
    return log.read_text().splitlines() if log.exists() else []


def real_gpu(fake: FakePynvml, nvml_index: int) -> Gpu:
    return Gpu(index=0, name="NVIDIA H100", uuid=fake.devices[nvml_index].uuid, simulated=False,
               driver="libcuda.so.1", ordinal=nvml_index)


class Helper:
    """A ResetHelper serving in a thread on tmp/reset.sock."""

    def __init__(self, tmp: Path, fake: FakePynvml, smi: Path, **kw: Any) -> None:
        self.path = tmp / "reset.sock"
        self.helper = ResetHelper(Nvml(module=fake), str(smi), **kw)
        self.helper.poll_interval = 0.02
        self.listener = bind_socket(self.path, None)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.helper.serve, args=(self.listener, self.stop))
        self.thread.start()

    def ask(self, payload: bytes) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(self.path))
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)  # the end of the stream ends a request without a newline
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return json.loads(data)

    def reset(self, uuid: str) -> dict[str, Any]:
        return self.ask(json.dumps({"gpu_uuid": uuid}).encode() + b"\n")

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.listener.close()


@pytest.fixture
def helper_factory(tmp: Path) -> Iterator[Any]:
    made: list[Helper] = []

    def make(fake: FakePynvml, smi: Path | None = None, **kw: Any) -> Helper:
        h = Helper(tmp, fake, smi if smi is not None else fake_smi(tmp), **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


# ------------------------------------------------------------------------------ policy
def test_should_reset() -> None:
    for scrub_ok in (True, False):
        for health_ok in (True, False):
            assert should_reset("never", scrub_ok, health_ok) is False
            assert should_reset("always", scrub_ok, health_ok) is True
            assert should_reset("on-error", scrub_ok, health_ok) is not (scrub_ok and health_ok)
    with pytest.raises(ValueError, match="never, on-error, always"):
        should_reset("sometimes", True, True)


# ----------------------------------------------------------------- client-side errors
async def test_simulated_gpu_never_calls_the_helper(tmp: Path) -> None:
    gpu = Gpu(index=0, name="x (gpupool simulated)", uuid="GPU-s", simulated=True, driver="",
              ordinal=0)
    r = await request_reset(tmp / "missing.sock", gpu, 5)
    assert r.ok and r.note == "simulated reset" and r.error == ""


async def test_missing_socket(tmp: Path) -> None:
    fake = FakePynvml(gpus(1))
    r = await request_reset(tmp / "reset.sock", real_gpu(fake, 0), 5)
    assert not r.ok
    assert r.error == (f"the reset helper is not running (socket {tmp}/reset.sock missing): "
                       "install and start gpupool-reset-helper.socket, or set reset_policy = never")


async def test_socket_nobody_listens_on(tmp: Path) -> None:
    path = tmp / "reset.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # the file stays, nobody listens: a helper that died
    r = await request_reset(path, real_gpu(FakePynvml(gpus(1)), 0), 5)
    assert not r.ok and "is not running" in r.error and "refuses connections" in r.error


async def test_nvml_is_paused_and_resumed_off_the_event_loop(tmp: Path) -> None:
    """NVML's lock may be held for long by the telemetry sampler's thread: waiting for it must
    never block the event loop."""
    nvml = Nvml(module=FakePynvml(gpus(1)))
    loop_thread = threading.current_thread()
    calls: list[tuple[str, bool]] = []
    pause, resume = nvml.pause, nvml.resume

    def slow_pause(reason: str) -> None:
        calls.append(("pause", threading.current_thread() is loop_thread))
        pause(reason)

    def slow_resume() -> None:
        calls.append(("resume", threading.current_thread() is loop_thread))
        time.sleep(0.4)  # as when the sampler holds the lock
        resume()

    nvml.pause, nvml.resume = slow_pause, slow_resume  # type: ignore[method-assign]
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    try:
        r = await request_reset(tmp / "reset.sock", real_gpu(FakePynvml(gpus(1)), 0), 5,
                                nvml=nvml)
    finally:
        ticker.cancel()
    assert not r.ok and "is not running" in r.error
    assert calls == [("pause", False), ("resume", False)]
    assert ticks >= 10, f"the event loop ran only {ticks} times in 0.4 s"
    assert nvml.sample(0).temperature_c == 35  # resumed


async def test_unknown_uuid_is_not_sent(tmp: Path) -> None:
    gpu = Gpu(index=0, name="GPU 0", uuid="", simulated=False, driver="libcuda.so.1", ordinal=0)
    r = await request_reset(tmp / "reset.sock", gpu, 5)
    assert not r.ok and "UUID is unknown" in r.error


async def test_helper_that_never_answers_times_out(tmp: Path) -> None:
    path = tmp / "reset.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        s.listen(1)  # connections queue up, nobody accepts them
        r = await request_reset(path, real_gpu(FakePynvml(gpus(1)), 0), 0.3)
    assert not r.ok and "did not answer within 0.3 s" in r.error


async def test_garbage_reply(tmp: Path) -> None:
    path = tmp / "reset.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        s.listen(1)

        def answer() -> None:
            conn, _ = s.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"hello\n")

        t = threading.Thread(target=answer)
        t.start()
        r = await request_reset(path, real_gpu(FakePynvml(gpus(1)), 0), 10)
        t.join()
    assert not r.ok and "answered 'hello\\n' instead of a reset result" in r.error


# --------------------------------------------------------------------------- end to end
async def test_reset_end_to_end(tmp: Path, helper_factory: Any) -> None:
    fake = FakePynvml(gpus(2))
    h = helper_factory(fake)
    r = await request_reset(h.path, real_gpu(fake, 1), 30)
    assert r.ok, r.error
    assert r.error == "" and OK_OUTPUT in r.output and r.duration_s >= 0
    assert smi_argv(tmp) == ["-r -i 1"]
    assert not fake.initialized  # the helper keeps no NVML session between requests


async def test_nvml_sessions_are_released_while_nvidia_smi_runs(
        tmp: Path, helper_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    helper_fake = FakePynvml(gpus(2))
    daemon_fake = FakePynvml(gpus(2))
    daemon_nvml = Nvml(module=daemon_fake)
    daemon_nvml.health(0)  # the daemon holds a session, as it does after a health check
    seen: list[tuple[bool, bool]] = []
    real_run = subprocess.run

    def run(*args: Any, **kw: Any) -> Any:
        seen.append((helper_fake.initialized, daemon_fake.initialized))
        return real_run(*args, **kw)

    monkeypatch.setattr(reset_helper.subprocess, "run", run)
    h = helper_factory(helper_fake)
    r = await request_reset(h.path, real_gpu(helper_fake, 0), 30, nvml=daemon_nvml)
    assert r.ok, r.error
    assert seen == [(False, False)]
    assert daemon_nvml.sample(0).temperature_c == 35  # usable again afterwards


def test_process_on_the_gpu_refuses(tmp: Path, helper_factory: Any) -> None:
    fake = FakePynvml(gpus(2))
    fake.devices[1].compute = [(os.getpid(), 300 * MIB)]
    h = helper_factory(fake)
    reply = h.reset(fake.devices[1].uuid)
    assert not reply["ok"]
    assert f"GPU 1 is in use by pid {os.getpid()} (" in reply["error"]
    assert "stop those processes first" in reply["error"]
    assert smi_argv(tmp) == []


def test_graphics_process_on_the_gpu_refuses(tmp: Path, helper_factory: Any) -> None:
    fake = FakePynvml(gpus(1))
    fake.devices[0].graphics = [(4321, None)]
    reply = helper_factory(fake).reset(fake.devices[0].uuid)
    assert not reply["ok"] and "pid 4321" in reply["error"]
    assert smi_argv(tmp) == []


def test_unknown_process_list_refuses(tmp: Path, helper_factory: Any) -> None:
    fake = FakePynvml(gpus(1))
    fake.devices[0].failing = {"nvmlDeviceGetComputeRunningProcesses_v3": pynvml.NVML_ERROR_UNKNOWN}
    reply = helper_factory(fake).reset(fake.devices[0].uuid)
    assert not reply["ok"] and "cannot list the processes on GPU 0" in reply["error"]
    assert smi_argv(tmp) == []


def test_busy_peers_refuse_unless_allowed(tmp: Path, helper_factory: Any) -> None:
    fake = FakePynvml(gpus(3))
    fake.devices[2].compute = [(555, MIB)]
    reply = helper_factory(fake).reset(fake.devices[0].uuid)
    assert not reply["ok"]
    assert "other GPUs are in use (GPU 2: pid 555" in reply["error"]
    assert "--allow-busy-peers" in reply["error"]
    assert smi_argv(tmp) == []


def test_busy_peers_allowed(tmp: Path) -> None:
    fake = FakePynvml(gpus(3))
    fake.devices[2].compute = [(555, MIB)]
    h = Helper(tmp, fake, fake_smi(tmp), allow_busy_peers=True)
    try:
        reply = h.reset(fake.devices[0].uuid)
    finally:
        h.close()
    assert reply["ok"], reply["error"]
    assert smi_argv(tmp) == ["-r -i 0"]


def test_unknown_uuid_refuses(tmp: Path, helper_factory: Any) -> None:
    reply = helper_factory(FakePynvml(gpus(2))).reset("GPU-ffffffff-1111-2222-3333-444444444444")
    assert not reply["ok"]
    assert reply["error"] == "no GPU with UUID GPU-ffffffff-1111-2222-3333-444444444444 on this machine"


@pytest.mark.parametrize("payload, expect", [
    (b"not json\n", "the request is not JSON"),
    (b'{"gpu": "GPU-x"}\n', 'the request needs "gpu_uuid"'),
    (b'{"gpu_uuid": "GPU-0; rm -rf /"}\n', 'the request needs "gpu_uuid"'),
    (b'["GPU-00000000-1111-2222-3333-444444444444"]', 'the request needs "gpu_uuid"'),
])
def test_malformed_requests(tmp: Path, helper_factory: Any, payload: bytes, expect: str) -> None:
    reply = helper_factory(FakePynvml(gpus(1))).ask(payload)
    assert not reply["ok"] and expect in reply["error"]
    assert smi_argv(tmp) == []


def test_oversized_request_is_dropped(tmp: Path, helper_factory: Any) -> None:
    h = helper_factory(FakePynvml(gpus(1)))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(h.path))
        try:
            s.sendall(b"x" * (1 << 20))
            reply = s.recv(4096)
        except (BrokenPipeError, ConnectionResetError):
            reply = b""
    assert reply == b""  # closed without an answer
    assert h.reset(FakePynvml(gpus(1)).devices[0].uuid)["ok"]  # still serving


def test_second_reset_while_one_runs_is_refused(tmp: Path, helper_factory: Any) -> None:
    fake = FakePynvml(gpus(2))
    smi = fake_smi(tmp, f'touch "{tmp}/started"\nwhile [ ! -e "{tmp}/release" ]; do sleep 0.02; done\n'
                        f'echo "{OK_OUTPUT}"')
    h = helper_factory(fake, smi, allow_busy_peers=True)
    first: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: first.append(h.reset(fake.devices[0].uuid)))
    t.start()
    try:
        wait_for((tmp / "started").exists, "the first reset to start")
        second = h.reset(fake.devices[1].uuid)
    finally:
        (tmp / "release").touch()
        t.join()
    assert not second["ok"]
    assert f"another reset is running ({fake.devices[0].uuid}, for" in second["error"]
    assert first[0]["ok"], first[0]["error"]
    assert smi_argv(tmp) == ["-r -i 0"]
    assert h.reset(fake.devices[1].uuid)["ok"]  # free again once the first is done


def test_nvidia_smi_timeout(tmp: Path, helper_factory: Any) -> None:
    fake = FakePynvml(gpus(1))
    h = helper_factory(fake, fake_smi(tmp, "exec sleep 60"), reset_timeout=0.5)
    reply = h.reset(fake.devices[0].uuid)
    assert not reply["ok"]
    assert "nvidia-smi -r -i 0 did not finish within 0.5 s and was killed" in reply["error"]


def test_nvidia_smi_failure(tmp: Path, helper_factory: Any) -> None:
    fake = FakePynvml(gpus(1))
    line = "Unable to reset GPU 00000000:18:00.0 because it's being used by some other process."
    h = helper_factory(fake, fake_smi(tmp, f'echo "{line}" >&2\nexit 3'))
    reply = h.reset(fake.devices[0].uuid)
    assert not reply["ok"]
    assert reply["error"] == f"nvidia-smi -r -i 0 failed (exit 3): {line}"
    assert line in reply["output"]


def test_missing_nvidia_smi_at_request_time(tmp: Path, helper_factory: Any) -> None:
    fake = FakePynvml(gpus(1))
    reply = helper_factory(fake, tmp / "gone").reset(fake.devices[0].uuid)
    assert not reply["ok"] and "cannot run" in reply["error"] and "--nvidia-smi" in reply["error"]


def test_persistence_mode_is_restored(tmp: Path, helper_factory: Any) -> None:
    class ResetClearsPersistence(FakePynvml):
        def nvmlInit(self) -> None:  # after nvidia-smi ran, the GPU comes back without it
            super().nvmlInit()
            if (tmp / "argv.log").exists() and not self.set_persistence_calls:
                self.devices[1].persistence = 0

    fake = ResetClearsPersistence(gpus(2))
    fake.devices[1].persistence = 1
    reply = helper_factory(fake).reset(fake.devices[1].uuid)
    assert reply["ok"], reply["error"]
    assert fake.set_persistence_calls == [(1, 1)] and fake.devices[1].persistence == 1
    assert "persistence mode restored" in reply["output"]


def test_persistence_mode_left_alone_when_off(tmp: Path, helper_factory: Any) -> None:
    fake = FakePynvml(gpus(1))
    assert helper_factory(fake).reset(fake.devices[0].uuid)["ok"]
    assert fake.set_persistence_calls == []


def test_nvml_unavailable_in_helper(tmp: Path, helper_factory: Any) -> None:
    fake = FakePynvml(gpus(1))
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    reply = helper_factory(fake).reset(fake.devices[0].uuid)
    assert not reply["ok"]
    assert reply["error"].startswith("NVML is not available to the reset helper: libnvidia-ml.so.1")


# --------------------------------------------------------------------- socket set-up
def test_bind_socket_mode_and_stale_file(tmp: Path) -> None:
    path = tmp / "run" / "reset.sock"
    s = bind_socket(path, None)
    s.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o660
    s = bind_socket(path, None)  # the stale socket of a dead helper is replaced
    try:
        with pytest.raises(SetupError, match="another reset helper is listening"):
            bind_socket(path, None)
    finally:
        s.close()


def test_bind_socket_refuses_other_files_and_groups(tmp: Path) -> None:
    (tmp / "file").write_text("keep me")
    with pytest.raises(SetupError, match="exists and is not a socket"):
        bind_socket(tmp / "file", None)
    assert (tmp / "file").read_text() == "keep me"
    with pytest.raises(SetupError, match="--group no-such-group-gpupool: no such group"):
        bind_socket(tmp / "x.sock", "no-such-group-gpupool")


def helper_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpupoold.gpu.reset_helper", *args]


def test_main_refuses_missing_nvidia_smi(tmp: Path) -> None:
    done = subprocess.run(helper_cmd("--socket", str(tmp / "s"), "--nvidia-smi", str(tmp / "nope")),
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"--nvidia-smi {tmp}/nope: not an executable file" in done.stderr
    assert not (tmp / "s").exists()


def ask_path(path: Path, uuid: str) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.sendall(json.dumps({"gpu_uuid": uuid}).encode() + b"\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data)


@pytest.mark.skipif(not NO_NVML, reason="this machine has NVML: a real reset must not be tried")
def test_main_process_with_real_pynvml(tmp: Path) -> None:
    """The installed program, the real nvidia-ml-py binding, no driver: it serves and says why it
    cannot reset; SIGTERM stops it and removes its socket."""
    path = tmp / "reset.sock"
    proc = subprocess.Popen(helper_cmd("--socket", str(path), "--nvidia-smi", str(fake_smi(tmp))),
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(path.exists, "the helper's socket")
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        reply = ask_path(path, "GPU-00000000-1111-2222-3333-444444444444")
        assert not reply["ok"]
        assert "NVML is not available to the reset helper: libnvidia-ml.so.1 not found" in reply["error"]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert not path.exists()
    assert "request from pid" in err and "GPU-00000000-1111-2222-3333-444444444444" in err
    assert smi_argv(tmp) == []


@pytest.mark.skipif(not NO_NVML, reason="this machine has NVML: a real reset must not be tried")
def test_main_with_systemd_socket_activation(tmp: Path) -> None:
    path = tmp / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    fd = listener.fileno()
    # as systemd does: the socket at fd 3, LISTEN_PID = the helper's own pid (exec keeps it)
    trampoline = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.environ['LISTEN_FDS'] = '1'; "
                  "os.environ['LISTEN_PID'] = str(os.getpid()); os.execv(sys.argv[2], sys.argv[2:])")
    proc = subprocess.Popen([sys.executable, "-c", trampoline, str(fd), *helper_cmd(
        "--socket", str(tmp / "unused.sock"), "--nvidia-smi", str(fake_smi(tmp)))],
        cwd=REPO, pass_fds=(fd,), stderr=subprocess.PIPE, text=True)
    listener.close()
    try:
        reply = ask_path(path, "GPU-00000000-1111-2222-3333-444444444444")
        assert not reply["ok"] and "NVML is not available" in reply["error"]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "the socket from systemd" in err
    assert not (tmp / "unused.sock").exists()
