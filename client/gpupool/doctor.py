"""`gpupool doctor`: checks, each printed as ok / warn / FAIL (with a `fix:` line on failure).

1. the configuration is readable and names a server;
2. per server: reachable, TLS, identity (pinned, or the CA's: a server with neither is not
   contacted at all, as the shims refuse it), protocol version (the server's major == ours),
   token accepted;
3. the shims are what the loader picks under `gpupool run` (a Python subprocess with the run
   environment loads libcuda.so.1 / libnvidia-ml.so.1 with ctypes, checks they export
   gpupool_shim_version and reads their path from /proc/self/maps);
4. the CUDA runtime of the program (PyTorch's, when this interpreter can import torch) is one
   the server's driver supports;
5. a tiny round trip works: a subprocess under the run environment does cuInit, takes the
   primary context, allocates, copies 1 MiB there and back, compares, frees (ctypes).

Exit status 1 when any check failed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gpupool_protocol as gp

from gpupool import __version__
from gpupool.config import ClientConfig, ConfigError, ServerConfig, load, server_desc
from gpupool.probe import Probe, probe_all, probe_limit
from gpupool.shim import NVML_NAME, SHIM_NAME, ShimNotFound, client_env
from gpupool.wire import InfoResult

MARK = "gpupool_shim_version"
ROUND_TRIP_TIMEOUT = 120.0

# Run in a subprocess with the run environment: which file the loader gives for a soname.
LOADED_SCRIPT = r"""
import ctypes, json, sys
name = sys.argv[1]
try:
    lib = ctypes.CDLL(name)
except OSError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
# glibc's dlopen handle is the library's struct link_map: l_addr (load address), l_name.
lm = ctypes.cast(lib._handle, ctypes.POINTER(ctypes.c_void_p * 2)).contents
base, lname = lm[0] or 0, ctypes.string_at(lm[1]).decode() if lm[1] else ""
path = ""
with open("/proc/self/maps") as maps:
    for line in maps:
        parts = line.split(None, 5)
        if len(parts) == 6 and int(parts[0].split("-")[0], 16) == base:
            path = parts[5].strip()
            break
version = None
try:
    f = getattr(lib, "gpupool_shim_version")
    f.restype = ctypes.c_char_p
    version = f().decode()
except AttributeError:
    pass
print(json.dumps({"path": path or lname, "link_name": lname, "version": version}))
"""

# Run in a subprocess with the run environment: the smallest useful CUDA session.
ROUND_TRIP_SCRIPT = r"""
import ctypes, json, os, sys, time
size = 1 << 20
t0 = time.monotonic()
out = {"ok": False}
def done():
    print(json.dumps(out))
    sys.exit(0)
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as exc:
    out["error"] = "cannot load libcuda.so.1: %s" % exc
    done()
def err_name(rc):
    s = ctypes.c_char_p()
    try:
        if cuda.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
    except AttributeError:
        pass
    return str(rc)
def call(name, *args):
    rc = getattr(cuda, name)(*args)
    if rc != 0:
        out["error"] = "%s failed: %s (%d)" % (name, err_name(rc), rc)
        done()
u64 = ctypes.c_uint64
cuda.cuMemcpyHtoD_v2.argtypes = [u64, ctypes.c_void_p, ctypes.c_size_t]
cuda.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, u64, ctypes.c_size_t]
cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t]
cuda.cuMemFree_v2.argtypes = [u64]
call("cuInit", 0)
dev = ctypes.c_int()
call("cuDeviceGet", ctypes.byref(dev), 0)
ctx = ctypes.c_void_p()
call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
call("cuCtxSetCurrent", ctx)
name = ctypes.create_string_buffer(256)
if cuda.cuDeviceGetName(name, 256, dev) == 0:
    out["device"] = name.value.decode(errors="replace")
t1 = time.monotonic()
dptr = u64()
call("cuMemAlloc_v2", ctypes.byref(dptr), size)
data = os.urandom(size)
src = ctypes.create_string_buffer(data, size)
dst = ctypes.create_string_buffer(size)
t2 = time.monotonic()
call("cuMemcpyHtoD_v2", dptr, src, size)
call("cuMemcpyDtoH_v2", dst, dptr, size)
t3 = time.monotonic()
same = dst.raw == data
call("cuMemFree_v2", dptr)
try:
    f = cuda.gpupool_shim_lease
    server, uuid, gname = (ctypes.create_string_buffer(n) for n in (300, 96, 96))
    session, simulated = ctypes.c_ulonglong(), ctypes.c_int()
    f.argtypes = [ctypes.c_char_p, ctypes.c_size_t] * 3 + [ctypes.c_void_p] * 2
    if f(server, 300, uuid, 96, gname, 96, ctypes.byref(session), ctypes.byref(simulated)) == 1:
        out["lease"] = {"server": server.value.decode(), "uuid": uuid.value.decode(),
                        "session_id": session.value}
except AttributeError:
    pass
out.update(ok=same, init_ms=(t1 - t0) * 1e3, copy_ms=(t3 - t2) * 1e3)
if not same:
    out["error"] = "the 1 MiB read back differs from what was written"
done()
"""


class Report:
    def __init__(self) -> None:
        self.failed = 0
        self.warned = 0

    def ok(self, name: str, detail: str) -> None:
        print(f"ok    {name}: {detail}")

    def warn(self, name: str, detail: str, fix: str = "") -> None:
        self.warned += 1
        print(f"warn  {name}: {detail}")
        if fix:
            print(f"      fix: {fix}")

    def fail(self, name: str, detail: str, fix: str) -> None:
        self.failed += 1
        print(f"FAIL  {name}: {detail}")
        print(f"      fix: {fix}")

    def skip(self, name: str, why: str) -> None:
        print(f"skip  {name}: {why}")


# ------------------------------------------------------------------------------------ servers
def _token_fix(srv: ServerConfig) -> str:
    if srv.sources.get("token") == "GPUPOOL_TOKEN":
        return ("GPUPOOL_TOKEN overrides the token of every server: set it to a valid token or "
                "unset it")
    return (f"ask the server's operator for a token (`gpupoold token create --name NAME`), then "
            f"`gpupool login {srv.written}` with it")


def _tls_fix(srv: ServerConfig, msg: str) -> str:
    if "certificate was not accepted" in msg or "CA file" in msg:
        return (f"give the CA certificate (PEM) that signed the server's certificate: `gpupool "
                f"login {srv.address} --tls-ca CA.pem` (or GPUPOOL_TLS_CA); the address must be "
                "a name or IP address the certificate lists")
    if "does not speak TLS" in msg:
        return (f"that port is plain TCP (a gpupoold with tls = \"off\", or an older one): ask "
                "its operator to turn TLS on, or on a network you trust `gpupool login "
                f"{srv.address} --plain` (the token then crosses unencrypted)")
    if "client certificate" in msg:
        return ("set tls_cert and tls_key (GPUPOOL_TLS_CERT, GPUPOOL_TLS_KEY) to a client "
                "certificate that the server's tls_client_ca signed, and its key")
    return ("check tls, tls_ca, tls_cert and tls_key for this server (`gpupool config` shows "
            "them and where each comes from)")


def _unpinned_fix(srv: ServerConfig) -> str:
    d = server_desc(srv)
    return (f"`gpupool login {d}` shows the server's identity: check it against what `gpupoold "
            "fingerprint` prints on the server and answer yes (in a script: `gpupool login "
            f"{d} --fingerprint SHA256:...`); or set GPUPOOL_TLS_FINGERPRINT to that value. A "
            f"server run with tls = \"off\": `gpupool login {d} --plain`")


def _changed_fix(srv: ServerConfig) -> str:
    d = server_desc(srv)
    if srv.sources.get("tls_fingerprint") == "GPUPOOL_TLS_FINGERPRINT":
        return ("ask the server's operator what `gpupoold fingerprint` prints on the server; "
                "only if it is the key the server now presents, set GPUPOOL_TLS_FINGERPRINT to "
                "it")
    return ("ask the server's operator what `gpupoold fingerprint` prints on the server; only "
            f"if it is the key the server now presents, pin it: `gpupool login {d} "
            "--fingerprint SHA256:...` (the value the operator read)")


def _identity_ok(srv: ServerConfig, info: InfoResult | None) -> str:
    parts = []
    if srv.tls_fingerprint:
        seen = info.identity if info is not None and info.identity else srv.tls_fingerprint
        parts.append(f"{seen}, the pinned one (from "
                     f"{srv.sources.get('tls_fingerprint', '?')})")
    if srv.tls_ca:
        parts.append(f"certificate verified with tls_ca {srv.tls_ca} for {srv.host}")
    return "; ".join(parts)


def _check_server(rep: Report, p: Probe) -> None:
    srv = p.server
    a = srv.written
    names = [f"{a}: reachable", f"{a}: TLS", f"{a}: identity", f"{a}: protocol version",
             f"{a}: token accepted"]

    def skip(indexes: range, why: str) -> None:
        for i in indexes:
            rep.skip(names[i], why)

    err = p.error
    if err is not None and err.kind == "trust":
        # Refused before connecting, like the shims: a server nobody vouches for is not asked.
        skip(range(0, 2), "not contacted: this client sends nothing to a server whose identity "
                          "it cannot check")
        rep.fail(names[2], str(err), _unpinned_fix(srv))
        skip(range(3, 5), "not contacted")
        return
    if err is not None and err.kind == "connect":
        rep.fail(names[0], str(err),
                 f"check that gpupoold runs on {srv.host} and listens on port {srv.port} (it "
                 "prints `gpupoold: remoting on HOST:PORT` at start) and that no firewall is in "
                 "the way; `gpupool config` shows where this address comes from")
        skip(range(1, 5), "the server is not reachable")
        return
    rep.ok(names[0], f"connected to {srv.host}:{srv.port}")
    if err is not None and err.kind == "tls":
        detail = str(err)
        rep.fail(names[1], detail[5:] if detail.startswith("TLS: ") else detail,
                 _tls_fix(srv, detail))
        skip(range(2, 5), "no TLS session")
        return
    if err is not None and err.kind == "identity":
        rep.ok(names[1], "handshake done")
        rep.fail(names[2], str(err), _changed_fix(srv))
        skip(range(3, 5), "nothing was sent: the server is not the one pinned")
        return
    info = p.info
    requires_tls = info is not None and info.result != 0 and "requires TLS" in info.message
    if requires_tls:
        assert info is not None
        rep.fail(names[1], f"the server requires TLS: {info.message}",
                 f"drop tls = false (and GPUPOOL_TLS=0) for this server: `gpupool login "
                 f"{server_desc(srv)}` pins its identity and turns TLS on")
        skip(range(2, 5), "no TLS session")
        return
    if srv.tls:
        rep.ok(names[1], info.tls_version if info is not None and info.tls_version else "TLS")
        rep.ok(names[2], _identity_ok(srv, info))
    else:
        rep.warn(names[1], f"plain TCP (tls = false, from {srv.sources.get('tls', 'default')}): "
                 "the token and all data cross the network unencrypted",
                 f"if the server serves TLS (gpupoold's default), `gpupool login {server_desc(srv)}` "
                 "pins its identity and turns TLS on")
        rep.skip(names[2], "plain TCP: no identity to check")
    if err is not None:
        fix = (f"upgrade gpupoold on {srv.host} to this client's version ({__version__})"
               if "speaks protocol 1.0" in str(err) else
               "check the address: it must be gpupoold's remoting port (not its HTTP port)")
        rep.fail(names[3], str(err), fix)
        skip(range(4, 5), "no usable answer")
        return
    assert info is not None
    if info.result == gp.GP_EVERSION or info.major != gp.MAJOR:
        if info.major > gp.MAJOR:
            fix = (f"install the gpupool client that matches the server ({info.server}): "
                   "pip install -U from the server's gpupool release")
        else:
            fix = (f"upgrade gpupoold on {srv.host} to a version that speaks protocol "
                   f"{gp.MAJOR}.{gp.MINOR} or a newer {gp.MAJOR}.x (this client is gpupool "
                   f"{__version__})")
        rep.fail(names[3], f"the server speaks protocol {info.major}.{info.minor}, this client "
                 f"{gp.MAJOR}.{gp.MINOR}" + (f": {info.message}" if info.message else ""), fix)
        skip(range(4, 5), "protocol mismatch")
        return
    rep.ok(names[3], f"server {info.major}.{info.minor}, client {gp.MAJOR}.{gp.MINOR} "
           f"({info.server})")
    if info.result == gp.GP_EAUTH:
        rep.fail(names[4], info.message or "the token was refused", _token_fix(srv))
        return
    if info.result != 0:
        rep.fail(names[4], f"refused ({info.result_name()}): {info.message}",
                 "see the message; `gpupool status` shows the server's state")
        return
    you = info.data.get("you") if isinstance(info.data.get("you"), Mapping) else {}
    rep.ok(names[4], f"{you.get('name') or 'anonymous'} ({you.get('role') or '?'}); "
           f"{info.gpus} GPU{'s' if info.gpus != 1 else ''}, {info.matching} meet the "
           f"requirements, {info.free_matching} free, {info.queue} queued")


# --------------------------------------------------------------------------------- the shims
def _preload_entries(env: Mapping[str, str]) -> list[str]:
    items = re.split(r"[:\s]+", env.get("LD_PRELOAD") or "")
    try:
        items += Path("/etc/ld.so.preload").read_text().split()
    except OSError:
        pass
    return [i for i in items if i]


def _check_loaded(rep: Report, soname: str, run_env: dict[str, str], expected: Path) -> bool:
    name = f"shim: {soname} under gpupool run"
    try:
        proc = subprocess.run([sys.executable, "-c", LOADED_SCRIPT, soname], env=run_env,
                              capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        rep.fail(name, "the check's Python subprocess failed", "run `gpupool run -- python -c "
                 f"'import ctypes; ctypes.CDLL(\"{soname}\")'` to see why")
        return False
    if "error" in result:
        rep.fail(name, f"cannot load it: {result['error']}",
                 f"reinstall the gpupool package (it ships {soname} in {expected.parent})")
        return False
    path = str(result.get("path") or "?")
    if result.get("version"):
        if result["version"] != __version__:
            rep.warn(name, f"{path} is gpupool {result['version']}, this command is "
                     f"{__version__}", "reinstall the gpupool package so both match")
        else:
            rep.ok(name, f"{path} (gpupool {result['version']})")
        return True
    resolved = Path(path).resolve()
    if soname == NVML_NAME and expected.exists() and resolved == expected.resolve():
        # Ours by its place (an NVML shim without the version export)
        rep.ok(name, f"{path} (gpupool's; it does not export {MARK})")
        return True
    preloaded = [e for e in _preload_entries(run_env)
                 if Path(e).name == Path(path).name or Path(e).resolve() == resolved]
    if resolved == expected.resolve():
        fix = (f"{path} is in gpupool's place but is not gpupool's shim: reinstall the gpupool "
               "package (pip install ./client), or point GPUPOOL_SHIM_DIR at gpupool's shims")
    elif preloaded:
        fix = (f"{preloaded[0]} is preloaded (LD_PRELOAD or /etc/ld.so.preload) and takes the "
               f"place of gpupool's {expected}: remove it from LD_PRELOAD")
    else:
        fix = (f"the loader finds {path} before gpupool's {expected}: check LD_LIBRARY_PATH, "
               "GPUPOOL_SHIM_DIR and the program's RPATH (`gpupool env` prints the setting "
               "gpupool run uses)")
    rep.fail(name, f"the loader picks {path}, which is not gpupool's (it does not export "
             f"{MARK})", fix)
    return False


# ------------------------------------------------------------------------- CUDA runtime check
def torch_cuda_version() -> tuple[str, str | None] | None:
    """(torch version, its CUDA runtime version or None for a CPU build) of the torch this
    interpreter would import, read from torch/version.py without importing torch; None when
    there is none."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        ver = re.search(r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        cuda = re.search(r"^cuda\s*(?::[^=]*)?=\s*(?:['\"]([^'\"]*)['\"]|None)", text, re.M)
        return (ver.group(1) if ver else "?", cuda.group(1) if cuda and cuda.group(1) else None)
    return None


def _parse_cuda(text: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_runtime(rep: Report, probes: list[Probe]) -> None:
    name = "CUDA runtime vs the server's driver"
    found = torch_cuda_version()
    if found is None:
        rep.ok(name, f"no PyTorch in this Python ({sys.executable}): nothing to compare (a "
               "program's own CUDA runtime must not be newer than the server's driver)")
        return
    version, runtime = found
    if runtime is None:
        rep.warn(name, f"PyTorch {version} is a CPU-only build: it will not use any GPU",
                 "install a CUDA build of PyTorch (pip install torch; see pytorch.org for the "
                 "CUDA variants)")
        return
    rt = _parse_cuda(runtime)
    drivers = []
    for p in probes:
        if not p.ok or p.info is None:
            continue
        srv = p.info.data.get("server") if isinstance(p.info.data.get("server"), Mapping) else {}
        v = srv.get("cuda_driver_version")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            drivers.append((p.server.written, (v // 1000, v % 1000 // 10)))
    if rt is None or not drivers:
        rep.skip(name, f"PyTorch {version} uses CUDA {runtime}; no server reported its "
                 "driver's CUDA version")
        return
    for addr, drv in drivers:
        d_text, r_text = f"{drv[0]}.{drv[1]}", f"{rt[0]}.{rt[1]}"
        if rt[0] > drv[0]:
            rep.fail(f"{name} ({addr})", f"PyTorch {version} needs CUDA {r_text}, the "
                     f"server's driver supports CUDA {d_text}: a newer major version cannot run",
                     f"install a PyTorch built for CUDA {drv[0]}.x or older (pip install torch "
                     f"--index-url https://download.pytorch.org/whl/cu{drv[0]}{drv[1]}), or "
                     "ask the server's operator to update its NVIDIA driver")
        elif rt > drv:
            rep.warn(f"{name} ({addr})", f"PyTorch {version} uses CUDA {r_text}, the server's "
                     f"driver supports {d_text}: it works through CUDA minor version "
                     "compatibility, except for features that need the newer driver (PTX JIT)",
                     "if a kernel fails to load, use a PyTorch built for CUDA "
                     f"{d_text} or update the server's driver")
        else:
            rep.ok(f"{name} ({addr})", f"PyTorch {version} uses CUDA {r_text}, the server's "
                   f"driver supports {d_text}")


# --------------------------------------------------------------------------------- round trip
def _check_round_trip(rep: Report, cfg: ClientConfig, probes: list[Probe],
                      run_env: dict[str, str]) -> None:
    name = "round trip"
    usable = [p for p in probes if p.ok and p.info is not None and p.info.matching > 0]
    if not usable:
        rep.skip(name, "no server answered with a GPU that meets the requirements")
        return
    if not any(p.info is not None and p.info.free_matching > 0 for p in usable):
        queued = sum(p.info.queue for p in usable if p.info is not None)
        rep.warn(name, f"skipped: no GPU is free now ({queued} queued); the round trip would "
                 "wait in the queue", "run `gpupool doctor` again when `gpupool status` shows a "
                 "free GPU")
        return
    limit = ROUND_TRIP_TIMEOUT + (cfg.connect_timeout or 0)
    try:
        proc = subprocess.run([sys.executable, "-c", ROUND_TRIP_SCRIPT], env=run_env,
                              capture_output=True, text=True, timeout=limit,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        rep.fail(name, f"no result within {limit:.0f} s", "`gpupool status` shows whether the "
                 "GPU is busy; GPUPOOL_LOG=debug gpupool run -- ... shows each step")
        return
    try:
        result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        result = {"ok": False, "error": f"the check's subprocess exited with {proc.returncode}"}
    said = " / ".join(line.strip() for line in proc.stderr.strip().splitlines()[-3:])
    if not result.get("ok"):
        detail = str(result.get("error") or "failed")
        if said:
            detail += f" (the shim said: {said})"
        rep.fail(name, detail, "the shim's message above says what to do; GPUPOOL_LOG=debug "
                 "shows every step")
        return
    lease = result.get("lease") if isinstance(result.get("lease"), Mapping) else {}
    where = f" on {lease.get('server')}" if lease.get("server") else ""
    rep.ok(name, f"{result.get('device', '?')}{where}: cuInit + context "
           f"{result.get('init_ms', 0):.0f} ms, 1 MiB there and back "
           f"{result.get('copy_ms', 0):.1f} ms, data intact")


# ---------------------------------------------------------------------------------- the command
def cmd_doctor(env: Mapping[str, str]) -> int:
    rep = Report()
    try:
        cfg = load(env, warn=lambda msg: rep.warn("config", msg))
    except ConfigError as exc:
        rep.fail("config", str(exc), "fix the file or variable named in the message (`gpupool "
                 "config` shows the settings and where each comes from)")
        return 1
    where = f"{cfg.file} ({cfg.file_reason})" if cfg.file else cfg.file_reason
    if not cfg.servers:
        rep.fail("config", f"{where}: no GPU server configured",
                 "`gpupool login HOST:PORT`, or set GPUPOOL_SERVER=host:port")
        return 1
    rep.ok("config", f"{where}; {len(cfg.servers)} server{'s' if len(cfg.servers) != 1 else ''}"
           + (" (GPUPOOL_SERVER)" if cfg.sources.get("servers") == "GPUPOOL_SERVER" else ""))
    timeout = max(probe_limit(cfg), min(cfg.connect_timeout, 10.0))
    probes = probe_all(cfg, timeout)
    for p in probes:
        _check_server(rep, p)
    try:
        run_env = client_env(env)
    except ShimNotFound as exc:
        rep.fail(f"shim: {SHIM_NAME} under gpupool run", str(exc),
                 "reinstall the gpupool package (pip install ./client)")
        shim_ok = False
    else:
        lib = Path(run_env["LD_LIBRARY_PATH"].split(":")[0])
        shim_ok = _check_loaded(rep, SHIM_NAME, run_env, lib / SHIM_NAME)
        _check_loaded(rep, NVML_NAME, run_env, lib / NVML_NAME)
    _check_runtime(rep, probes)
    if shim_ok:
        _check_round_trip(rep, cfg, probes, run_env)
    else:
        rep.skip("round trip", "gpupool's libcuda.so.1 is not the one programs load")
    print()
    if rep.failed:
        print(f"gpupool doctor: {rep.failed} check{'s' if rep.failed != 1 else ''} FAILED"
              + (f", {rep.warned} warning{'s' if rep.warned != 1 else ''}" if rep.warned else ""))
        return 1
    print("gpupool doctor: all checks passed" + (f" ({rep.warned} warning"
                                                 f"{'s' if rep.warned != 1 else ''})"
                                                 if rep.warned else ""))
    return 0
