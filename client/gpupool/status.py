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


def _lease_gpus(lease: Mapping[str, Any], gpus: list[Any]) -> list[Any]:
    """Every GPU a lease is on, device 0 first: the reply's list (protocol 1.7), else the GPUs
    whose view names it, else its one GPU; [] while detached."""
    listed = lease.get("gpus")
    if isinstance(listed, list) and listed:
        return listed
    on = [g.get("index") for g in gpus if isinstance(g, Mapping)
          and isinstance(g.get("lease"), Mapping) and g["lease"].get("id") == lease.get("id")]
    return on or ([lease["gpu"]] if lease.get("gpu") is not None else [])


def _lease_where(lease: Mapping[str, Any], gpus: list[Any]) -> str:
    """Where a lease is: its GPU, every GPU of a lease of several (issue 37), or detached while
    idle."""
    on = [str(i) for i in _lease_gpus(lease, gpus)]
    if len(on) > 1:
        return f"on GPUs {', '.join(on)}"
    if lease.get("gpu") is not None:
        return f"on GPU {lease.get('gpu')}"
    return ("detached while idle (its memory waits on the server; its next call takes a GPU "
            "again)")


def _shares(gpu: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A shared GPU's shares (issue 32): {"max", "closed", "leases": [...]}; None when the GPU
    is not shared or the server does not say (protocol 1.6)."""
    shares = gpu.get("shares")
    return shares if isinstance(shares, Mapping) else None


def _share_leases(shares: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [x for x in shares.get("leases") or [] if isinstance(x, Mapping)]


def _share_of(gpu: Mapping[str, Any], lease_id: Any) -> Mapping[str, Any] | None:
    """The share lease `lease_id` holds on this GPU, None when it holds none."""
    shares = _shares(gpu)
    if shares is None:
        return None
    return next((x for x in _share_leases(shares) if x.get("id") == lease_id), None)


def _lease_share(gpus: list[Any], lease_id: Any) -> Mapping[str, Any] | None:
    """The share lease `lease_id` holds on any of these GPUs, None when it is no share."""
    for g in gpus:
        share = _share_of(g, lease_id) if isinstance(g, Mapping) else None
        if share is not None:
            return share
    return None


def _holder(gpu: Mapping[str, Any], leases: list[Any], mine: set[Any]) -> str:
    """Who holds a GPU: its shares' count on a shared GPU; the lease's token and client, and
    for a lease of several GPUs which ones (issue 37); "-" for nobody."""
    shares = _shares(gpu)
    held = _share_leases(shares) if shares is not None else []
    if shares is not None and held:
        me = " [me]" if any(x.get("id") in mine for x in held) else ""
        return f"{len(held)} of {shares.get('max', '?')} shares{me}"
    # (a shared GPU without shares may be leased whole: by a request without a memory size)
    index = gpu.get("index")
    lease = next((x for x in leases if isinstance(x, Mapping)
                  and index in (x.get("gpus") or [])), None)
    if lease is None:
        lease = gpu.get("lease") if isinstance(gpu.get("lease"), Mapping) else None
    if lease is None:
        return "-"
    holder = f"{lease.get('token') or '?'} ({_client(lease.get('client'))})"
    if lease.get("id") in mine:
        holder += " [me]"
    on = lease.get("gpus") or []
    if len(on) > 1:
        holder += f", lease {lease.get('id')} on GPUs {', '.join(str(i) for i in on)}"
    return holder


def share_lines(gpus: list[Any]) -> list[str]:
    """The shares of each shared GPU that holds any: holder, memory used of the quota, GPU
    time (issue 32)."""
    lines = []
    for g in gpus:
        shares = _shares(g) if isinstance(g, Mapping) else None
        held = _share_leases(shares) if shares is not None else []
        if shares is None or not held:
            continue
        closed = ", closed to new shares" if shares.get("closed") else ""
        lines.append(f"  GPU {g.get('index', '?')} shares: {len(held)} of "
                     f"{shares.get('max', '?')}{closed}")
        for x in held:
            me = " [me]" if x.get("mine") else ""
            busy = x.get("busy_s")
            time_s = f", {busy:.1f} s GPU time" if isinstance(busy, (int, float)) else ""
            lines.append(f"    lease {x.get('id')}: {x.get('token') or '?'} "
                         f"({_client(x.get('client'))}){me}, {gib(x.get('memory_used'))} "
                         f"of {gib(x.get('memory_quota'))} quota{time_s}")
    return lines


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
        all_leases = [x for x in data.get("leases") or [] if isinstance(x, Mapping)]
        for g in data.get("gpus") or []:
            holder = _holder(g, all_leases, mine)
            used, total = _memory(g)
            rows.append((str(g.get("index", "?")), _gpu_name(g), _state(g), holder,
                         f"{gib(used) if used is not None else '?'} / {gib(total)}",
                         number(_live(g).get("gpu_util"), " %")))
        if rows:
            print(table(("GPU", "NAME", "STATE", "HOLDER", "MEMORY USED / TOTAL", "UTIL"), rows,
                        right=(5,), indent="  "))
        else:
            print("  no GPUs")
        for line in share_lines(data.get("gpus") or []):
            print(line)
        leases = [lease for lease in data.get("leases") or [] if isinstance(lease, Mapping)
                  and lease.get("mine")]
        if leases:
            print("  My leases:")
            for lease in leases:
                c = lease.get("client") if isinstance(lease.get("client"), Mapping) else {}
                where = _lease_where(lease, data.get("gpus") or [])
                share = _lease_share(data.get("gpus") or [], lease.get("id"))
                if share is not None:
                    where += f", a share of {gib(share.get('memory_quota'))}"
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
    gpus, processes, servers, shares = [], [], [], []
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
            own = p.info.data.get("gpus") or []
            for lease in p.info.data.get("leases") or []:
                if not isinstance(lease, Mapping) or not lease.get("mine"):
                    continue
                # One row per GPU of the lease (issue 37); a detached lease: one, no GPU.
                for index in _lease_gpus(lease, own) or [None]:
                    gpu = by_index.get(index, {})
                    share = _share_of(gpu, lease.get("id"))
                    used = share.get("memory_used") if share is not None else _memory(gpu)[0]
                    processes.append({"server": p.server.written, "gpu": index,
                                      "gpus": _lease_gpus(lease, own),
                                      "lease": lease.get("id"), "used_memory": used,
                                      "memory_quota": (share.get("memory_quota")
                                                       if share is not None else None),
                                      "client": lease.get("client"),
                                      "duration_s": lease.get("duration_s")})
            for g in own:
                got = _shares(g) if isinstance(g, Mapping) else None
                for x in _share_leases(got) if got is not None else []:
                    shares.append({"server": p.server.written, "gpu": g.get("index"),
                                   "lease": x.get("id"), "token": x.get("token"),
                                   "client": x.get("client"), "mine": bool(x.get("mine")),
                                   "memory_used": x.get("memory_used"),
                                   "memory_quota": x.get("memory_quota"),
                                   "busy_s": x.get("busy_s")})
        servers.append(entry)
    return {"version": __version__, "time": time.time(), "servers": servers, "gpus": gpus,
            "processes": processes, "shares": shares}


def _cuda_version(v: Any) -> str:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        return "N/A"
    return f"{v // 1000}.{v % 1000 // 10}"


def _smi_state(gpu: Mapping[str, Any]) -> str:
    """The State column: a shared GPU's with its shares held and its capacity (issue 32)."""
    shares = _shares(gpu)
    if shares is None:
        return _state(gpu)
    held = len(_share_leases(shares))
    if not held and isinstance(gpu.get("lease"), Mapping):
        return f"{_state(gpu)} (whole)"  # a shared GPU leased whole, its shares drained
    return f"{_state(gpu)} ({held}/{shares.get('max', '?')} shares)"


def print_smi(view: dict[str, Any]) -> None:
    print(time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(view["time"])))
    rows = []
    for g in view["gpus"]:
        used, total = _memory(g)
        live = _live(g)
        power = number(live.get("power_w"), "W")
        limit = number(live.get("power_limit_w"), "W")
        rows.append((g["server"], str(g.get("index", "?")), _gpu_name(g), _smi_state(g),
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
    if view.get("shares"):
        srow = []
        for x in view["shares"]:
            me = " [me]" if x.get("mine") else ""
            busy = x.get("busy_s")
            srow.append((x["server"], str(x.get("gpu", "?")), str(x.get("lease", "?")),
                         f"{x.get('token') or '?'} ({_client(x.get('client'))}){me}",
                         f"{mib(x.get('memory_used'))} / {mib(x.get('memory_quota'))}",
                         f"{busy:.1f}s" if isinstance(busy, (int, float)) else "N/A"))
        print()
        print(boxed(("Server", "GPU", "Lease", "Holder", "Used / Quota", "GPU time"), srow,
                    right=(1, 2, 4, 5), title="Shares of shared GPUs:"))


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
