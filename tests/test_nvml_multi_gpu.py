"""The NVML shim and several GPUs (issue 37, item 4; docs/multi-gpu.md, "NVML"), under the real
pynvml against a gpupoold of 2 simulated GPUs.

- without a lease, both GPUs of the server are listed; between them peer access is unknown
  (NVML_P2P_STATUS_UNKNOWN: gpupool does not know the server's PCI tree) and their common
  ancestor is the widest level inside one machine (NVML_TOPOLOGY_SYSTEM); a device reaches
  itself (OK, NVML_TOPOLOGY_INTERNAL). Every pair answers: NCCL's NVML set-up fails otherwise.
- GPUs of two servers: no peer access (NVML_P2P_STATUS_NOT_SUPPORTED) and no common ancestor
  (NVML_ERROR_NOT_SUPPORTED): they are not in one machine.
- a process holding a lease lists its lease's GPUs in CUDA's order, each with CUDA's UUID and
  PCI bus id (NCCL looks its GPU up in NVML by the bus id CUDA gives), found by that bus id;
  also when it initialised NVML before its lease (as PyTorch does): its next nvmlInit lists the
  lease.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from conftest import GpupoolServer, run_client

P2P_STATUS_OK, P2P_STATUS_NOT_SUPPORTED, P2P_STATUS_UNKNOWN = 0, 5, 6
TOPOLOGY_INTERNAL, TOPOLOGY_SYSTEM = 0, 50


def run_py(server: GpupoolServer, code: str, env: dict[str, str] | None = None) -> Any:
    proc: subprocess.CompletedProcess[str] = run_client(
        [sys.executable, "-c", textwrap.dedent(code)], env=env or server.client_env(), timeout=120)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1])


PAIRS = """
    def pairs(n):
        hs = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
        out = {}
        for i, a in enumerate(hs):
            for j, b in enumerate(hs):
                try:
                    level = n.nvmlDeviceGetTopologyCommonAncestor(a, b)
                except n.NVMLError_NotSupported:
                    level = "not supported"
                out[f"{i}{j}"] = [n.nvmlDeviceGetP2PStatus(a, b, k) for k in (0, 1, 3)] + [level]
        return out
"""

LISTING = PAIRS + """
    import json, pynvml as n
    n.nvmlInit()
    hs = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
    print(json.dumps({"uuids": [n.nvmlDeviceGetUUID(h) for h in hs], "pairs": pairs(n)}))
"""

LEASE = PAIRS + """
    import ctypes, json, pynvml as n
    n.nvmlInit()  # before the lease, as PyTorch's device count does: the servers' GPUs
    before = n.nvmlDeviceGetCount()
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    count = ctypes.c_int()
    assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
    devs = []
    for i in range(count.value):
        dev, bus, uuid = ctypes.c_int(), ctypes.create_string_buffer(32), (ctypes.c_ubyte * 16)()
        assert cuda.cuDeviceGet(ctypes.byref(dev), i) == 0
        assert cuda.cuDeviceGetPCIBusId(bus, 32, dev) == 0
        assert cuda.cuDeviceGetUuid(uuid, dev) == 0
        h = bytes(uuid).hex()
        devs.append({"bus": bus.value.decode(),
                     "uuid": f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"})
    n.nvmlInit()
    nv = []
    for i in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(i)
        nv.append({"uuid": n.nvmlDeviceGetUUID(h), "bus": n.nvmlDeviceGetPciInfo(h).busId,
                   "by_bus": n.nvmlDeviceGetIndex(
                       n.nvmlDeviceGetHandleByPciBusId(devs[i]["bus"]))})
    print(json.dumps({"before": before, "cuda": devs, "nvml": nv, "pairs": pairs(n)}))
"""


def test_nvml_pairs_and_the_lease_in_cudas_order(start_daemon: Any, native_build: Path) -> None:
    server = start_daemon(simulated=2, build_dir=native_build)
    api = server.get_json("/api/v1/gpus")["gpus"]
    listing = run_py(server, LISTING)
    assert listing["uuids"] == [g["uuid"] for g in api]
    ok_self = [P2P_STATUS_OK] * 3 + [TOPOLOGY_INTERNAL]
    unknown = [P2P_STATUS_UNKNOWN] * 3 + [TOPOLOGY_SYSTEM]
    assert listing["pairs"] == {"00": ok_self, "11": ok_self, "01": unknown, "10": unknown}

    lease = run_py(server, LEASE)
    cuda, nvml = lease["cuda"], lease["nvml"]
    assert lease["before"] == 2  # no lease yet: the server's GPUs
    assert len(nvml) == len(cuda) >= 1
    for i, (c, v) in enumerate(zip(cuda, nvml, strict=True)):
        assert v["uuid"].lower() == c["uuid"].lower(), (i, c, v)
        assert v["by_bus"] == i, (i, c, v)
        assert v["bus"].lower().endswith(c["bus"].lower()[-7:]), (i, c, v)
    assert lease["pairs"]["00"] == ok_self
    assert {g["uuid"].lower() for g in api} >= {v["uuid"].lower() for v in nvml}


def test_nvml_gpus_of_two_servers_share_nothing(start_daemon: Any, native_build: Path,
                                                tmp_path: Path) -> None:
    one, two = (start_daemon(build_dir=native_build) for _ in range(2))
    config = tmp_path / "client.toml"
    config.write_text("".join(
        f'[[servers]]\naddress = "{s.address}"\ntoken = "{s.token}"\n'
        f'tls_fingerprint = "{s.fingerprint}"\n\n' for s in (one, two)))
    env = one.client_env({"GPUPOOL_CONFIG": str(config)})
    for var in ("GPUPOOL_SERVER", "GPUPOOL_TOKEN", "GPUPOOL_TLS_FINGERPRINT"):
        env.pop(var)
    listing = run_py(one, LISTING, env)
    assert len(listing["uuids"]) == 2, listing
    apart = [P2P_STATUS_NOT_SUPPORTED] * 3 + ["not supported"]
    assert listing["pairs"]["01"] == listing["pairs"]["10"] == apart, listing
    assert listing["pairs"]["00"] == [P2P_STATUS_OK] * 3 + [TOPOLOGY_INTERNAL]
