#!/usr/bin/env python3
"""The link model: what a real workload's step would cost through gpupool over a given network.

    python bench/link_model.py [--only NAME,...] [--steps N] [--warmup N]
                               [--native-ms NAME=MS,...] [--measure-native]
                               [--link NAME=RTT_US:GBIT_S ...] [--overhead-us US]
                               [--counts JSON] [--json PATH] [--markdown PATH] [--log-dir DIR]
                               [--profile DIR]

1. Counts. Each workload of bench/torch_workloads.py runs, one child process each, through the
   shim against a gpupoold started here on ONE SIMULATED GPU IN COUNT MODE (worker/sim/README.md:
   a benchmark-only mode in which any kernel is accepted and not run; no GPU needed). The shim
   counts what the program sends (GPUPOOL_CALL_COUNTS=1, client/shim/call_counts.c); the child
   takes the counts before and after its timed steps. Per step (a training step, a generated
   token): synchronous round trips (calls whose caller waits for the server's answer), kernel
   launches, graph launches, other calls sent without waiting, asynchronous device-to-host copies,
   bytes each way, module image bytes; and the same per protocol op. The numbers are the call
   stream of the real program: host code, cuBLAS, cuDNN, Triton and the caching allocator run as
   on a GPU; only the kernels do not (their outputs are garbage, so agreement is not checked).
   --counts JSON reads the counts of an earlier --json instead of running the workloads.

2. Model. For a link with round-trip time RTT and bandwidth B, per step:

       remote = max(native, streamed_bytes / B) + round_trips * (RTT + overhead) + waited_bytes / B

   waited_bytes are the bytes (both ways) of the round trips, streamed_bytes all the others
   (launches, copies and other calls sent without waiting, asynchronous device-to-host data);
   overhead is gpupool's own cost per round trip (shim, worker, server), measured as the gpupool
   round trip minus the raw TCP round trip of the same run (docs/benchmarks.md: 5.1 us on the
   2-vCPU VM, 5.8 us on the H200 machine; default 6 us). Assumptions: (a) what is sent without
   waiting streams while the GPU works (the shim batches it, the worker queues it), so it costs
   time only when the link cannot carry it within the GPU's time for the step; (b) each round
   trip's latency adds to the step in full (the caller waits, and the GPU has nothing queued
   behind the answer); (c) a round trip's own bytes add at link rate, the two directions summed
   (a conservative bound for a full-duplex link); (d) module images go once per process (the
   worker caches them): shown as a one-time cost, not per step; (e) the native step time is the
   real GPU's, and the call stream on the simulated H100 is the GPU's (libraries may choose other
   kernels for other GPUs: counts can differ slightly). ratio = remote / native. Without a
   native time the waited and streamed milliseconds are printed, and the shortest native step
   time at which the ratio would meet the suite's target (1.10; generation 1.30).

3. Native step times: --native-ms NAME=MS,... (e.g. from a GPU run of bench/torch_workloads.py),
   or --measure-native to run each workload natively on the local GPU (needs one) and use its
   time per step.

The calls that cost the most: per workload, the protocol ops with the most added time per step on
the 25 GbE link (docs/protocol.md says which CUDA calls send each op). --profile DIR keeps the
shim's own profile of each child (GPUPOOL_PROFILE, docs/user-guide.md): the same counts over the
whole run, per op and per CUDA entry point, with the time spent in each.

Exit status: 0 when every selected workload was counted; 1 otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The totals of gpupool_call_counts() (client/shim/call_counts.c); "ops" holds the same per op.
TOTAL_KEYS = ("round_trips", "launches", "graph_launches", "detached", "frames", "bytes_sent",
              "bytes_received", "waited_bytes", "module_bytes")
OP_KEYS = ("frames", "round_trips", "detached", "sent", "received", "waited_bytes")
EMPTY_COUNTS: dict[str, Any] = {**{k: 0 for k in TOTAL_KEYS}, "ops": {}}
DEFAULT_OVERHEAD_US = 6.0
REFERENCE_LINK = "25gbe"  # the link on which the costliest calls are named


# ==================================================================================== counting
def read_counts(lib: str = "libcuda.so.1") -> dict[str, Any]:
    """The shim's counts since it loaded, in this process (the library torch loaded: dlopen of the
    same soname gives the same one). RuntimeError saying why when they cannot be had."""
    try:
        cuda = ctypes.CDLL(lib)
    except OSError as exc:
        raise RuntimeError(f"cannot load {lib}: {exc}") from exc
    try:
        fn = cuda.gpupool_call_counts
    except AttributeError:
        raise RuntimeError(f"{lib} is not gpupool's shim (no gpupool_call_counts): run the program "
                           "through gpupool (`gpupool run`, or the shim first on LD_LIBRARY_PATH)") from None
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    need = fn(None, 0)
    buf = ctypes.create_string_buffer(need + 1)
    fn(buf, need + 1)
    counts: dict[str, Any] = json.loads(buf.value.decode())
    if not counts.pop("enabled", False):
        raise RuntimeError("the shim is not counting calls: set GPUPOOL_CALL_COUNTS=1 in the program's "
                           "environment (read when the library loads)")
    return counts


def diff_counts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """after - before, totals and per op (ops that sent nothing in between are left out)."""
    out: dict[str, Any] = {k: after.get(k, 0) - before.get(k, 0) for k in TOTAL_KEYS}
    ops: dict[str, dict[str, int]] = {}
    for name, a in after.get("ops", {}).items():
        b = before.get("ops", {}).get(name, {})
        d = {k: a.get(k, 0) - b.get(k, 0) for k in OP_KEYS}
        if d["frames"]:
            ops[name] = d
    out["ops"] = ops
    return out


def per_step(counts: dict[str, Any], steps: int) -> dict[str, Any]:
    """Counts divided by the number of steps (floats)."""
    if steps <= 0:
        raise ValueError("steps must be positive")
    out: dict[str, Any] = {k: counts.get(k, 0) / steps for k in TOTAL_KEYS}
    out["ops"] = {name: {k: v / steps for k, v in op.items()} for name, op in counts.get("ops", {}).items()}
    return out


# ======================================================================================= model
@dataclass(frozen=True)
class Link:
    name: str
    title: str
    rtt_us: float
    gbit_s: float

    @property
    def bytes_per_s(self) -> float:
        return self.gbit_s * 1e9 / 8


# loopback: the raw TCP figures of the machines that ran the benchmarks (docs/benchmarks.md): a
# 16-byte ping-pong takes 15-22 us, a bulk stream moves 3.1-4.3 GB/s.
DEFAULT_LINKS = (
    Link("loopback", "loopback (20 us, 28 Gbit/s)", 20.0, 28.0),
    Link("25gbe", "25 GbE (10 us)", 10.0, 25.0),
    Link("100gbe", "100 GbE (5 us)", 5.0, 100.0),
    Link("1gbe", "1 GbE office LAN (200 us)", 200.0, 1.0),
)


def parse_link(text: str) -> Link:
    """NAME=RTT_US:GBIT_S, e.g. 'dc=12:40'."""
    name, _, rest = text.partition("=")
    rtt, _, gbit = rest.partition(":")
    try:
        link = Link(name.strip(), f"{name.strip()} ({float(rtt):g} us)", float(rtt), float(gbit))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--link {text!r}: expected NAME=RTT_US:GBIT_S, e.g. dc=12:40") from None
    if not link.name or link.rtt_us < 0 or link.gbit_s <= 0:
        raise argparse.ArgumentTypeError(f"--link {text!r}: a name, RTT >= 0 us and bandwidth > 0 Gbit/s")
    return link


def waited_ms(step: dict[str, Any], link: Link, overhead_us: float = DEFAULT_OVERHEAD_US) -> float:
    """Milliseconds a step waits on round trips over `link`: latency and the round trips' bytes."""
    latency_s = step["round_trips"] * (link.rtt_us + overhead_us) * 1e-6
    return (latency_s + step["waited_bytes"] / link.bytes_per_s) * 1e3


def streamed_ms(step: dict[str, Any], link: Link) -> float:
    """Milliseconds the link needs for what a step sends and receives without waiting."""
    streamed = step["bytes_sent"] + step["bytes_received"] - step["waited_bytes"]
    return streamed / link.bytes_per_s * 1e3


def predict(step: dict[str, Any], native_ms: float | None, link: Link,
            overhead_us: float = DEFAULT_OVERHEAD_US) -> dict[str, Any]:
    """One workload's per-step counts on one link (the model of the module docstring):
    {waited_ms, streamed_ms, added_ms, remote_ms, ratio}; without a native time, added_ms counts
    the streamed time in full (the GPU time it could hide behind is unknown) and remote_ms and
    ratio are None."""
    wait, stream = waited_ms(step, link, overhead_us), streamed_ms(step, link)
    out: dict[str, Any] = {"waited_ms": wait, "streamed_ms": stream}
    if native_ms is None:
        return {**out, "added_ms": wait + stream, "remote_ms": None, "ratio": None}
    if native_ms <= 0:
        raise ValueError("the native step time must be positive")
    remote = max(native_ms, stream) + wait
    return {**out, "added_ms": remote - native_ms, "remote_ms": remote, "ratio": remote / native_ms}


def native_needed_ms(step: dict[str, Any], link: Link, target: float,
                     overhead_us: float = DEFAULT_OVERHEAD_US) -> float:
    """The shortest native step time (ms) at which the predicted ratio meets `target` (> 1)."""
    if target <= 1.0:
        return math.inf
    wait, stream = waited_ms(step, link, overhead_us), streamed_ms(step, link)
    # remote/native <= target  <=>  max(native, stream) + wait <= target * native
    return max(wait / (target - 1.0), (stream + wait) / target)


def costliest(step: dict[str, Any], link: Link, overhead_us: float = DEFAULT_OVERHEAD_US,
              top: int = 3) -> list[dict[str, Any]]:
    """The ops that cost the most link time per step on `link`, most first: [{op, round_trips,
    bytes, waited_ms, streamed_ms, ms}] (ms = waited + streamed; the streamed part costs time only
    where the link is slower than the GPU, see predict())."""
    rows = []
    for name, op in step.get("ops", {}).items():
        one = {"round_trips": op["round_trips"], "bytes_sent": op["sent"], "bytes_received": op["received"],
               "waited_bytes": op["waited_bytes"]}
        rows.append({"op": name, "round_trips": op["round_trips"], "bytes": op["sent"] + op["received"],
                     "waited_ms": waited_ms(one, link, overhead_us), "streamed_ms": streamed_ms(one, link),
                     "ms": waited_ms(one, link, overhead_us) + streamed_ms(one, link)})
    rows.sort(key=lambda r: (-r["ms"], r["op"]))
    return [r for r in rows[:top] if r["ms"] > 0]


def module_seconds(module_bytes: float, link: Link) -> float:
    """The one-time cost of sending the module images over `link`."""
    return module_bytes / link.bytes_per_s


# ==================================================================================== running
def count_workloads(names: list[str], steps: int | None, warmup: int | None, build_dir: Path,
                    log_dir: Path | None, child_timeout: float,
                    profile_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """Run each workload through a count-mode gpupoold; {name: child result} (with "counts", or
    "error"). With profile_dir, each child also writes the shim's profile (GPUPOOL_PROFILE) there as
    NAME.txt."""
    import torch_workloads as tw

    missing = [str(build_dir / f) for f in ("client/libcuda.so.1", "gpupool-worker", "libgpupool-sim.so")
               if not (build_dir / f).is_file()]
    if missing:
        raise RuntimeError(f"not built: {', '.join(missing)} (run make)")
    args = argparse.Namespace(device="cuda", smoke=False, steps=None, warmup=warmup, quick=False,
                              compile_backend=None, child_timeout=child_timeout, count=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-linkmodel-"))
    daemon = tw.RealGpuDaemon(build_dir, log_dir, count_mode=True)
    tw.log(f"gpupoold on {daemon.address}, serving {daemon.gpu_name}")
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            args.steps = steps if steps is not None else default_steps(tw.REGISTRY[name].steps)
            env = daemon.client_env(tw.base_env(tmp, "count"))
            env["GPUPOOL_CALL_COUNTS"] = "1"
            if profile_dir is not None:  # the shim's own table of the run (GPUPOOL_PROFILE)
                env["GPUPOOL_PROFILE"] = str(profile_dir / f"{name}.txt")
            daemon.wait_free()
            results[name] = tw.run_child([name], "count", args, env, False, log_dir)[name]
    except KeyboardInterrupt as exc:
        tw.log(f"interrupted ({exc}): reporting the workloads that finished")
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def default_steps(suite_steps: int) -> int:
    """Counted steps: the call stream repeats every step, so a few suffice (a tenth of the suite's
    timed steps, 4 to 16) and keep the 2-CPU machine's run short."""
    return max(4, min(16, suite_steps // 10))


def measure_native(names: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Time per step (ms) of each workload run natively on the local GPU."""
    import torch_workloads as tw

    ns = argparse.Namespace(device="cuda", smoke=False, steps=None, warmup=None, quick=False,
                            compile_backend=None, child_timeout=args.child_timeout, count=False)
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-linkmodel-native-"))
    out: dict[str, float] = {}
    try:
        for name in names:
            res = tw.run_child([name], "native", ns, tw.base_env(tmp, "native"), False, args.log_dir)[name]
            if res.get("rate"):
                out[name] = 1000.0 / res["rate"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def parse_native(text: str | None) -> dict[str, float]:
    """'mlp=5.3,gpt=56' -> {'mlp': 5.3, 'gpt': 56.0}."""
    out: dict[str, float] = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        name, _, ms = item.partition("=")
        try:
            value = float(ms)
        except ValueError:
            raise SystemExit(f"link_model: --native-ms {item!r}: expected NAME=MILLISECONDS") from None
        if value <= 0:
            raise SystemExit(f"link_model: --native-ms {item!r}: the time must be positive")
        out[name.strip()] = value
    return out


# ===================================================================================== report
def fmt_count(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 or v == int(v) else f"{v:.2f}"


def fmt_mb(b: float) -> str:
    return f"{b / 1e6:.3f}" if b < 1e7 else f"{b / 1e6:.1f}"


def rows_for(results: dict[str, dict[str, Any]], order: list[str], targets: dict[str, float],
             native: dict[str, float], links: list[Link], overhead_us: float) -> list[dict[str, Any]]:
    rows = []
    for name in order:
        res = results.get(name, {})
        row: dict[str, Any] = {"workload": name, "target": targets.get(name, 1.10)}
        if "error" in res or "counts" not in res:
            row["error"] = res.get("error") or "not run"
            rows.append(row)
            continue
        steps = int(res["steps"])
        step = per_step(res["counts"]["steps"], steps)
        row.update(steps=steps, warmup=res.get("warmup"), per_step=step,
                   setup=res["counts"]["setup"], native_ms=native.get(name),
                   device_name=res.get("device_name"))
        row["links"] = {}
        for link in links:
            pred = predict(step, native.get(name), link, overhead_us)
            pred["native_needed_ms"] = native_needed_ms(step, link, row["target"], overhead_us)
            pred["module_s"] = module_seconds(row["setup"]["module_bytes"] + step["module_bytes"], link)
            row["links"][link.name] = pred
        ref = next((lk for lk in links if lk.name == REFERENCE_LINK), links[0])
        row["costliest"] = {"link": ref.name, "ops": costliest(step, ref, overhead_us)}
        rows.append(row)
    return rows


def counts_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["workload", "steps counted", "round trips", "launches", "graph launches", "other calls",
            "async D2H", "MB sent", "MB received", "module MB (set-up)", "module MB/step"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["workload"], "-", "FAILED: " + first_line(r["error"])] + [""] * (len(head) - 3))
            continue
        s = r["per_step"]
        other = s["frames"] - s["round_trips"] - s["launches"] - s["graph_launches"] - s["detached"]
        body.append([r["workload"], str(r["steps"]), fmt_count(s["round_trips"]), fmt_count(s["launches"]),
                     fmt_count(s["graph_launches"]), fmt_count(other), fmt_count(s["detached"]),
                     fmt_mb(s["bytes_sent"]), fmt_mb(s["bytes_received"]),
                     fmt_mb(r["setup"]["module_bytes"]), fmt_mb(s["module_bytes"])])
    return head, body


def ratio_table(rows: list[dict[str, Any]], links: list[Link]) -> tuple[list[str], list[list[str]]]:
    head = ["workload", "native ms/step"] + [lk.title for lk in links]
    body = []
    for r in rows:
        if "error" in r:
            continue
        cells = [r["workload"], f"{r['native_ms']:.3g}" if r.get("native_ms") else "not given"]
        for lk in links:
            p = r["links"][lk.name]
            if p["ratio"] is None:
                cells.append(f"waits {p['waited_ms']:.3g} ms, streams {p['streamed_ms']:.3g} ms; "
                             f"{r['target']:.2f}x from {p['native_needed_ms']:.3g} ms native")
            else:
                cells.append(f"{p['ratio']:.2f}x (+{p['added_ms']:.3g} ms)")
        body.append(cells)
    return head, body


def costly_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["workload", f"calls that cost the most per step on {REFERENCE_LINK} (op: round trips, ms)"]
    body = []
    for r in rows:
        if "error" in r:
            continue
        ops = r["costliest"]["ops"]
        text = "; ".join(f"{o['op']}: {fmt_count(o['round_trips'])} round trips ({o['waited_ms']:.3g} ms)"
                         if o["round_trips"] else
                         f"{o['op']}: {fmt_mb(o['bytes'])} MB streamed ({o['streamed_ms']:.3g} ms)"
                         for o in ops) or "none (no round trips, no bytes)"
        body.append([r["workload"], text])
    return head, body


def first_line(text: str, width: int = 100) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[:width - 3] + "..."


def markdown(rows: list[dict[str, Any]], links: list[Link], meta: dict[str, Any]) -> str:
    def table(head: list[str], body: list[list[str]]) -> list[str]:
        return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body])

    out = [f"### Link model ({meta['date']}, commit {meta['commit']})", "",
           f"Machine: {meta['machine']}; counted on {meta['device']}; torch {meta['torch']}; "
           f"overhead per round trip {meta['overhead_us']:g} us. Command: `{meta['command']}`.", "",
           "Per step (training step or generated token), counted in count mode (no kernel runs):", ""]
    out += table(*counts_table(rows))
    out += ["", "Predicted time per step through gpupool / natively (native times: "
            f"{meta['native_source']}):", ""]
    out += table(*ratio_table(rows, links))
    out += [""]
    out += table(*costly_table(rows))
    return "\n".join(out) + "\n"


# ======================================================================================== main
def main(argv: list[str] | None = None) -> int:
    import torch_workloads as tw
    from benchlib import text_table

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help=f"comma-separated workloads (of {', '.join(tw.REGISTRY)})")
    ap.add_argument("--steps", type=int, help="counted steps per workload (default: a tenth of the suite's, 4 to 16)")
    ap.add_argument("--warmup", type=int, help="steps before counting (default: the suite's warm-up)")
    ap.add_argument("--native-ms", help="native time per step, NAME=MS,... (e.g. from a GPU run of torch_workloads)")
    ap.add_argument("--native-source", default="",
                    help="where the --native-ms times come from (printed with them)")
    ap.add_argument("--measure-native", action="store_true",
                    help="run each workload natively on the local GPU for its step time")
    ap.add_argument("--link", type=parse_link, action="append", default=[],
                    help="another link, NAME=RTT_US:GBIT_S (replaces a default of the same name)")
    ap.add_argument("--overhead-us", type=float, default=DEFAULT_OVERHEAD_US,
                    help=f"gpupool's cost per round trip beyond the link's (default {DEFAULT_OVERHEAD_US:g})")
    ap.add_argument("--counts", type=Path, help="model the counts of an earlier --json instead of counting")
    ap.add_argument("--json", type=Path, help="write counts and predictions as JSON here")
    ap.add_argument("--markdown", type=Path, help="write the section for docs/benchmarks.md here")
    ap.add_argument("--log-dir", type=Path, help="keep each child's output and gpupoold's log here")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="write each workload's GPUPOOL_PROFILE table (calls, round trips, bytes and time "
                         "per protocol op and CUDA entry point, the whole run) here as NAME.txt")
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build", help="native build (default build/)")
    ap.add_argument("--child-timeout", type=float, default=900.0, help="seconds one workload may take")
    args = ap.parse_args(argv)
    if args.overhead_us < 0:
        raise SystemExit("link_model: --overhead-us must be >= 0")
    workloads = tw.select(args.only)
    names = [w.name for w in workloads]
    targets = {w.name: w.target for w in workloads}
    links = [lk for lk in DEFAULT_LINKS if lk.name not in {x.name for x in args.link}] + args.link
    native = parse_native(args.native_ms)
    unknown = sorted(set(native) - set(tw.REGISTRY))
    if unknown:
        raise SystemExit(f"link_model: --native-ms names unknown workloads: {', '.join(unknown)}")
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.profile:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)

    if args.counts:
        saved = json.loads(args.counts.read_text())
        results = {r["workload"]: r["result"] for r in saved["workloads"]}
        device = saved["meta"].get("device", "?")
        torch_version = saved["meta"].get("torch", "?")
    else:
        try:
            results = count_workloads(names, args.steps, args.warmup, args.build_dir.resolve(),
                                      args.log_dir, args.child_timeout, args.profile)
        except (RuntimeError, OSError) as exc:
            tw.log(f"cannot count: {exc}")
            return 2
        device = next((r.get("device_name") for r in results.values() if r.get("device_name")), "?")
        torch_version = next((r.get("torch") for r in results.values() if r.get("torch")), "?")
    native_source = args.native_source or ("--native-ms" if native else "none given")
    if args.measure_native:
        measured = measure_native(names, args)
        native.update(measured)
        native_source = f"measured here natively ({tw.gpu_driver()[0] or 'GPU'})"
    rows = rows_for(results, names, targets, native, links, args.overhead_us)

    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": tw.machine(), "commit": tw.commit(), "device": device, "torch": torch_version,
            "overhead_us": args.overhead_us, "native_source": native_source,
            "links": [lk.__dict__ for lk in links],
            "command": "python bench/link_model.py " + " ".join(argv)}
    print("\nPer step, counted in count mode (kernels not run: outputs are not checked):")
    print(text_table(*counts_table(rows)))
    print(f"\nPredicted remote/native time per step (overhead {args.overhead_us:g} us a round trip; "
          f"native times: {native_source}):")
    print(text_table(*ratio_table(rows, links)))
    print()
    print(text_table(*costly_table(rows)))
    md = markdown(rows, links, meta)
    print()
    print(md)
    if args.markdown:
        args.markdown.write_text(md)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "workloads": [
            {**row, "result": {k: v for k, v in results.get(row["workload"], {}).items() if k != "values"}}
            for row in rows]}, indent=2) + "\n")
    failed = [r["workload"] for r in rows if "error" in r]
    if failed:
        tw.log(f"not counted: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
