#!/usr/bin/env python3
"""The remoting benchmark: what the gpupool stack itself costs, next to the raw link.

    python bench/remoting_bench.py [--quick] [--reps N] [--markdown PATH] [--json PATH]
                                   [--server HOST:PORT] [--no-build] [--tls]
    python bench/remoting_bench.py --compression [--native-dir build-x] [--reps N] [--mib N]

In one run, on the simulated device over loopback:
  1. builds bench/tcp_baseline.c (cc) and bench/bench_client.cu (nvcc, static cudart) into
     build/bench/, and the native tree (`make`) unless --no-build;
  2. measures the raw link with tcp_baseline (TCP ping-pong, one-way messages, bulk streams);
  3. starts `gpupoold serve --simulated 1` on 127.0.0.1 (unless --server names a running one) and
     runs bench_client through the shim (build/client/libcuda.so.1);
  4. prints a table: metric, measured, reference (the raw figure of the same link), ratio, target,
     PASS/MISS; the CPU seconds per GiB moved of the 256 MiB copies (client, worker, raw TCP's
     sender plus receiver); with --tls a second gpupoold with a throw-away certificate, the
     same client over TLS, and plain against TLS side by side; and all of it as markdown (to
     --markdown PATH, default: stdout only) with date, machine and commit, ready for
     docs/benchmarks.md.
With --compression instead: host-to-device and device-to-host throughput of zeros and of random
bytes with GPUPOOL_COMPRESSION=off and =lz4 in the same run (<native-dir>/tests/copy_check
through the shim, sync copies of --mib MiB, best of --reps), side by side, and the speed of LZ4
itself on this CPU, from which the link speed below which compression pays follows.
Exit status: 0 when every figure was measured (whatever the targets say), 1 otherwise. Targets
are reported, not enforced: this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402 - bench/ is not a package

BENCH = ROOT / "bench"
SIZES = (4096, 1 << 20, 256 << 20)
READY = re.compile(r"gpupoold: remoting on (\S+):(\d+)")


def human_size(n: int) -> str:
    if n >= 1 << 20:
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB"


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ building

def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def needs_build(target: Path, *sources: Path) -> bool:
    if not target.exists():
        return True
    t = target.stat().st_mtime
    return any(s.stat().st_mtime > t for s in sources)


def build(out: Path, make: bool, native: Path = ROOT / "build") -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    if make:
        log(f"make BUILD={native} (native tree)")
        subprocess.run(["make", "-s", "-j2", f"BUILD={native}"], cwd=ROOT, check=True)
    tcp = out / "tcp_baseline"
    src = BENCH / "tcp_baseline.c"
    if needs_build(tcp, src):
        log(f"cc {src.relative_to(ROOT)}")
        cc = os.environ.get("CC", "cc")
        tmp = tcp.with_name(f".{tcp.name}.{os.getpid()}.tmp")  # renamed: never run half-written
        subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-o", str(tmp), str(src)],
                       check=True)
        tmp.replace(tcp)
    client = out / "bench_client"
    csrc = BENCH / "bench_client.cu"
    deps = (csrc, ROOT / "tests/cuda/gp_check.cuh", ROOT / "tests/sim/gp_test_kernels.cuh")
    if needs_build(client, *deps):
        nvcc = nvcc_path()
        if nvcc is None:
            sys.exit("remoting_bench: nvcc not found (CUDA toolkit needed to build bench_client)")
        log(f"nvcc {csrc.relative_to(ROOT)}")
        tmp = client.with_name(f".{client.name}.{os.getpid()}.tmp")
        subprocess.run([nvcc, "-O2", "-arch=sm_90", "-o", str(tmp), str(csrc)], check=True)
        tmp.replace(client)
    return tcp, client


# ------------------------------------------------------------------------------------ daemon

class Daemon:
    """gpupoold on a simulated device, listening on loopback, ports chosen by the kernel."""

    def __init__(self, native: Path | None = None, config: str = "") -> None:
        native = native or ROOT / "build"
        env = dict(os.environ)
        pypath = [str(ROOT), str(ROOT / "protocol" / "python")]
        if env.get("PYTHONPATH"):
            pypath.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(pypath)
        self.state_dir = tempfile.mkdtemp(prefix="gpupool-bench-")
        cmd = [sys.executable, "-m", "gpupoold", "serve", "--simulated", "1",
               "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--state-dir", self.state_dir,
               "--log-level", "warning"]
        if config:
            path = Path(self.state_dir) / "gpupoold.toml"
            path.write_text(config)
            cmd += ["--config", str(path)]
        for flag, name in (("--worker", "gpupool-worker"), ("--sim-lib", "libgpupool-sim.so")):
            if (native / name).is_file():
                cmd += [flag, str(native / name)]
        log(" ".join(cmd[1:]))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.address: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._reader, daemon=True).start()
        if not self._ready.wait(60) or self.address is None:
            self.stop()
            sys.exit("remoting_bench: gpupoold did not report its address:\n" + self.log_text())
        made = subprocess.run([sys.executable, "-m", "gpupoold", "token", "create", "--name",
                               "bench", "--state-dir", self.state_dir], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if made.returncode != 0:
            self.stop()
            sys.exit(f"remoting_bench: cannot create a token:\n{made.stderr}")
        self.token = made.stdout.strip().splitlines()[-1]

    def _reader(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = READY.search(line)
            if m and self.address is None:
                self.address = f"{m.group(1)}:{m.group(2)}"
                self._ready.set()
        self._ready.set()

    def log_text(self) -> str:
        return "".join(self.lines)

    def worker_cpu(self) -> float | None:
        """CPU seconds used so far by this daemon's workers (its process group), or None."""
        return workers_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        benchlib.stop_process_group(self.proc, 0)  # workers left behind, if any
        benchlib.remove_state(Path(self.state_dir))


def workers_cpu_seconds(group: int) -> float | None:
    """CPU seconds of the gpupool-worker processes in process group `group`, all threads, from
    the scheduler's nanosecond counters (/proc/PID/task/TID/schedstat); None if there are none."""
    total, found = 0.0, False
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            pgrp = int(stat[stat.rindex(")") + 2:].split()[2])
            if comm != "gpupool-worker" or pgrp != group:
                continue
            for task in os.scandir(Path(entry.path, "task")):
                total += int(Path(task.path, "schedstat").read_text().split()[0]) * 1e-9
            found = True
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile
    return total if found else None


# ------------------------------------------------------------------------------------ running

def run_tcp(tcp: Path, reps: int, quick: bool) -> dict:
    cmd = [str(tcp), "--reps", str(reps)] + (["--quick"] if quick else [])
    log("raw TCP baseline: " + " ".join(cmd[1:]))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def best_of(a: dict, b: dict) -> dict:
    """The better raw figure of two baseline runs (lower latency, higher rate): the reference
    is the best the link did in this run, so noise never flatters the remoting figures."""
    out: dict = {}
    for key, va in a.items():
        vb = b[key]
        if isinstance(va, dict):
            out[key] = best_of(va, vb)
        elif key.startswith("rtt_") or "cpu" in key:
            out[key] = min(va, vb)
        else:
            out[key] = max(va, vb)
    return out


def run_client(client: Path, address: str, reps: int, quick: bool, launches: int | None,
               token: str = "", extra_env: dict[str, str] | None = None,
               worker_cpu: Callable[[], float | None] | None = None,
               native: Path | None = None) -> tuple[dict, str, int]:
    """Run bench_client; its RESULT lines by metric. Around each `PHASE metric` .. its RESULT,
    worker_cpu() (the server side's CPU seconds) is read and the difference kept as
    "worker_cpu_s"."""
    env = dict(os.environ)
    env.update(extra_env or {})
    if token:
        env["GPUPOOL_TOKEN"] = token
    shim_dir = str((native or ROOT / "build") / "client")
    env["LD_LIBRARY_PATH"] = shim_dir + (os.pathsep + env["LD_LIBRARY_PATH"]
                                         if env.get("LD_LIBRARY_PATH") else "")
    env["GPUPOOL_SERVER"] = address
    cmd = [str(client), "--reps", str(reps)] + (["--quick"] if quick else [])
    if launches:
        cmd += ["--launches", str(launches)]
    log("bench_client through the shim: " + " ".join(cmd[1:]))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    results: dict = {}
    text: list[str] = []
    phase: tuple[str, float] | None = None
    assert proc.stdout is not None
    for line in proc.stdout:
        text.append(line)
        if line.startswith("PHASE ") and worker_cpu is not None:
            start = worker_cpu()
            phase = None if start is None else (line.split()[1], start)
        elif line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            if phase is not None and phase[0] == r["metric"]:
                end = worker_cpu()
                if end is not None:
                    r["worker_cpu_s"] = end - phase[1]
                phase = None
            results[r["metric"]] = r
            log(f"  {r['metric']}: {r['value']:.6g} {r['unit']}")
        else:
            log("  " + line.rstrip())
    rc = proc.wait()
    return results, "".join(text), rc


# ------------------------------------------------------------------------------ compression
def run_copies(native: Path, address: str, token: str, compression: str, mib: int,
               reps: int) -> dict[tuple[str, str], float]:
    """{(pattern, dir): bytes/s} of copy_check's bench mode with GPUPOOL_COMPRESSION set."""
    env = dict(os.environ, GPUPOOL_SERVER=address, GPUPOOL_COMPRESSION=compression,
               GPUPOOL_CONFIG="none", **benchlib.PLAIN_TCP_CLIENT_ENV)
    env.pop("GPUPOOL_LOG", None)
    if token:
        env["GPUPOOL_TOKEN"] = token
    env["LD_LIBRARY_PATH"] = str(native / "client") + (
        os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    cmd = [str(native / "tests" / "copy_check"), "bench", str(mib), str(reps)]
    log(f"copy_check with compression {compression}: " + " ".join(cmd[1:]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"remoting_bench: copy_check failed:\n{proc.stdout}\n{proc.stderr}")
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            out[(r["pattern"], r["dir"])] = float(r["bytes_per_s"])
    return out


def lz4_speed(mib: int = 64) -> dict[str, float]:
    """Bytes/s of liblz4 on this CPU, 1 MiB blocks, as the shim and worker use it: compress and
    decompress of zeros; compress of random bytes (an attempt that fails at 7/8)."""
    import ctypes
    import time

    lib = ctypes.CDLL("liblz4.so.1")
    block = 1 << 20
    zeros, rand = bytes(block), os.urandom(block)
    dst = ctypes.create_string_buffer(block + block // 255 + 16)
    back = ctypes.create_string_buffer(block)
    n = lib.LZ4_compress_default(zeros, dst, block, len(dst))
    packed = dst.raw[:n]

    def rate(fn) -> float:  # noqa: ANN001 - a local callable
        best = 1e30
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(mib):
                fn()
            best = min(best, time.perf_counter() - t0)
        return mib * block / best

    return {
        "compress_zeros": rate(lambda: lib.LZ4_compress_default(zeros, dst, block, block * 7 // 8)),
        "decompress_zeros": rate(lambda: lib.LZ4_decompress_safe(packed, back, n, block)),
        "compress_random": rate(lambda: lib.LZ4_compress_default(rand, dst, block, block * 7 // 8)),
    }


def compression_report(res: dict[str, dict[tuple[str, str], float]], speed: dict[str, float],
                       meta: dict) -> str:
    gbs = 1e9
    lines = [f"Compression of copies, {meta['date']}, {meta['machine']}, commit {meta['commit']}, "
             f"{meta['mib']} MiB sync copies, best of {meta['reps']}, loopback, simulated device",
             "", "| data | direction | off | lz4 | lz4 / off |", "|---|---|---|---|---|"]
    for pattern in ("zeros", "random"):
        for d, name in (("htod", "host to device"), ("dtoh", "device to host")):
            off, lz4 = res["off"][(pattern, d)], res["lz4"][(pattern, d)]
            lines.append(f"| {pattern} | {name} | {off / gbs:.2f} GB/s | {lz4 / gbs:.2f} GB/s | "
                         f"{lz4 / off:.2f} |")
    c, dz, cr = speed["compress_zeros"], speed["decompress_zeros"], speed["compress_random"]
    # Compression and decompression run one after the other with the transfer (no overlap):
    # a copy of R raw bytes at ratio r costs R/C + rR/L + R/D instead of R/L, so it pays when
    # L < (1 - r) / (1/C + 1/D). Zeros: r ~ 0; everything else lies between.
    even = 1 / (1 / c + 1 / dz)
    lines += ["", f"LZ4 on this CPU (1 MiB blocks): compress zeros {c / gbs:.2f} GB/s, decompress "
              f"zeros {dz / gbs:.2f} GB/s, a failing attempt on random bytes {cr / gbs:.2f} GB/s.",
              f"Break-even link speed for fully compressible data: {even / gbs:.2f} GB/s "
              f"({even * 8 / gbs:.1f} Gbit/s); at a compression ratio r (wire/raw) it is "
              f"(1 - r) x that, e.g. {0.5 * even * 8 / gbs:.1f} Gbit/s at r = 0.5."]
    return "\n".join(lines)


def compression_main(args: argparse.Namespace) -> int:
    native = args.native_dir
    if not args.no_build:
        log(f"make BUILD={native}")
        subprocess.run(["make", "-s", "-j2", f"BUILD={native}"], cwd=ROOT, check=True)
    if not (native / "tests" / "copy_check").exists():
        sys.exit(f"remoting_bench: {native}/tests/copy_check is missing (make BUILD={native})")
    daemon = Daemon(native, config=benchlib.plain_tcp_server_config())
    try:
        assert daemon.address is not None
        res = {c: run_copies(native, daemon.address, daemon.token, c, args.mib, args.reps)
               for c in ("off", "lz4")}
    finally:
        daemon.stop()
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(), "commit": commit(), "mib": args.mib, "reps": args.reps}
    report = compression_report(res, lz4_speed(), meta)
    print(report)
    if args.markdown:
        args.markdown.write_text(report + "\n")
    return 0


# ------------------------------------------------------------------------------------ table

@dataclass
class Row:
    metric: str
    measured: float | None
    unit: str
    reference: float | None
    ref_what: str
    target: str
    verdict: str  # PASS, MISS, info, n/a

    def ratio(self) -> float | None:
        if self.measured is None or not self.reference:
            return None
        return self.measured / self.reference


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "B/s":
        return f"{value / 1e9:.2f} GB/s" if value >= 1e8 else f"{value / 1e6:.1f} MB/s"
    if unit == "us":
        return f"{value:.1f} us"
    if unit == "1/s":
        return f"{value:,.0f}/s"
    return f"{value:.4g} {unit}"


def build_rows(tcp: dict, res: dict) -> list[Row]:
    rows: list[Row] = []

    def val(name: str) -> float | None:
        r = res.get(name)
        return None if r is None else float(r["value"])

    # Round trips: the median call of the best run on both sides (on a virtual machine a round
    # trip is bimodal: both ends on one vCPU, or idle-vCPU wake-ups); means in the notes.
    rtt = tcp["rtt_us_p50"]
    for name, label in (("sync_rtt", "sync round trip (median): cudaStreamSynchronize, idle stream"),
                        ("ctx_sync_rtt", "sync round trip (median): cuCtxSynchronize")):
        r = res.get(name)
        m = None if r is None else float(r.get("p50", r["value"]))
        ratio = None if m is None else m / rtt
        verdict = "n/a" if ratio is None else ("PASS" if ratio <= 1.5 else "MISS")
        rows.append(Row(label, m, "us", rtt, "TCP 16 B ping-pong", "<= 1.5x", verdict))

    m = val("launches")
    verdict = "n/a" if m is None else ("PASS" if m >= 300_000 else "MISS")
    rows.append(Row("pipelined launches of gp_test_noop", m, "1/s", tcp["msgs_per_s_16B"],
                    "TCP 16 B one-way messages", ">= 300,000/s", verdict))

    for direction in ("h2d", "d2h"):
        for kind in ("pinned", "pageable"):
            for size in SIZES:
                name = f"{direction}_{kind}_{size}"
                m = val(name)
                if size == SIZES[-1]:
                    ref, ref_what = tcp["bulk_Bps"], "TCP bulk: 256 MiB buffer in 1 MiB writes"
                elif direction == "d2h" and kind == "pageable":
                    ref = tcp["reqresp_Bps"][str(size)]
                    ref_what = f"TCP 16 B request -> {human_size(size)} answer"
                else:
                    ref, ref_what = tcp["stream_Bps"][str(size)], f"TCP stream, {human_size(size)} writes"
                api = "cudaMemcpyAsync" if kind == "pinned" else "cudaMemcpy"
                label = f"{direction.upper()} {human_size(size)} {kind} ({api})"
                if size == SIZES[-1]:
                    target = ">= 90%"
                    verdict = "n/a" if m is None else ("PASS" if m / ref >= 0.9 else "MISS")
                elif size == SIZES[0] and direction == "d2h" and kind == "pinned":
                    # Asynchronous downloads are pipelined: no round trip each.
                    target = ">= 0.8x"
                    verdict = "n/a" if m is None else ("PASS" if m / ref >= 0.8 else "MISS")
                else:
                    target, verdict = "-", ("n/a" if m is None else "info")
                rows.append(Row(label, m, "B/s", ref, ref_what, target, verdict))
    return rows


COPY_METRICS = tuple(f"{d}_{k}_{SIZES[-1]}" for d in ("h2d", "d2h") for k in ("pinned", "pageable"))
GIB = float(1 << 30)


def copy_label(metric: str) -> str:
    d, kind, size = metric.split("_")
    return f"{d.upper()} {human_size(int(size))} {kind}"


def cpu_table(tcp: dict, res: dict, md: bool = False) -> str:
    """CPU seconds per GiB moved by the 256 MiB copies: the client (bench_client with the shim's
    threads), the worker, both; next to raw TCP's sender plus receiver for the same bytes."""
    raw = tcp.get("bulk_send_cpu_s_per_gib", 0.0) + tcp.get("bulk_recv_cpu_s_per_gib", 0.0)
    head = ("256 MiB copy", "client s/GiB", "worker s/GiB", "gpupool s/GiB",
            "raw TCP s/GiB (send + receive)", "gpupool / raw")
    body = []
    for metric in COPY_METRICS:
        r = res.get(metric, {})
        if "cpu_s" not in r:
            continue
        gib = r["bytes"] / GIB
        client = r["cpu_s"] / gib
        worker = r["worker_cpu_s"] / gib if "worker_cpu_s" in r else None
        total = None if worker is None else client + worker
        body.append((copy_label(metric), f"{client:.3f}",
                     "n/a" if worker is None else f"{worker:.3f}",
                     "n/a" if total is None else f"{total:.3f}",
                     f"{raw:.3f}" if raw else "n/a",
                     f"{total / raw:.2f}x" if total and raw else "n/a"))
    if md:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(b) + " |" for b in body])
    return benchlib.text_table(head, body)


def tls_rows(plain: dict, tls: dict) -> list[tuple[str, str, str, str, str, str]]:
    """(figure, plain, TLS, TLS/plain, target, verdict): round trips at most 1.3x plain, the
    256 MiB copies at least 0.8x plain, all from the same run."""
    rows = []
    for name, label in (("sync_rtt", "sync round trip (median), cudaStreamSynchronize"),
                        ("ctx_sync_rtt", "sync round trip (median), cuCtxSynchronize")):
        a, b = plain.get(name), tls.get(name)
        if a is None or b is None:
            continue
        pa, pb = float(a.get("p50", a["value"])), float(b.get("p50", b["value"]))
        ratio = pb / pa
        rows.append((label, fmt(pa, "us"), fmt(pb, "us"), f"{ratio:.2f}x", "<= 1.3x",
                     "PASS" if ratio <= 1.3 else "MISS"))
    for metric in COPY_METRICS:
        a, b = plain.get(metric), tls.get(metric)
        if a is None or b is None:
            continue
        ratio = float(b["value"]) / float(a["value"])
        rows.append((copy_label(metric), fmt(float(a["value"]), "B/s"),
                     fmt(float(b["value"]), "B/s"), f"{ratio:.2f}x", ">= 0.8x",
                     "PASS" if ratio >= 0.8 else "MISS"))
    return rows


TLS_HEAD = ("figure", "plain", "TLS", "TLS / plain", "target", "result")


def text_table(rows: list[Row]) -> str:
    head = ("metric", "measured", "reference (raw link)", "ratio", "target", "result")
    body = []
    for r in rows:
        ratio = r.ratio()
        body.append((r.metric, fmt(r.measured, r.unit),
                     f"{fmt(r.reference, r.unit)} ({r.ref_what})",
                     "n/a" if ratio is None else f"{ratio:.2f}x", r.target, r.verdict))
    return benchlib.text_table(head, body)


def machine() -> str:
    cpu = benchlib.cpu_model()
    mem = ""
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemTotal:"):
                mem = f", {int(ln.split()[1]) / 1048576:.0f} GiB RAM"
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs{mem}, Linux {platform.release()}"


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               text=True, capture_output=True, check=True).stdout.strip()
        untracked = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, text=True,
                                   capture_output=True, check=True).stdout.strip()
        suffix = " (with uncommitted changes)" if dirty or untracked else ""
        return head + suffix
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(rows: list[Row], meta: dict) -> str:
    out = [f"### Remoting benchmark, {meta['date']}", "",
           f"- machine: {meta['machine']}",
           f"- commit: `{meta['commit']}`",
           f"- device: {meta['device']} over loopback (client, gpupoold and worker on the same "
           "machine)",
           f"- command: `{meta['command']}`", "",
           "| metric | measured | reference (raw link, same run) | ratio | target | result |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r.ratio()
        out.append(f"| {r.metric} | {fmt(r.measured, r.unit)} | {fmt(r.reference, r.unit)} "
                   f"({r.ref_what}) | {'n/a' if ratio is None else f'{ratio:.2f}x'} | "
                   f"{r.target} | {r.verdict} |")
    res = meta["results"]
    means = ", ".join(f"{label} {res[k]['value']:.1f} us" for k, label in
                      (("sync_rtt", "cudaStreamSynchronize"), ("ctx_sync_rtt", "cuCtxSynchronize"))
                      if k in res)
    out += ["", f"Notes: a round trip is the median call of the best of at least 5 runs, on both "
            f"sides; the means of those runs were: raw TCP ping-pong "
            f"{meta['tcp']['rtt_us_mean']:.1f} us, {means}. Every other figure is the median of "
            f"{meta['reps']} runs; each raw TCP figure is the better of two baseline runs (before "
            f"and after the CUDA client). Load average (1 min) at the start: {meta['load']:.2f}. "
            "Targets are the project's; ratios above 1 for small copies come from the shim "
            "batching many small copies into one TCP write."]
    out += ["", "CPU seconds per GiB moved by the 256 MiB copies (all runs of each; the client is "
            "bench_client with the shim's threads, the worker is read from the scheduler's "
            "counters around the same runs; raw TCP is tcp_baseline's sender plus receiver for "
            "its bulk figure):", "", cpu_table(meta["tcp"], res, md=True)]
    tls = meta.get("tls_results")
    if tls:
        out += ["", "With TLS (`--tls`: a second gpupoold with `tls_cert`/`tls_key`, the client "
                "with `GPUPOOL_TLS=1`), against the plain figures above:", "",
                "| " + " | ".join(TLS_HEAD) + " |", "|" + "---|" * len(TLS_HEAD)]
        out += ["| " + " | ".join(r) + " |" for r in tls_rows(res, tls)]
        out += ["", "CPU seconds per GiB moved over TLS:", "", cpu_table(meta["tcp"], tls, md=True)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    ap.add_argument("--reps", type=int, default=3, help="runs per figure; the median is kept")
    ap.add_argument("--launches", type=int, default=None,
                    help="launches per run of the launch benchmark (default 1,000,000)")
    ap.add_argument("--server", help="use this running gpupoold (HOST:PORT) instead of starting one")
    ap.add_argument("--markdown", type=Path, help="also write the markdown table to this file")
    ap.add_argument("--json", type=Path, help="write all raw figures as JSON to this file")
    ap.add_argument("--no-build", action="store_true", help="do not run make first")
    ap.add_argument("--build-dir", type=Path, default=None,
                    help="where tcp_baseline and bench_client are built (default NATIVE/bench)")
    ap.add_argument("--compression", action="store_true",
                    help="only the compression comparison (off vs lz4, zeros and random)")
    ap.add_argument("--native-dir", type=Path,
                    default=ROOT / os.environ.get("GPUPOOL_BUILD_DIR", "build"),
                    help="the native build (make BUILD=...) whose shim, worker and simulated "
                    "device run (default: $GPUPOOL_BUILD_DIR, else build)")
    ap.add_argument("--mib", type=int, default=256, help="--compression: MiB per copy")
    ap.add_argument("--tls", action="store_true",
                    help="also run the CUDA client over TLS (a second gpupoold with a throw-away "
                    "certificate) and print plain and TLS side by side")
    args = ap.parse_args(argv)
    if args.compression:
        return compression_main(args)
    if args.tls and args.server:
        ap.error("--tls starts its own gpupoold with TLS on; it cannot be used with --server")

    native = args.native_dir.resolve()
    tcp_bin, client_bin = build(args.build_dir or native / "bench", make=not args.no_build,
                                native=native)
    if not (native / "client" / "libcuda.so.1").exists():
        sys.exit(f"remoting_bench: {native}/client/libcuda.so.1 is missing "
                 f"(run make BUILD={native.name})")

    load_before = os.getloadavg()[0]
    tcp_before = run_tcp(tcp_bin, args.reps, args.quick)
    log(f"raw TCP (before): {json.dumps(tcp_before)}")

    daemon = None
    try:
        token = os.environ.get("GPUPOOL_TOKEN", "")
        if args.server:
            address = args.server
        else:
            # The plain run says plain TCP on both ends (TLS is the default, issue 35).
            daemon = Daemon(native, config=benchlib.plain_tcp_server_config())
            address, token = daemon.address, daemon.token
            log(f"gpupoold (plain TCP) on {address}")
        results, client_out, rc = run_client(
            client_bin, address, args.reps, args.quick, args.launches, token,
            extra_env=None if args.server else benchlib.PLAIN_TCP_CLIENT_ENV,
            worker_cpu=daemon.worker_cpu if daemon is not None else None, native=native)
    finally:
        if daemon is not None:
            daemon.stop()
    tls_results: dict = {}
    if args.tls and rc == 0:
        files = benchlib.TlsFiles()
        daemon = None
        try:
            daemon = Daemon(native, config=files.server_config())
            log(f"gpupoold with TLS on {daemon.address}")
            assert daemon.address is not None
            tls_results, tls_out, rc = run_client(
                client_bin, daemon.address, args.reps, args.quick, args.launches, daemon.token,
                extra_env=files.client_env(), worker_cpu=daemon.worker_cpu, native=native)
            if rc != 0:
                client_out = tls_out
        finally:
            if daemon is not None:
                daemon.stop()
            files.remove()
    tcp_after = run_tcp(tcp_bin, args.reps, args.quick)
    log(f"raw TCP (after): {json.dumps(tcp_after)}")
    tcp = best_of(tcp_before, tcp_after)

    device = "?"
    m = re.search(r"^device: (.*)$", client_out, re.M)
    if m:
        device = m.group(1)
    rows = build_rows(tcp, results)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "commit": commit(), "device": device, "tcp": tcp, "reps": args.reps,
        "load": load_before, "results": results,
        "command": "python bench/remoting_bench.py " + " ".join(argv if argv is not None
                                                               else sys.argv[1:]),
    }
    if tls_results:
        meta["tls_results"] = tls_results
    print()
    print(text_table(rows))
    print()
    print("CPU time of the 256 MiB copies, per GiB moved (plain TCP):")
    print(cpu_table(tcp, results))
    if tls_results:
        print()
        print("TLS (GPUPOOL_TLS=1, a second gpupoold with tls_cert/tls_key) against plain, same run:")
        print(benchlib.text_table(TLS_HEAD, tls_rows(results, tls_results)))
        print()
        print("CPU time of the 256 MiB copies over TLS, per GiB moved:")
        print(cpu_table(tcp, tls_results))
    print()
    md = markdown(rows, meta)
    print(md)
    if args.markdown:
        args.markdown.write_text(md)
        log(f"markdown written to {args.markdown}")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    if rc != 0:
        log(f"bench_client exited with status {rc}; its output:\n{client_out}")
        if daemon is not None:
            log("gpupoold log:\n" + daemon.log_text())
        return 1
    if any(r.measured is None for r in rows):
        log("some figures were not measured")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
