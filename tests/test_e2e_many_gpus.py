"""End to end: a server of 32 simulated GPUs (issue 34, item 3). Up to 15 worked; from 16 on,
the 16th GPU's PCI bus (0x108) was no bus number, every GPU's simulated-device config listed it
as a peer, the config reader refused the line and every start-up scrub failed: all GPUs
quarantined. Now every GPU starts free, with a UUID of its own and a valid PCI address (GPUs 15
and up in the next PCI domains), and a client is served on GPUs past the first domain.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from conftest import wait_until
from test_e2e_leases import MIB, facts, gpu_states, hold_gpu  # noqa: F401  (a fixture)

COUNT = 32
PCI_BUS_ID = re.compile(r"^([0-9A-F]{8}):([0-9A-F]{2}):([0-9A-F]{2})\.0$")


def test_a_server_of_32_simulated_gpus(start_daemon: Any, native_build: Path,
                                       hold_gpu: Path) -> None:  # noqa: F811
    server = start_daemon("--simulated", str(COUNT), build_dir=native_build, simulated=None)
    # Each GPU is scrubbed at start: free means its simulated device took its config.
    wait_until("32 GPUs scrubbed and free", lambda: gpu_states(server) == ["free"] * COUNT,
               timeout=60)
    gpus = server.get_json("/api/v1/gpus")["gpus"]
    assert [g["index"] for g in gpus] == list(range(COUNT))
    uuids = [g["uuid"] for g in gpus]
    assert len(set(uuids)) == COUNT
    addresses = []
    for g in gpus:
        m = PCI_BUS_ID.match(g["pci_bus_id"])
        assert m, g
        domain, bus, device = (int(x, 16) for x in m.groups())
        assert domain <= 0xFFFF and bus <= 0xFF and device <= 0x1F, g
        addresses.append((domain, bus, device))
    assert len(set(addresses)) == COUNT
    assert {a[0] for a in addresses} == {0, 1, 2}  # 15 GPUs a domain
    assert "QUARANTINED" not in server.log_text()
    assert not re.search(r"scrub of GPU \d+ failed", server.log_text())
    # Two clients at once on GPUs of the second and third domains (each one's device reports
    # that GPU's UUID: its worker's simulated device read that GPU's config).
    wanted = (16, COUNT - 1)
    clients = [subprocess.Popen([str(hold_gpu), str(MIB), "300", str(i + 1)],
                                env=server.client_env({"GPUPOOL_GPU": str(i)}),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL) for i in wanted]
    for i, proc in zip(wanted, clients, strict=True):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"client on GPU {i} failed ({proc.returncode}):\n{out}\n{err}"
        f = facts(out)
        assert f["exact"] == "1" and f["nonzero_before"] == "0", f
        assert f["uuid"] == uuids[i].replace("GPU-", "").replace("-", "")
    wait_until("both leases ended and scrubbed", lambda: sorted(
        (r["gpu_index"], r["scrub_ok"]) for r in server.get_json(
            "/api/v1/leases?state=ended&limit=10")["leases"]) == [(16, True), (COUNT - 1, True)],
        timeout=60)
