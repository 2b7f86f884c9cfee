"""The shim's connect step for a lease spread over several servers (issue 37, item 3; protocol
1.8): `spread = true` puts GP_HELLO_SPREAD in the hello, and a fleet's GP_EREDIRECT naming the
parts (redirect_parts) is checked and then followed part by part: a hello to each part's server
with the spread group, the part's index, the count of parts, its GPUs and its own slice of the
client's address window.

tests/tools/mini_server.py stands in for the fleet (--spread-parts: it answers the client's first
hello with the parts, every part on itself, which plain TCP's trust rules allow: a redirect is
followed only to the client's own servers) and for each part's server (a part's hello goes to a
worker of the simulated device). tests/c/spread_connect.c runs gp_connect_parts alone; a CUDA
program through conn.c's one connection per part: test_a_cuda_program_of_4_gpus_runs_on_3_parts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, _libasan, require, run_client, wait_until
from worker_client import gp

MIB2 = 2 << 20
GROUP = 0x5EED  # mini_server's spread group
FOUR_IN_THREE = [{"server": "self", "gpus": 1}, {"server": "self", "gpus": 2},
                 {"server": "self", "gpus": 1}]


@contextmanager
def spread_server(build: Path, tmp_path: Path, parts: list[dict[str, Any]],
                  ) -> Iterator[tuple[str, Path]]:
    """mini_server answering a first hello with `parts`; its address and its hello log."""
    worker, sim = build / "gpupool-worker", build / "libgpupool-sim.so"
    require(worker.is_file() and sim.is_file(), "needs the worker and the simulated device")
    config = tmp_path / "sim.conf"
    config.write_text("device_count = 4\n")
    env = {**os.environ, "GPUPOOL_SIM_CONFIG": str(config)}
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    hellos, log = tmp_path / "hellos.jsonl", tmp_path / "mini_server.log"
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "tools" / "mini_server.py"), "--worker",
             str(worker), "--driver", str(sim), "--simulated", "--cache-dir",
             str(tmp_path / "cache"), "--hello-log", str(hellos), "--spread-parts",
             json.dumps(parts)],
            stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL, text=True,
            env=env, start_new_session=True)
    assert proc.stdout is not None
    with proc.stdout:
        line = proc.stdout.readline()
        m = re.match(r"listening on (\S+)", line)
        try:
            assert m, f"mini_server did not start: {line!r}\n{log.read_text()}"
            yield m.group(1), hellos
        finally:
            os.killpg(proc.pid, 9)
            proc.wait()
    err = log.read_text(errors="replace")
    for mark in ("AddressSanitizer", "runtime error:"):
        assert mark not in err, err


def client_env(server: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env.update({"GPUPOOL_CONFIG": "none", "GPUPOOL_TLS": "0", "GPUPOOL_SERVER": server,
                "GPUPOOL_GPUS": "4", "GPUPOOL_SPREAD": "1", "GPUPOOL_CONNECT_TIMEOUT": "20",
                **extra})
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    return env


def read_hellos(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def connect(build: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = build / "tests" / "spread_connect"
    require(exe.is_file(), f"{exe} not built")
    proc = run_client([exe], env=env, timeout=90)
    for mark in ("AddressSanitizer", "runtime error:"):
        assert mark not in proc.stderr, proc.stderr
    return proc


@pytest.mark.san
def test_each_part_gets_one_hello_with_its_slice_of_the_window(native_build: Path,
                                                                tmp_path: Path) -> None:
    with spread_server(native_build, tmp_path, FOUR_IN_THREE) as (address, hellos):
        proc = connect(native_build, client_env(address))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PASS spread_connect: 3 parts" in proc.stdout, out
    first, *parts = read_hellos(hellos)
    # The client's own hello: all 4 GPUs, spread asked for, the whole window, no part.
    assert first["flags"] & gp.GP_HELLO_SPREAD and first["gpus"] == 4, first
    assert (first["spread_group"], first["part"], first["parts"]) == (0, 0, 0), first
    window = (first["va_base"], first["va_base"] + first["va_size"])
    assert f"window {hex(window[0])} {hex(first['va_size'])}" in proc.stdout, out
    # Exactly one hello per part, in order, each with its group, index, count and GPUs.
    assert [(h["spread_group"], h["part"], h["parts"], h["gpus"]) for h in parts] == [
        (GROUP, 0, 3, 1), (GROUP, 1, 3, 2), (GROUP, 2, 3, 1)], parts
    assert all(h["flags"] & gp.GP_HELLO_SPREAD and h["pid"] == first["pid"] for h in parts)
    # Slices: 2 MiB-aligned, equal, disjoint, in order, inside the client's window.
    slices = [(h["va_base"], h["va_base"] + h["va_size"]) for h in parts]
    assert all(b % MIB2 == 0 and (e - b) % MIB2 == 0 and e > b for b, e in slices), slices
    assert len({e - b for b, e in slices}) == 1, slices
    assert all(a[1] <= b[0] for a, b in zip(slices, slices[1:])), slices
    assert window[0] <= slices[0][0] and slices[-1][1] <= window[1], (window, slices)
    # What the caller gets: each part's devices and slice, every part connected; the snapshot
    # announces the 4 devices.
    got = re.findall(r"part (\d) server (\S+) first_device (\d+) ndevices (\d+) va_base (\S+) "
                     r"va_size (\S+) session \d+ connected (\d)", proc.stdout)
    assert [(int(f), int(n), int(b, 16), int(s, 16), c) for _, _, f, n, b, s, c in got] == [
        (0, 1, *slices[0][:1], slices[0][1] - slices[0][0], "1"),
        (1, 2, *slices[1][:1], slices[1][1] - slices[1][0], "1"),
        (3, 1, *slices[2][:1], slices[2][1] - slices[2][0], "1")], out
    assert all(server == address for _, server, *_ in got), out
    assert "announced 4 " in proc.stdout, out


BAD_PARTS = {
    "a gap in first_device": (
        [{"server": "self", "gpus": 2}, {"server": "self", "gpus": 2, "first_device": 3}],
        "it numbered the devices out of order: part 1 (ADDR) starts at device 3, not 2. "
        "Nothing was sent to any part"),
    "a sum that is not gpus": (
        [{"server": "self", "gpus": 2}, {"server": "self", "gpus": 1}],
        "its parts hold 3 GPUs; this process asked for 4"),
    "an address that is not one": (
        [{"server": "self", "gpus": 2}, {"server": "gpu 2:99999", "gpus": 2}],
        "it gave part 1 the address 'gpu 2:99999', which is not one (host:port)"),
    "a part of no GPU": (
        [{"server": "self", "gpus": 4}, {"server": "self", "gpus": 0}],
        "it gave part 1 (ADDR) 0 GPUs"),
    "one part only": ([{"server": "self", "gpus": 4}],
                      "server ADDR offered a lease spread over several servers that this client "
                      "refuses: it named 1 part; a spread lease has 2 to 64"),
    "a server this client does not know (plain TCP)": (
        [{"server": "self", "gpus": 2}, {"server": "127.0.0.1:9", "gpus": 2}],
        "part 2 of 2 of a spread lease (2 GPUs at 127.0.0.1:9): server ADDR (plain TCP) sent "
        "this client on to 127.0.0.1:9, which is not one of its configured servers: not "
        "followed, nothing was sent there"),
}


@pytest.mark.san
@pytest.mark.parametrize("case", list(BAD_PARTS))
def test_bad_parts_are_refused_before_any_part_is_contacted(native_build: Path, tmp_path: Path,
                                                            case: str) -> None:
    parts, words = BAD_PARTS[case]
    with spread_server(native_build, tmp_path, parts) as (address, hellos):
        proc = connect(native_build, client_env(address))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "FAIL spread_connect" in proc.stdout, out
    assert words.replace("ADDR", address) in proc.stderr, out
    assert len(proc.stderr.strip().splitlines()) == 1, out  # one line says it all
    # Only the client's own hello: no part got one.
    assert [h["spread_group"] for h in read_hellos(hellos)] == [0], out


@pytest.mark.san
def test_a_part_refused_by_its_server_closes_the_parts_before_it(native_build: Path,
                                                                 tmp_path: Path) -> None:
    refusal = "part 1 of this lease is no longer held here; run the program again"
    parts = [{"server": "self", "gpus": 2}, {"server": "self", "gpus": 2, "refuse": refusal}]
    with spread_server(native_build, tmp_path, parts) as (address, hellos):
        proc = connect(native_build, client_env(address))
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out
        assert proc.stderr.strip().splitlines()[-1] == (
            f"gpupool: cannot connect part 2 of 2 (2 GPUs at {address}) of this process's lease "
            f"spread over 2 servers: {refusal}. The parts connected before it were closed; the "
            "fleet releases the parts nobody claims."), out
        # Part 0 got its hello (and its worker), part 1 its hello, once each.
        assert [(h["part"], h["parts"], h["gpus"]) for h in read_hellos(hellos)[1:]] == [
            (0, 2, 2), (1, 2, 2)], out


def test_parts_are_refused_when_spread_is_off(native_build: Path, tmp_path: Path) -> None:
    """A server that offers parts to a client that did not ask (no GP_HELLO_SPREAD)."""
    with spread_server(native_build, tmp_path, FOUR_IN_THREE) as (address, hellos):
        proc = connect(native_build, client_env(address, GPUPOOL_SPREAD="0"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "offered a lease spread over 3 servers, which this client did not ask for" in out
    (first,) = read_hellos(hellos)
    assert not first["flags"] & gp.GP_HELLO_SPREAD and first["gpus"] == 4, first


@pytest.mark.san
def test_a_cuda_program_of_4_gpus_runs_on_3_parts(native_build: Path, tmp_path: Path) -> None:
    """conn.c holds one connection per part: a ctypes program of 4 GPUs whose lease comes in 3
    parts (1, 2 and 1 GPUs, each its own worker) sees 4 devices, peer access only inside the part
    of 2, and copies between every ordered pair bit-exact (through the client between parts;
    tests/clients/spread_gpus.py; two real servers: tests/test_e2e_spread.py)."""
    client = REPO / "tests" / "clients" / "spread_gpus.py"
    require((native_build / "client" / "libcuda.so.1").exists(), "needs the shim")
    env = client_env("", LD_LIBRARY_PATH=str(native_build / "client"))
    env.pop("GPUPOOL_LOG", None)
    asan = _libasan() if native_build.name == "build-asan" else None
    if asan:  # the shim is instrumented, python is not
        env["LD_PRELOAD"] = asan
    with spread_server(native_build, tmp_path, FOUR_IN_THREE) as (address, hellos):
        env["GPUPOOL_SERVER"] = address
        proc = run_client([sys.executable, str(client), "4", str((9 << 20) + 4097)], env=env,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PASS spread_gpus pairs=12" in proc.stdout, out
    for mark in ("AddressSanitizer", "runtime error:"):
        assert mark not in proc.stderr, out
    peers = {(int(i), int(j)): int(v) for i, j, v in re.findall(r"peer (\d) (\d) (\d)",
                                                                proc.stdout)}
    assert peers == {(i, j): int({i, j} == {1, 2}) for i in range(4) for j in range(4)
                     if i != j}, out
    assert [(h["spread_group"], h["part"], h["gpus"]) for h in read_hellos(hellos)] == [
        (0, 0, 4), (GROUP, 0, 1), (GROUP, 1, 2), (GROUP, 2, 1)], out


def test_the_loss_of_one_part_loses_the_whole_process(native_build: Path, tmp_path: Path) -> None:
    """One job: when part 2's worker dies, one line names its server, a call on device 0 (part
    0, alive) fails with the loss error, and the other parts' connections are closed (their
    workers end)."""
    client = REPO / "tests" / "clients" / "spread_gpus.py"
    env = client_env("", LD_LIBRARY_PATH=str(native_build / "client"))
    env.pop("GPUPOOL_LOG", None)
    with spread_server(native_build, tmp_path, FOUR_IN_THREE) as (address, _), subprocess.Popen(
            [sys.executable, str(client), "4", "4096", "hold"], env={**env,
                                                                    "GPUPOOL_SERVER": address},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        lines: list[str] = []  # ranges, 12 peers, kernels, module, vmm, holding
        while len(lines) < 20 and (not lines or lines[-1] not in ("holding", "")):
            lines.append(proc.stdout.readline().strip())
        assert lines[-1] == "holding", lines
        workers = _workers_by_age(tmp_path / "cache")
        assert len(workers) == 3, workers
        os.kill(workers[-1], 9)  # part 2's worker (the last connected)
        wait_until("the other parts' workers end", lambda: not any(
            os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in workers[:2]))
        proc.stdin.write("\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=60)
    assert "after hold CUDA_ERROR_DEVICE_UNAVAILABLE" in out and proc.returncode == 2, out + err
    assert err.count("lost connection to server") == 1 and f"server {address}" in err, err


def _workers_by_age(cache: Path) -> list[int]:
    """The workers that the mini server whose cache directory is `cache` started (not their own
    children), oldest first."""
    pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    mine = {p for p in pids
            if _cmdline(p).split(" ", 1)[0].endswith("/gpupool-worker") and f"{cache} " in
            _cmdline(p)}
    return sorted((p for p in mine if _stat(p, 1) not in mine), key=lambda p: _stat(p, 19))


def _stat(pid: int, field: int) -> int:
    """A numeric field of /proc/PID/stat, counted from the one after the state (ppid: 1)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[field])
    except (OSError, ValueError, IndexError):
        return 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.san
def test_the_checks_over_tls_and_the_slices(native_build: Path) -> None:
    """tests/c/test_connect_parts.c: pins over TLS, a part's pin against the client's own pin
    for that address, hostile lists (a NUL in an address, tls://, overlapping devices, a huge
    count), the window slices at their edges."""
    exe = native_build / "tests" / "test_connect_parts"
    require(exe.is_file(), f"{exe} not built")
    proc = run_client([exe], timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "all checks passed" in proc.stdout, out
    for mark in ("AddressSanitizer", "runtime error:"):
        assert mark not in out, out


def test_two_real_servers_spread_a_lease_of_4_and_the_shim_connects_both_parts(
        start_daemon: Any, native_build: Path, pg_url: str) -> None:
    """The fleet's side and the shim's together: two gpupoold --simulated 2 on one PostgreSQL,
    a client of 4 GPUs with spread (both servers its own: plain TCP's trust rules) gets a part
    of 2 GPUs from each, in device order, and says a part's hello to each."""
    a, b = (start_daemon("--database", pg_url, simulated=2, build_dir=native_build, tls=False)
            for _ in range(2))
    wait_until("A sees the fleet's 4 GPUs",
               lambda: [(v["state"], len(v["gpus"])) for v in a.get_json("/api/v1/fleet")[
                   "servers"]] == [("up", 2), ("up", 2)])
    servers = {f"{s.host}:{s.port}" for s in (a, b)}
    proc = connect(native_build, client_env(",".join(sorted(servers)), GPUPOOL_TOKEN=a.token))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PASS spread_connect: 2 parts" in proc.stdout, out
    got = re.findall(r"part \d server (\S+) first_device (\d+) ndevices (\d+) .* connected 1",
                     proc.stdout)
    assert [(f, n) for _, f, n in got] == [("0", "2"), ("2", "2")], out
    assert {server for server, _, _ in got} == servers, out
    assert "announced 4 " in proc.stdout, out
