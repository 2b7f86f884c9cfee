"""`gpupool status` and `gpupool smi`: what the configured servers have, from their `info`."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from typing import Any

from gpupool import __version__
from gpupool.config import ClientConfig, ConfigError, load
from gpupool.fmt import boxed, duration, gib, mib, number, table
from gpupool.probe import Probe, probe_all

NO_SERVER = ("no GPU server configured: run `gpupool login HOST:PORT`, or set "
             "GPUPOOL_SERVER=host:port")


def load_or_report(env: Mapping[str, str]) -> ClientConfig | None:
    try:
        cfg = load(env)
    except ConfigError as exc:
        print(f"gpupool: error: {exc}", file=sys.stderr)
        return None
    if not cfg.servers:
        print(f"gpupool: error: {NO_SERVER}", file=sys.stderr)
        return None
    return cfg


def unusable(p: Probe) -> str:
    """How a server without an answer is labelled: "not trusted" when this client refused it
    (no pin, or not the pinned identity: nothing was sent), else "unreachable"."""
    return "not trusted" if p.error is not None and p.error.refused_by_us else "unreachable"


def probe_json(p: Probe) -> dict[str, Any]:
    out: dict[str, Any] = {"address": p.server.written, "reachable": p.info is not None,
                           "trusted": p.error is None or not p.error.refused_by_us,
                           "ok": p.ok, "error": p.problem() or None}
    if p.info is not None:
        i = p.info
        out.update({"result": i.result, "message": i.message, "server": i.server,
                    "protocol": f"{i.major}.{i.minor}", "tls": i.tls_version or None,
                    "identity": i.identity or None,
                    "gpus": i.gpus, "matching": i.matching, "free_matching": i.free_matching,
                    "queue": i.queue, "info": i.data})
    return out


def _live(gpu: Mapping[str, Any]) -> Mapping[str, Any]:
    live = gpu.get("live")
    return live if isinstance(live, Mapping) else {}


def _memory(gpu: Mapping[str, Any]) -> tuple[Any, Any]:
    live = _live(gpu)
    total = live.get("memory_total") or gpu.get("memory_total")
    return live.get("memory_used"), total


def _client(c: Any) -> str:
    if not isinstance(c, Mapping):
        return "?"
    who = f"{c.get('user') or '?'}@{c.get('host') or '?'}"
    return who


def _gpu_name(gpu: Mapping[str, Any]) -> str:
    name = str(gpu.get("name") or "?")
    if gpu.get("simulated") and "simulated" not in name.lower():
        name += " [simulated]"
    return name


def _state(gpu: Mapping[str, Any]) -> str:
    state = str(gpu.get("state") or "?")
    if gpu.get("draining") and state != "drained":
        state += " (draining)"
    return state


def _lease_where(lease: Mapping[str, Any], gpus: list[Any]) -> str:
    """Where a lease is: its GPU, every GPU of a lease of several (the GPUs whose view names
    it, issue 37), or detached while idle."""
    on = [str(g.get("index", "?")) for g in gpus if isinstance(g, Mapping)
          and isinstance(g.get("lease"), Mapping) and g["lease"].get("id") == lease.get("id")]
    if len(on) > 1:
        return f"on GPUs {', '.join(on)}"
    if lease.get("gpu") is not None:
        return f"on GPU {lease.get('gpu')}"
    return ("detached while idle (its memory waits on the server; its next call takes a GPU "
            "again)")


def _mine_ids(data: Mapping[str, Any]) -> set[Any]:
    return {lease.get("id") for lease in data.get("leases") or []
            if isinstance(lease, Mapping) and lease.get("mine")}


def _server_line(p: Probe) -> str:
    assert p.info is not None
    i = p.info
    data = i.data
    you = data.get("you") if isinstance(data.get("you"), Mapping) else {}
    checked = "pinned identity" if p.server.tls_fingerprint else "certificate verified"
    transport = f"{i.tls_version}, {checked}" if i.tls_version else "plain TCP"
    return (f"{p.server.written}: {i.server or 'gpupoold'} (protocol {i.major}.{i.minor}, "
            f"{transport}), you are {you.get('name') or '?'} ({you.get('role') or '?'})")


def print_status(probes: list[Probe]) -> None:
    fleets_shown: set[frozenset[str]] = set()
    for n, p in enumerate(probes):
        if n:
            print()
        if p.info is None:
            print(f"{p.server.written}: {unusable(p)}: {p.problem()}")
            continue
        if not p.ok:
            print(f"{p.server.written}: {p.info.server or 'gpupoold'} refused: {p.problem()}")
            continue
        print(_server_line(p))
        data = p.info.data
        mine = _mine_ids(data)
        rows = []
        for g in data.get("gpus") or []:
            lease = g.get("lease") if isinstance(g.get("lease"), Mapping) else None
            holder = "-"
            if lease is not None:
                holder = f"{lease.get('token') or '?'} ({_client(lease.get('client'))})"
                if lease.get("id") in mine:
                    holder += " [me]"
            used, total = _memory(g)
            rows.append((str(g.get("index", "?")), _gpu_name(g), _state(g), holder,
                         f"{gib(used) if used is not None else '?'} / {gib(total)}",
                         number(_live(g).get("gpu_util"), " %")))
        if rows:
            print(table(("GPU", "NAME", "STATE", "HOLDER", "MEMORY USED / TOTAL", "UTIL"), rows,
                        right=(5,), indent="  "))
        else:
            print("  no GPUs")
        leases = [lease for lease in data.get("leases") or [] if isinstance(lease, Mapping)
                  and lease.get("mine")]
        if leases:
            print("  My leases:")
            for lease in leases:
                c = lease.get("client") if isinstance(lease.get("client"), Mapping) else {}
                where = _lease_where(lease, data.get("gpus") or [])
                print(f"    lease {lease.get('id')} {where}: "
                      f"{c.get('program') or '?'} (pid {c.get('pid', '?')} on "
                      f"{c.get('host') or '?'}), for {duration(lease.get('duration_s'))}")
        else:
            print("  My leases: none")
        queue = [q for q in data.get("queue") or [] if isinstance(q, Mapping)]
        if queue:
            print(f"  Queue: {len(queue)} waiting")
            for q in queue:
                c = q.get("client") if isinstance(q.get("client"), Mapping) else {}
                me = " [me]" if q.get("mine") else ""
                print(f"    {q.get('position', '?')}. {q.get('token') or '?'} ({_client(c)}): "
                      f"{c.get('program') or '?'}, wants {q.get('request') or 'any GPU'}, "
                      f"waiting {duration(q.get('waiting_s'))}{me}")
        else:
            print("  Queue: empty")
        # A fleet's servers are often all configured (`gpupool login` pins them): its view
        # once, under the first of them.
        fleet = frozenset(str(g.get("server")) for g in data.get("fleet") or []
                          if isinstance(g, Mapping))
        if fleet and fleet in fleets_shown:
            print("  Fleet: as above")
            continue
        fleets_shown.add(fleet)
        for line in fleet_lines(data, p.info.queue):
            print(line)


def fleet_lines(data: Mapping[str, Any], waiting: int | None = None) -> list[str]:
    """The fleet the server belongs to, one line per server and per GPU ([] without a fleet);
    `waiting`: the info reply's count of clients waiting, which in a fleet is the fleet's."""
    gpus = [g for g in data.get("fleet") or [] if isinstance(g, Mapping)]
    if not gpus:
        return []
    servers: dict[str, list[Mapping[str, Any]]] = {}
    for g in gpus:
        servers.setdefault(str(g.get("server")), []).append(g)
    free = sum(1 for g in gpus if g.get("state") == "free" and g.get("available"))
    queue = "" if waiting is None else f", {waiting} waiting in its one queue"
    lines = [f"  Fleet: {len(servers)} servers, {len(gpus)} GPUs, {free} free{queue} "
             "(a client of any of them is sent to the first free GPU)"]
    for name, its in servers.items():
        first = its[0]
        this = " (this one)" if first.get("this") else ""
        lines.append(f"    {name}{this} at {first.get('address') or '?'}: "
                     f"{first.get('server_state') or '?'}")
        for g in its:
            lease = (f", lease {g.get('lease_id')} ({g.get('token') or '?'})"
                     if g.get("lease_id") else "")
            out = "" if g.get("available") else " [unavailable]"
            lines.append(f"      GPU {g.get('index', '?')} {g.get('name') or '?'}: "
                         f"{g.get('state') or '?'}{lease}{out}")
    return lines


def cmd_status(as_json: bool, env: Mapping[str, str]) -> int:
    cfg = load_or_report(env)
    if cfg is None:
        return 1
    probes = probe_all(cfg)
    if as_json:
        print(json.dumps({"servers": [probe_json(p) for p in probes]}, indent=2))
    else:
        print_status(probes)
    return 0 if all(p.ok for p in probes) else 1


# ------------------------------------------------------------------------------------ smi
def smi_json(probes: list[Probe]) -> dict[str, Any]:
    gpus, processes, servers = [], [], []
    probed = {p.server.written for p in probes}  # a fleet server also probed: its own rows
    for p in probes:
        entry: dict[str, Any] = {"address": p.server.written, "reachable": p.info is not None,
                                 "trusted": p.error is None or not p.error.refused_by_us,
                                 "ok": p.ok, "error": p.problem() or None}
        if p.ok:
            assert p.info is not None
            srv = p.info.data.get("server") if isinstance(p.info.data.get("server"), Mapping) \
                else {}
            entry.update({"server": p.info.server, "driver_version": srv.get("driver_version"),
                          "cuda_driver_version": srv.get("cuda_driver_version")})
            by_index = {}
            for g in p.info.data.get("gpus") or []:
                gpus.append({"server": p.server.written, **g})
                by_index[g.get("index")] = g
            # The other servers of its fleet (protocol 1.3): their GPUs, without live values.
            for g in p.info.data.get("fleet") or []:
                if isinstance(g, Mapping) and not g.get("this") and g.get(
                        "address") not in probed and not any(
                        x.get("fleet_server") == g.get("server") and x.get("index") == g.get(
                            "index") for x in gpus):
                    gpus.append({"server": g.get("address") or g.get("server"),
                                 "fleet_server": g.get("server"), "index": g.get("index"),
                                 "name": g.get("name"), "memory_total": g.get("memory_total"),
                                 "state": g.get("state") if g.get("available")
                                 else "unavailable", "live": {}})
            for lease in p.info.data.get("leases") or []:
                if isinstance(lease, Mapping) and lease.get("mine"):
                    used, _ = _memory(by_index.get(lease.get("gpu"), {}))
                    processes.append({"server": p.server.written, "gpu": lease.get("gpu"),
                                      "lease": lease.get("id"), "used_memory": used,
                                      "client": lease.get("client"),
                                      "duration_s": lease.get("duration_s")})
        servers.append(entry)
    return {"version": __version__, "time": time.time(), "servers": servers, "gpus": gpus,
            "processes": processes}


def _cuda_version(v: Any) -> str:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        return "N/A"
    return f"{v // 1000}.{v % 1000 // 10}"


def print_smi(view: dict[str, Any]) -> None:
    print(time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(view["time"])))
    rows = []
    for g in view["gpus"]:
        used, total = _memory(g)
        live = _live(g)
        power = number(live.get("power_w"), "W")
        limit = number(live.get("power_limit_w"), "W")
        rows.append((g["server"], str(g.get("index", "?")), _gpu_name(g), _state(g),
                     f"{mib(used)} / {mib(total)}", number(live.get("gpu_util"), "%"),
                     number(live.get("temperature_c"), "C"), f"{power} / {limit}"))
    answering = sum(1 for s in view["servers"] if s["ok"])
    title = (f"gpupool smi {view['version']}    servers: {answering} of "
             f"{len(view['servers'])} answering    GPUs: {len(view['gpus'])}")
    headers = ("Server", "GPU", "Name", "State", "Memory-Usage", "GPU-Util", "Temp",
               "Pwr:Usage/Cap")
    print(boxed(headers, rows, right=(1, 4, 5, 6, 7), title=title, empty="No GPUs found"))
    for s in view["servers"]:
        if s["ok"]:
            print(f"  {s['address']}: {s['server']}, driver {s.get('driver_version') or 'N/A'}, "
                  f"CUDA {_cuda_version(s.get('cuda_driver_version'))}")
        else:
            label = ("not trusted" if not s["trusted"] else
                     "unreachable" if not s["reachable"] else "refused")
            print(f"  {s['address']}: {label}: {s['error']}")
    print()
    prow = []
    for proc in view["processes"]:
        c = proc["client"] if isinstance(proc.get("client"), Mapping) else {}
        prow.append((proc["server"], str(proc.get("gpu", "?")), str(proc.get("lease", "?")),
                     str(c.get("pid", "?")), str(c.get("host") or "?"),
                     str(c.get("program") or "?"), mib(proc.get("used_memory"))))
    headers = ("Server", "GPU", "Lease", "PID", "Host", "Process name", "GPU Memory")
    print(boxed(headers, prow, right=(1, 2, 3, 6), title="Processes (my leases):",
                empty="No running processes found"))


def cmd_smi(as_json: bool, env: Mapping[str, str]) -> int:
    cfg = load_or_report(env)
    if cfg is None:
        return 1
    view = smi_json(probe_all(cfg))
    if as_json:
        print(json.dumps(view, indent=2))
    else:
        print_smi(view)
    return 0 if all(s["ok"] for s in view["servers"]) else 1
