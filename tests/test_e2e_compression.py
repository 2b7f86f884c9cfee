"""LZ4-compressed copies (docs/architecture.md, "Compression of copies").

The block codec's C unit test (tests/c/test_compress.c), then end to end through a real gpupoold
and worker on the simulated device: tests/c/copy_check (a driver-API client of the shim) copies
zeros, random bytes and a mix both ways and checks every byte, and the worker's end-of-session
log line says how many bytes the copies had and how many went over the wire:

    copy bytes (lz4 on): host-to-device R raw, W on the wire; device-to-host R raw, W on the wire
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import require, run_client
from worker_client import DEFAULT_VA_BASE, DEFAULT_VA_SIZE, WorkerSession, gp

COUNTS = re.compile(r"copy bytes \(lz4 (on|off)\): host-to-device (\d+) raw, (\d+) on the wire; "
                    r"device-to-host (\d+) raw, (\d+) on the wire")
MIB = 1 << 20
# copy_check's sizes, each copied both ways, sync and async: 2 * (65535 + 65536 + (1 MiB + 1)
# + (64 MiB - 12345) + 64 MiB) bytes each way.
RAW = 2 * (65535 + 65536 + MIB + 1 + 64 * MIB - 12345 + 64 * MIB)


def copy_check(server, pattern: str, env: dict[str, str] | None = None,
               ) -> subprocess.CompletedProcess[str]:
    exe = Path(server.build_dir) / "tests" / "copy_check"
    proc = run_client([exe, "64", pattern], env=server.client_env(env), timeout=600)
    assert proc.returncode == 0 and "PASS copy_check" in proc.stdout, (
        f"copy_check {pattern} failed:\n{proc.stdout}\n{proc.stderr}\n{server.log_text()}")
    return proc


def session_counts(server, n: int, timeout: float = 30) -> tuple[str, int, int, int, int]:
    """The counts of the n-th session (1-based) once its worker has logged them."""
    deadline = time.monotonic() + timeout
    while True:
        found = COUNTS.findall(server.log_text())
        if len(found) >= n:
            mode, *nums = found[n - 1]
            return (mode, *map(int, nums))  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"no counts for session {n} in the daemon log:\n"
                                 f"{server.log_text()}")
        time.sleep(0.1)


@pytest.mark.san
def test_block_codec(native_build):
    proc = subprocess.run([native_build / "tests" / "test_compress"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout + proc.stderr


@pytest.mark.san
def test_lz4_zeros_random_mixed(gpupool_server):
    lz4 = {"GPUPOOL_COMPRESSION": "lz4"}
    copy_check(gpupool_server, "zeros", lz4)
    mode, h_raw, h_wire, d_raw, d_wire = session_counts(gpupool_server, 1)
    assert mode == "on"
    assert h_raw == d_raw == RAW
    # Only the two copies below 64 KiB go raw; 1 MiB of zeros is a few KiB as LZ4.
    assert h_wire < RAW // 50 and d_wire < RAW // 50, (h_wire, d_wire)
    assert "lz4-compressed in this session" in gpupool_server.log_text()

    copy_check(gpupool_server, "random", lz4)
    mode, h_raw, h_wire, d_raw, d_wire = session_counts(gpupool_server, 2)
    assert mode == "on"
    # Stored raw: the data plus 8 bytes per block, never more.
    blocks = 2 * (1 + 2 + 64 + 64) + 2  # per direction: 64 KiB (1), 1 MiB + 1 (2), 64 MiB (64x2)
    assert RAW < h_wire <= RAW + 8 * blocks, h_wire
    assert RAW < d_wire <= RAW + 8 * blocks, d_wire

    copy_check(gpupool_server, "mixed", lz4)
    mode, h_raw, h_wire, d_raw, d_wire = session_counts(gpupool_server, 3)
    assert mode == "on"
    assert 0.45 * RAW < h_wire < 0.6 * RAW and 0.45 * RAW < d_wire < 0.6 * RAW, (h_wire, d_wire)


@pytest.mark.san
def test_compression_off_by_default(gpupool_server):
    copy_check(gpupool_server, "zeros")
    mode, h_raw, h_wire, d_raw, d_wire = session_counts(gpupool_server, 1)
    assert (mode, h_raw, h_wire, d_raw, d_wire) == ("off", RAW, RAW, RAW, RAW)
    assert "lz4" not in gpupool_server.log_text().replace("(lz4 off)", "")


@pytest.mark.san
def test_worker_without_liblz4_serves_uncompressed(native_build, start_daemon):
    server = start_daemon(env={"GPUPOOL_LZ4_LIBRARY": "/nonexistent/liblz4.so.1"})
    copy_check(server, "mixed", {"GPUPOOL_COMPRESSION": "lz4", "GPUPOOL_LOG": "debug"})
    mode, h_raw, h_wire, d_raw, d_wire = session_counts(server, 1)
    assert (mode, h_wire, d_wire) == ("off", h_raw, d_raw)
    assert re.search(r"asked for lz4-compressed copies; copies stay uncompressed \(cannot load "
                     r"/nonexistent/liblz4.so.1", server.log_text()), server.log_text()


@pytest.mark.san
@pytest.mark.parametrize(("top", "own", "mode"), [("off", "lz4", "on"), ("lz4", "off", "off")],
                         ids=["server-lz4-top-off", "server-off-top-lz4"])
def test_per_server_compression_from_the_config_file(gpupool_server, tmp_path, top, own, mode):
    """compression in the [[servers]] table of the server used wins over the top level's, both
    ways (the file alone: no GPUPOOL_SERVER, no GPUPOOL_COMPRESSION)."""
    path = tmp_path / "config.toml"
    path.write_text(f'compression = "{top}"\n\n[[servers]]\naddress = "{gpupool_server.address}"'
                    f'\ncompression = "{own}"\n')
    path.chmod(0o600)
    copy_check(gpupool_server, "zeros", {"GPUPOOL_CONFIG": str(path), "GPUPOOL_SERVER": "",
                                         "GPUPOOL_COMPRESSION": ""})
    counts = session_counts(gpupool_server, 1)
    if mode == "on":
        _, h_raw, h_wire, d_raw, d_wire = counts
        assert counts[0] == "on" and h_raw == d_raw == RAW
        assert h_wire < RAW // 50 and d_wire < RAW // 50, (h_wire, d_wire)
    else:
        assert counts == ("off", RAW, RAW, RAW, RAW)


def test_client_without_liblz4_asks_for_nothing(gpupool_server):
    proc = copy_check(gpupool_server, "zeros", {"GPUPOOL_COMPRESSION": "lz4",
                                                "GPUPOOL_LZ4_LIBRARY": "/nonexistent/x.so"})
    assert "compression = lz4 is set but cannot load /nonexistent/x.so" in proc.stderr
    mode, *_ = session_counts(gpupool_server, 1)
    assert mode == "off"
    assert "asked for lz4" not in gpupool_server.log_text()


def test_bad_compression_setting(gpupool_server):
    exe = Path(gpupool_server.build_dir) / "tests" / "copy_check"
    proc = run_client([exe, "1", "zeros"],
                      env=gpupool_server.client_env({"GPUPOOL_COMPRESSION": "gzip"}), timeout=60)
    assert proc.returncode != 0
    assert "GPUPOOL_COMPRESSION=gzip is not supported: write off (the default) or lz4" in (
        proc.stdout + proc.stderr)


# ------------------------------------------------------------ the worker alone, block by block
# tests/worker_client.py drives a worker directly, so that these tests can send what no shim
# sends: LZ4 blocks made here (liblz4 through ctypes), and corrupt ones.
def _lz4() -> ctypes.CDLL:
    lib = ctypes.CDLL("liblz4.so.1")
    lib.LZ4_compress_default.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                         ctypes.c_int]
    lib.LZ4_decompress_safe.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                        ctypes.c_int]
    return lib


def blocks(data: bytes, compress: bool = True) -> bytes:
    """data as the block sequence of a compressed copy (LZ4 where it pays, as the shim does)."""
    lib, out = _lz4(), []
    for off in range(0, len(data), gp.GP_LZ4_BLOCK):
        raw = data[off:off + gp.GP_LZ4_BLOCK]
        cap = len(raw) - len(raw) // 8
        buf = ctypes.create_string_buffer(max(cap, 1))
        n = lib.LZ4_compress_default(raw, buf, len(raw), cap) if compress else 0
        stored = buf.raw[:n] if 0 < n < len(raw) else raw
        out.append(struct.pack("<II", len(raw), len(stored)) + stored)
    return b"".join(out)


def unblock(read: Callable[[int], bytes], size: int) -> tuple[bytes, int]:
    """Reads a block sequence of size raw bytes; (the data, wire bytes)."""
    lib, out, wire = _lz4(), [], 0
    while size > 0:
        raw, stored = struct.unpack("<II", read(8))
        assert 0 < stored <= raw <= min(size, gp.GP_LZ4_BLOCK), (raw, stored, size)
        body = read(stored)
        wire += 8 + stored
        if stored == raw:
            out.append(body)
        else:
            buf = ctypes.create_string_buffer(raw)
            assert lib.LZ4_decompress_safe(body, buf, stored, raw) == raw
            out.append(buf.raw)
        size -= raw
    return b"".join(out), wire


def lz4_session(cache_dir: Path, staged: bool, lz4_library: str | None = None) -> WorkerSession:
    env = {"GPUPOOL_WORKER_STAGED_COPIES": "1" if staged else "0"}
    if lz4_library:
        env["GPUPOOL_LZ4_LIBRARY"] = lz4_library
    hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=os.getpid(),
                     flags=gp.GP_HELLO_LZ4, host="testhost", user="tester",
                     program="test_e2e_compression", token="", gpu="", model="", min_memory=0,
                     va_base=DEFAULT_VA_BASE, va_size=DEFAULT_VA_SIZE)
    s = WorkerSession(cache_dir, hello=hello, env=env)
    assert s.hello.result == 0, s.hello.message
    return s


def dtoh_blocks(s: WorkerSession, src: int, size: int) -> tuple[int, bytes, int]:
    req = 7777
    s.send(gp.MemcpyDtoh(src=src, size=size, stream=0, is_async=0), req=req)
    op, rreq, body = s.recv_frame()
    assert (op, rreq) == (gp.MemcpyDtoh.OP, req)
    reply = gp.MemcpyDtohReply.decode(body)
    if reply.result or not reply.data:
        return reply.result, b"", 0
    data, wire = unblock(s._read_exact, reply.data)
    return reply.result, data, wire


@pytest.mark.san
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_worker_blocks_both_ways(tmp_path, staged):
    s = lz4_session(tmp_path / "cache", staged)
    try:
        assert s.hello.features == gp.GP_HELLO_LZ4
        size = 20 * MIB + 5  # the staging buffers hold 8 blocks: 3 chunks, the last one short
        data = bytearray(size)
        data[3 * MIB:5 * MIB] = os.urandom(2 * MIB)  # two incompressible blocks among zeros
        data = bytes(data)
        a = s.alloc(size)
        assert a.result == 0
        s.htod(a.dptr, b"", 0)  # nothing at all
        s.send(gp.MemcpyHtod(dst=a.dptr, stream=0, is_async=0, data=size), blocks(data))
        result, back, wire = dtoh_blocks(s, a.dptr, size)
        assert result == 0 and back == data
        assert 2 * MIB < wire < 2 * MIB + 200_000, wire  # the random MiBs, the rest tiny
        # Below GP_LZ4_MIN_COPY: raw both ways.
        small = os.urandom(gp.GP_LZ4_MIN_COPY - 1)
        s.htod(a.dptr, small)
        assert s.dtoh(a.dptr, len(small)) == (0, small)
        assert s.sync() == 0
        assert s.close() == 0, s.stderr_text()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    text = s.stderr_text()
    assert ("direct copies" in text) != staged, text
    m = COUNTS.search(text)
    assert m and m.group(1) == "on", text
    assert int(m.group(2)) == int(m.group(4)) == size + len(small)
    assert "AddressSanitizer" not in text and "runtime error" not in text, text


CORRUPT = {
    "raw above the block size": lambda b: struct.pack("<II", gp.GP_LZ4_BLOCK + 1, 10) + b[8:],
    "stored above raw": lambda b: b[:4] + struct.pack("<I", gp.GP_LZ4_BLOCK + 1) + b[8:],
    "LZ4 garbage": lambda b: b[:8] + b"\xff" * 64 + b[72:],
}


@pytest.mark.san
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("how", list(CORRUPT))
def test_worker_refuses_corrupt_blocks(tmp_path, staged, how):
    s = lz4_session(tmp_path / "cache", staged)
    size = 2 * MIB
    a = s.alloc(size)
    assert a.result == 0
    wire = CORRUPT[how](blocks(bytes(size)))
    try:
        s.send(gp.MemcpyHtod(dst=a.dptr, stream=0, is_async=0, data=size), wire)
    except OSError:
        pass  # the worker may close before it has read everything
    rc = s.wait(60)
    text = s.stderr_text()
    assert "corrupt compressed copy" in text, text
    assert rc == 0 or "protocol" in text, text
    assert "AddressSanitizer" not in text and "runtime error" not in text, text


def test_worker_without_liblz4_declines(tmp_path):
    s = lz4_session(tmp_path / "cache", False, lz4_library="/nonexistent/liblz4.so.1")
    assert s.hello.features == 0
    data = bytes(2 * MIB + 3)
    a = s.alloc(len(data))
    s.htod(a.dptr, data)  # raw, as negotiated
    assert s.dtoh(a.dptr, len(data)) == (0, data)
    assert s.close() == 0
    assert "copies stay uncompressed (cannot load /nonexistent/liblz4.so.1" in s.stderr_text()


# ------------------------------------------------------------ an ordinary CUDA program
def _copies_program(build: Path) -> Path:
    """tests/cuda/copies.cu built as test_e2e_cuda.py builds it (static cudart), same path."""
    from test_e2e_cuda import ARCH, CUDA_DIR, KERNELS_HEADER, nvcc_path

    nvcc = nvcc_path()
    require(nvcc is not None, "nvcc (CUDA toolkit) not found: copies.cu cannot be built")
    src, out = CUDA_DIR / "copies.cu", build / "cuda-tests" / "static" / "copies"
    deps = [src, CUDA_DIR / "gp_check.cuh", KERNELS_HEADER]
    if out.exists() and all(d.stat().st_mtime <= out.stat().st_mtime for d in deps):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".copies.{os.getpid()}.lz4.tmp")
    cmd = [str(nvcc), f"-arch={ARCH}", "-O2", "-cudart", "static", "-o", str(tmp), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout}\n{proc.stderr}"
    tmp.replace(out)
    return out


@pytest.mark.san
def test_copies_program_with_lz4(native_build, gpupool_server):
    exe = _copies_program(native_build)
    proc = run_client([exe], env=gpupool_server.client_env({"GPUPOOL_COMPRESSION": "lz4"}),
                      timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("PASS copies"), (
        f"{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}\n{gpupool_server.log_text()[-4000:]}")
    mode, h_raw, h_wire, d_raw, d_wire = session_counts(gpupool_server, 1)
    assert mode == "on" and h_raw > 256 * MIB and d_raw > 256 * MIB
    # copies.cu copies pseudo-random patterns: stored raw, 8 bytes per MiB more at most (the
    # memsets' zeros shrink the device-to-host side).
    assert h_wire <= h_raw * 1.0001 and d_wire <= d_raw * 1.0001, (h_raw, h_wire, d_raw, d_wire)


# ------------------------------------------------------------ the shim against a bad server
def test_shim_refuses_corrupt_blocks(native_build, tmp_path):
    """A server that negotiates LZ4 and then sends a block claiming more than the block size:
    the shim ends the connection with the reason, the copy fails, nothing overflows."""
    from test_shim_core import FakeServer, snapshot

    def on_hello(index: int, hello: object) -> object:
        assert hello.flags == gp.GP_HELLO_LZ4 | gp.GP_HELLO_KEEPALIVE  # type: ignore[attr-defined]
        reply = snapshot(hello)
        reply.features = gp.GP_HELLO_LZ4
        return reply

    def on_frame(server: object, conn, op: int, req: int, msg, bulk: bytes) -> bool:
        if op != gp.MemcpyDtoh.OP:
            return False
        bad = struct.pack("<II", gp.GP_LZ4_BLOCK + 1, 16) + bytes(16)
        conn.sendall(gp.encode_frame(gp.MemcpyDtohReply(result=0, data=msg.size), req) + bad)
        return True

    server = FakeServer(on_hello=on_hello, on_frame=on_frame)
    try:
        # FakeServer speaks the plaintext protocol: the client says plain TCP (GPUPOOL_TLS=0).
        env = {"GPUPOOL_SERVER": server.address, "GPUPOOL_CONFIG": "none",
               "GPUPOOL_COMPRESSION": "lz4", "GPUPOOL_TLS": "0"}
        exe = Path(native_build) / "tests" / "copy_check"
        proc = run_client([exe, "dtoh", "2"], env=env, timeout=60)
    finally:
        server.close()
    out = proc.stdout + proc.stderr
    assert "corrupt compressed copy (a block's raw length is 0, above the block size" in out, out
    m = re.search(r"dtoh: (\d+)", proc.stdout)
    assert m and int(m.group(1)) != 0, out


def test_gpupool_config_shows_compression(tmp_path):
    from gpupool.cli import show_config
    from gpupool.config import load

    path = tmp_path / "config.toml"
    path.write_text('compression = "lz4"\nservers = ["a"]\n')
    for env, value, source in (({"GPUPOOL_CONFIG": str(path)}, "lz4", f"{path}:1"),
                               ({"GPUPOOL_CONFIG": str(path), "GPUPOOL_COMPRESSION": "off"}, "off",
                                "GPUPOOL_COMPRESSION"),
                               ({"GPUPOOL_CONFIG": "none", "GPUPOOL_SERVER": "a"}, "off",
                                "default")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            show_config(load(env, warn=lambda _m: None))
        assert re.search(rf"^  compression +{value} +{re.escape(source)}$", out.getvalue(), re.M), (
            out.getvalue())


def test_lz4_over_tls(start_daemon, native_build, tmp_path, tls_pki):
    """Compressed blocks inside the worker's TLS session (io.c and the shim's TLS reads)."""
    from test_remoting_tls import tls_daemon

    server = tls_daemon(start_daemon, native_build, tls_pki, tmp_path)
    copy_check(server, "mixed", {"GPUPOOL_COMPRESSION": "lz4",
                                 "GPUPOOL_SERVER": f"tls://{server.address}",
                                 "GPUPOOL_TLS_CA": str(tls_pki.ca)})
    mode, h_raw, h_wire, d_raw, d_wire = session_counts(server, 1)
    assert mode == "on" and h_raw == d_raw == RAW
    assert h_wire < 0.6 * RAW and d_wire < 0.6 * RAW, (h_wire, d_wire)


@pytest.fixture(scope="module")
def tls_pki(tmp_path_factory: pytest.TempPathFactory):
    from test_remoting_tls import Pki

    return Pki(tmp_path_factory.mktemp("pki"))
