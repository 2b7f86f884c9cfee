#!/usr/bin/env python3
"""The PyTorch workload suite: real training and inference, natively and through gpupool.

    python bench/torch_workloads.py [--only NAME,...] [--steps N] [--quick] [--json PATH]
                                    [--markdown PATH] [--log-dir DIR] [--build-dir DIR]
    python bench/torch_workloads.py --device cpu --smoke [--json PATH]     (CI: the harness only)

Each workload runs twice in one invocation, each time in a child process of its own
(`--child NAME`, which prints one JSON line):
  native   on the local GPU, without the shim;
  remote   through gpupool over loopback on the same GPU: a gpupoold started here in real-GPU mode
           (`simulated = 0`, `gpus = [0]`, `reset_policy = "never"`: a lent GPU is never reset),
           the child with the environment `gpupool run` gives a program (our libcuda.so.1 first on
           LD_LIBRARY_PATH, GPUPOOL_SERVER, GPUPOOL_TOKEN, GPUPOOL_CONFIG=none).
For each it prints steps/s native and remote, the time ratio remote/native against the target of
the project (1.10; generation 1.30), and whether the two runs agree: the per-step losses (or tokens
and logits) must be bit-identical where the workload is deterministic (fixed seeds, deterministic
algorithms, cuDNN benchmark off), within the workload's stated relative tolerance otherwise.
Warm-up steps (compilation, cuDNN/cuBLAS set-up, graph capture) are not timed; the timed region
is bracketed by synchronisations.

Workloads (REGISTRY): mlp, cnn, gpt, generate, compile, cuda_graph; on a GPU generate's A/B (generate_variants.py).

--device cpu --smoke runs each workload's model tiny for 2 steps on the CPU, twice (the second
run stands in for the remote one: no gpupool, no GPU) and checks the harness: agreement, JSON,
ratios. Workloads that need CUDA (cuda_graph) are reported as skipped with the reason.
--perturb-remote perturbs the second run's weights, so that the agreement check must fail.

Count mode (bench/link_model.py uses it; no GPU needed): CountDaemon is a gpupoold on a simulated
GPU in its benchmark-only count mode (worker/sim/README.md: any kernel is accepted and not run),
and `--child NAME --count` runs a workload through the shim with GPUPOOL_CALL_COUNTS=1 and adds to
its JSON line what the shim sent (client/shim/call_counts.c) during set-up and warm-up and during
the timed steps. Its outputs are garbage (no kernel ran): agreement does not apply.

Exit status: 0 when every selected workload ran (or was skipped in smoke mode) and the two runs
agreed; 1 otherwise. Ratio targets are reported, not enforced: this is a benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402 - bench/ is not a package
import generate_variants  # noqa: E402

# The environment of a gpupoold whose simulated GPU runs in count mode (worker/sim/README.md).
COUNT_MODE_ENV = {"GPUPOOL_SIM_COUNT_ONLY": "true", "GPUPOOL_BENCH_COUNT_MODE": "1"}
TRAIN_TARGET = 1.10
GENERATION_TARGET = 1.30
SEED = 1234
CUBLAS_WORKSPACE = ":4096:8"  # deterministic cuBLAS (set before the child's CUDA start)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} torch_workloads] {msg}", file=sys.stderr, flush=True)


# ===================================================================================== workloads
# Everything below up to the harness runs in the child process only: the parent never imports
# torch (it must not touch the GPU while the children measure it).

@dataclass
class Ctx:
    """What a workload's build function gets: torch, the device, the size, and where to record."""

    torch: Any
    device: str
    smoke: bool
    perturb: bool
    compile_backend: str
    max_steps: int  # warm-up + timed steps (generation sizes its KV cache with it)
    records: list[Any] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def record(self, t: Any) -> None:
        """Keep a step's output (loss, token, logit) on the device: no synchronisation here."""
        self.records.append(t.detach().float().reshape(-1).clone())

    def prepare(self, model: Any) -> Any:
        """Move a freshly seeded model to the device; --perturb nudges its first weight."""
        model = model.to(self.device)
        if self.perturb:
            with self.torch.no_grad():
                next(model.parameters()).add_(1e-3)
        return model


Step = Callable[[int], None]


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    unit: str  # what one step is, per second
    target: float  # ratio remote/native, at most
    steps: int  # timed steps on the GPU
    warmup: int
    exact: bool  # bit-identical outputs expected
    rtol: float  # otherwise: largest relative difference allowed
    build: Callable[[Ctx], Step]
    cpu_skip: str = ""  # why the smoke mode cannot run it on the CPU ("" = it can)
    why_tolerance: str = ""


def _batches(ctx: Ctx, n: int, make: Callable[[Any], Any]) -> list[Any]:
    """n batches made by make(generator) with a seeded CPU generator (same data on every device)."""
    gen = ctx.torch.Generator().manual_seed(SEED + 1)
    return [make(gen) for _ in range(n)]


# ---------------------------------------------------------------------------------- 1. MLP fp32
def build_mlp(ctx: Ctx) -> Step:
    torch = ctx.torch
    nn = torch.nn
    d_in, hidden, depth, classes, batch = (16, 32, 2, 5, 8) if ctx.smoke else (1024, 4096, 4, 1000, 512)
    layers: list[Any] = []
    width = d_in
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    model = ctx.prepare(nn.Sequential(*layers, nn.Linear(width, classes)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    # Batches come from pinned host memory, copied each step as a data loader's would be.
    xs = _batches(ctx, 4, lambda g: torch.randn(batch, d_in, generator=g))
    ys = _batches(ctx, 4, lambda g: torch.randint(0, classes, (batch,), generator=g))
    if ctx.cuda:
        xs = [x.pin_memory() for x in xs]
        ys = [y.pin_memory() for y in ys]

    def step(i: int) -> None:
        x = xs[i % len(xs)].to(ctx.device, non_blocking=True)
        y = ys[i % len(ys)].to(ctx.device, non_blocking=True)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ctx.record(loss)

    return step


# --------------------------------------------------------------------- 2. CNN, cuDNN, NHWC, AMP
def build_cnn(ctx: Ctx) -> Step:
    torch = ctx.torch
    nn = torch.nn
    image, widths, classes, batch = (16, (8, 16), 5, 4) if ctx.smoke else (64, (64, 128, 256), 100, 128)

    def block(cin: int, cout: int, stride: int) -> Any:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                             nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    stages: list[Any] = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                         nn.ReLU(inplace=True)]
    for cin, cout in zip(widths, widths[1:]):
        stages.append(block(cin, cout, 2))
    stages.append(block(widths[-1], widths[-1], 1))
    model = nn.Sequential(*stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], classes))
    model = ctx.prepare(model).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # AMP: fp16 with loss scaling on the GPU (the classic recipe); the CPU autocasts to bf16.
    amp_dtype = torch.float16 if ctx.cuda else torch.bfloat16
    device_type = "cuda" if ctx.cuda else "cpu"
    scaler = torch.amp.GradScaler(device_type, enabled=ctx.cuda)
    xs = [x.to(ctx.device).contiguous(memory_format=torch.channels_last)
          for x in _batches(ctx, 4, lambda g: torch.randn(batch, 3, image, image, generator=g))]
    ys = [y.to(ctx.device) for y in _batches(ctx, 4, lambda g: torch.randint(0, classes, (batch,), generator=g))]
    ctx.notes["amp_dtype"] = str(amp_dtype).removeprefix("torch.")

    def step(i: int) -> None:
        with torch.autocast(device_type, dtype=amp_dtype):
            loss = nn.functional.cross_entropy(model(xs[i % 4]), ys[i % 4])
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        ctx.record(loss)

    return step


# ----------------------------------------------------------------- 3./4./5. a GPT-2 style model
@dataclass(frozen=True)
class GptShape:
    layers: int
    heads: int
    dim: int
    vocab: int
    seq: int
    batch: int


GPT2_SMALL = GptShape(layers=12, heads=12, dim=768, vocab=50257, seq=512, batch=8)
GPT_TINY = GptShape(layers=2, heads=2, dim=32, vocab=101, seq=16, batch=2)


def make_gpt(torch: Any, shape: GptShape) -> Any:
    """A GPT-2 shaped decoder (pre-LN, learned positions, tied embeddings, no dropout), random init.
    forward(idx) gives logits; decode(idx, pos, cache) runs new tokens against a KV cache."""
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(shape.dim)
            self.qkv = nn.Linear(shape.dim, 3 * shape.dim)
            self.proj = nn.Linear(shape.dim, shape.dim)
            self.ln2 = nn.LayerNorm(shape.dim)
            self.fc = nn.Linear(shape.dim, 4 * shape.dim)
            self.out = nn.Linear(4 * shape.dim, shape.dim)

        def attend(self, x: Any, cache: tuple[Any, Any] | None, pos: int) -> Any:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(shape.dim, dim=2)
            q, k, v = (z.view(b, t, shape.heads, -1).transpose(1, 2) for z in (q, k, v))
            if cache is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                kc, vc = cache
                kc[:, :, pos:pos + t] = k
                vc[:, :, pos:pos + t] = v
                k, v = kc[:, :, :pos + t], vc[:, :, :pos + t]
                y = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
            return self.proj(y.transpose(1, 2).reshape(b, t, shape.dim))

        def forward(self, x: Any, cache: tuple[Any, Any] | None = None, pos: int = 0) -> Any:
            x = x + self.attend(x, cache, pos)
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(shape.vocab, shape.dim)
            self.wpe = nn.Embedding(shape.seq, shape.dim)
            self.blocks = nn.ModuleList(Block() for _ in range(shape.layers))
            self.ln_f = nn.LayerNorm(shape.dim)
            self.head = nn.Linear(shape.dim, shape.vocab, bias=False)
            self.head.weight = self.wte.weight
            for name, p in self.named_parameters():
                if name.endswith("weight") and p.dim() == 2:
                    nn.init.normal_(p, 0.0, 0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, idx: Any, caches: list[tuple[Any, Any]] | None = None, pos: int = 0) -> Any:
            t = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(pos, pos + t, device=idx.device))
            for n, blk in enumerate(self.blocks):
                x = blk(x, None if caches is None else caches[n], pos)
            return self.head(self.ln_f(x))

    return Gpt()


def gpt_train_step(ctx: Ctx, shape: GptShape, model: Any, amp: bool) -> Step:
    torch = ctx.torch
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    data = [d.to(ctx.device) for d in
            _batches(ctx, 4, lambda g: torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g))]
    device_type = "cuda" if ctx.cuda else "cpu"

    def step(i: int) -> None:
        tokens = data[i % len(data)]
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, shape.vocab),
                                                 tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ctx.record(loss)

    return step


def build_gpt(ctx: Ctx) -> Step:
    shape = GPT_TINY if ctx.smoke else GPT2_SMALL
    ctx.notes["shape"] = shape.__dict__
    ctx.notes["amp_dtype"] = "bfloat16"
    return gpt_train_step(ctx, shape, ctx.prepare(make_gpt(ctx.torch, shape)), amp=True)


def build_generate(ctx: Ctx) -> Step:
    """Greedy decoding, batch 1, one token per step against a KV cache, as a chat server does:
    each token is read back (an end-of-text check) before the next is computed."""
    torch = ctx.torch
    prompt_len = 4 if ctx.smoke else 32
    base = GPT_TINY if ctx.smoke else GPT2_SMALL
    shape = GptShape(base.layers, base.heads, base.dim, base.vocab, prompt_len + ctx.max_steps + 1, 1)
    dtype = torch.float32 if ctx.smoke else torch.bfloat16
    model = ctx.prepare(make_gpt(torch, shape)).to(dtype).eval()
    head_dim = shape.dim // shape.heads
    caches = [(torch.zeros(1, shape.heads, shape.seq, head_dim, device=ctx.device, dtype=dtype),
               torch.zeros(1, shape.heads, shape.seq, head_dim, device=ctx.device, dtype=dtype))
              for _ in range(shape.layers)]
    prompt = _batches(ctx, 1, lambda g: torch.randint(0, shape.vocab, (1, prompt_len), generator=g))[0]
    eos = shape.vocab - 1
    state: dict[str, Any] = {"pos": prompt_len}
    with torch.inference_mode():
        logits = model(prompt.to(ctx.device), caches, 0)
    state["next"] = logits[:, -1].argmax(-1, keepdim=True)
    ctx.notes.update(prompt_tokens=prompt_len, dtype=str(dtype).removeprefix("torch."))

    def step(i: int) -> None:
        with torch.inference_mode():
            token = state["next"]
            logits = model(token, caches, state["pos"])[:, -1]
            state["next"] = logits.argmax(-1, keepdim=True)
            state["pos"] += 1
            ctx.record(token)
            ctx.record(logits.max())
            if int(token.item()) == eos:  # a real server stops here; the suite keeps going
                ctx.notes["eos_seen"] = True

    return step


def build_compile(ctx: Ctx) -> Step:
    """A smaller GPT training step (fp32) through torch.compile (inductor and Triton on the GPU)."""
    torch = ctx.torch
    shape = GptShape(2, 2, 32, 101, 16, 2) if ctx.smoke else GptShape(4, 8, 512, 8192, 256, 16)
    model = ctx.prepare(make_gpt(torch, shape))
    ctx.notes.update(backend=ctx.compile_backend, shape=shape.__dict__)
    inductor = getattr(torch, "_inductor", None)
    config = getattr(inductor, "config", None)
    if config is not None and hasattr(config, "deterministic"):  # not in every torch version
        config.deterministic = True
    compiled = torch.compile(model, backend=ctx.compile_backend)
    return gpt_train_step(ctx, shape, compiled, amp=False)


# ------------------------------------------------------------------------------- 6. CUDA graph
def build_cuda_graph(ctx: Ctx) -> Step:
    """A whole MLP training step (forward, backward, SGD with momentum) captured once, replayed."""
    torch = ctx.torch
    nn = torch.nn
    d_in, hidden, classes, batch = 512, 1024, 100, 64
    model = ctx.prepare(nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                      nn.ReLU(), nn.Linear(hidden, classes)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xs = [x.to(ctx.device) for x in _batches(ctx, 4, lambda g: torch.randn(batch, d_in, generator=g))]
    ys = [y.to(ctx.device) for y in _batches(ctx, 4, lambda g: torch.randint(0, classes, (batch,), generator=g))]
    static_x, static_y = xs[0].clone(), ys[0].clone()

    def train() -> Any:
        loss = nn.functional.cross_entropy(model(static_x), static_y)
        loss.backward()
        opt.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as the PyTorch docs do it
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            train()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = train()

    def step(i: int) -> None:
        static_x.copy_(xs[i % 4])
        static_y.copy_(ys[i % 4])
        graph.replay()
        ctx.record(static_loss)

    return step


REGISTRY: dict[str, Workload] = {w.name: w for w in (
    Workload("mlp", "MLP training, fp32 (Adam, pinned H2D batches)", "steps/s", TRAIN_TARGET,
             steps=200, warmup=20, exact=True, rtol=0.0, build=build_mlp),
    Workload("cnn", "small CNN training, cuDNN, channels-last, AMP fp16", "steps/s", TRAIN_TARGET,
             steps=100, warmup=10, exact=True, rtol=0.0, build=build_cnn),
    Workload("gpt", "GPT-2-small-shaped training step (bf16 autocast, AdamW)", "steps/s",
             TRAIN_TARGET, steps=30, warmup=5, exact=False, rtol=2e-3, build=build_gpt,
             why_tolerance="attention backward (flash/efficient SDPA) accumulates with atomics"),
    Workload("generate", "autoregressive generation, batch 1, KV cache, bf16", "tokens/s",
             GENERATION_TARGET, steps=128, warmup=8, exact=True, rtol=0.0, build=build_generate),
    Workload("compile", "torch.compile'd GPT training step, fp32", "steps/s", TRAIN_TARGET,
             steps=100, warmup=5, exact=False, rtol=1e-3, build=build_compile,
             why_tolerance="Triton kernels may pick other reduction configs when autotuned anew"),
    Workload("cuda_graph", "CUDA-graph replay of an MLP training step", "steps/s", TRAIN_TARGET,
             steps=500, warmup=20, exact=True, rtol=0.0, build=build_cuda_graph,
             cpu_skip="CUDA graphs need a CUDA device"),
)}
KNOWN: dict[str, Workload] = {**REGISTRY, **generate_variants.variants(REGISTRY["generate"])}


def run_one(torch: Any, spec: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Build one workload, run its warm-up and timed steps; its result (or error) as a dict."""
    out: dict[str, Any] = {"workload": spec.name, "device": args.device, "pid": os.getpid(),
                           "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    try:
        torch.manual_seed(SEED)
        if args.device == "cpu":
            torch.set_num_threads(1)  # the same reduction order in both runs, and cheap in CI
        else:
            out["device_name"] = torch.cuda.get_device_name(0)
            torch.cuda.reset_peak_memory_stats()
        steps = args.steps if args.steps is not None else spec.steps
        warmup = args.warmup if args.warmup is not None else spec.warmup
        ctx = Ctx(torch=torch, device=args.device, smoke=args.smoke, perturb=args.perturb,
                  compile_backend=args.compile_backend or ("aot_eager" if args.smoke else "inductor"),
                  max_steps=warmup + steps)
        sync = torch.cuda.synchronize if ctx.cuda else (lambda: None)
        counts = call_counter(args)
        t0 = time.perf_counter()
        step = spec.build(ctx)
        for i in range(warmup):
            step(i)
        sync()
        t1 = time.perf_counter()
        before = counts() if counts else None
        for i in range(warmup, warmup + steps):
            step(i)
        # Taken before the closing synchronisation: what the steps themselves sent.
        after = counts() if counts else None
        sync()
        t2 = time.perf_counter()
        if counts and before is not None and after is not None:
            import link_model  # bench/ is on sys.path (above)

            out["counts"] = {"setup": link_model.diff_counts(link_model.EMPTY_COUNTS, before),
                             "steps": link_model.diff_counts(before, after)}
        values = torch.cat(ctx.records).double().cpu().tolist() if ctx.records else []
        out.update(steps=steps, warmup=warmup, setup_s=t1 - t0, seconds=t2 - t1,
                   rate=steps / (t2 - t1) if t2 > t1 else None, unit=spec.unit, values=values,
                   notes=ctx.notes, perturbed=args.perturb)
        if ctx.cuda:
            out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    except Exception as exc:  # reported to the parent, which shows it
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    return out


def call_counter(args: argparse.Namespace) -> Callable[[], dict[str, Any]] | None:
    """With --count: a function returning the shim's call counts now (bench/link_model.py)."""
    if not getattr(args, "count", False):
        return None
    import link_model

    link_model.read_counts()  # fails now, with the reason, rather than after the warm-up
    return link_model.read_counts


def child_main(args: argparse.Namespace) -> int:
    """Run the --child workloads (comma-separated) in this process, one JSON line each."""
    names = [n for n in args.child.split(",") if n]
    unknown = [n for n in names if n not in KNOWN]
    if unknown or not names:
        print(json.dumps({"error": f"unknown workload(s): {unknown or args.child!r}"}), flush=True)
        return 2
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failed = False
    for name in names:
        out = run_one(torch, KNOWN[name], args)
        failed = failed or "error" in out
        print(json.dumps(out), flush=True)
    return 1 if failed else 0


# ======================================================================================= harness

@dataclass
class Agreement:
    ok: bool
    bitexact: bool
    max_rel_diff: float | None
    detail: str


def compare(a: list[float], b: list[float], exact: bool, rtol: float) -> Agreement:
    """Do two runs' per-step outputs agree? Bit-exact when `exact`, else within `rtol`."""
    if not a or not b:
        return Agreement(False, False, None, "no outputs recorded")
    if len(a) != len(b):
        return Agreement(False, False, None, f"{len(a)} outputs against {len(b)}")
    if any(math.isnan(x) or math.isnan(y) for x, y in zip(a, b)):
        return Agreement(False, False, None, "NaN in the outputs")
    bitexact = all(x == y for x, y in zip(a, b))
    worst = max(abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b))
    if exact:
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        detail = ("bit-exact" if bitexact else
                  f"not bit-exact: first difference at output {first} ({a[first]!r} != {b[first]!r}),"
                  f" max rel diff {worst:.3g}")
        return Agreement(bitexact, bitexact, worst, detail)
    ok = worst <= rtol
    detail = "bit-exact" if bitexact else f"max rel diff {worst:.3g} ({'within' if ok else 'over'} {rtol:g})"
    return Agreement(ok, bitexact, worst, detail)


def ratio_of(native_rate: float | None, remote_rate: float | None) -> float | None:
    """Time ratio remote/native (>1: gpupool is slower)."""
    if not native_rate or not remote_rate:
        return None
    return native_rate / remote_rate


def fmt_ratio(ratio: float | None, target: float) -> tuple[str, str]:
    """('1.04x', 'PASS') against a target like 1.10; ('n/a', 'n/a') without a ratio."""
    if ratio is None:
        return "n/a", "n/a"
    return f"{ratio:.2f}x", "PASS" if ratio <= target else "MISS"


def fmt_rate(rate: float | None) -> str:
    if rate is None:
        return "n/a"
    return f"{rate:.1f}" if rate >= 10 else f"{rate:.3f}"


# ------------------------------------------------------------------------------------ daemon
class RealGpuDaemon:
    """gpupoold serving the real GPU 0 on loopback, reset policy `never` (lent GPUs are never
    reset), its own temporary state directory; a user token for the remote children, which pin
    the identity it prints (TLS, gpupoold's default). allow_simulated (testing only): a machine
    without a GPU serves a simulated one (`fallback_to_simulated = true`; without it gpupoold
    refuses to start there). count_mode: one simulated GPU in the benchmark-only count mode
    instead (bench/link_model.py)."""

    def __init__(self, build_dir: Path, log_dir: Path | None, allow_simulated: bool = False,
                 count_mode: bool = False) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="gpupool-torchwl-"))
        self.build_dir = build_dir
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "protocol" / "python"),
                                             *filter(None, [env.get("PYTHONPATH")])])
        cfg = self.state / "gpupoold.toml"
        if count_mode:
            # One simulated GPU in the benchmark-only count mode (worker/sim/README.md): the
            # workers inherit these variables; without the second the simulated device refuses
            # the first.
            env.update(COUNT_MODE_ENV)
            allow_simulated = True
            cfg.write_text("simulated = 1\n")
        else:
            # Never reset: this is a lent GPU. Real mode: simulated = 0; only GPU 0. A simulated
            # GPU instead only when the caller accepts one (tests on a machine without a GPU).
            cfg.write_text('simulated = 0\ngpus = [0]\nreset_policy = "never"\n'
                           + ("fallback_to_simulated = true\n" if allow_simulated else ""))
        self.env = env
        cmd = [sys.executable, "-m", "gpupoold", "serve", "--config", str(cfg), "--listen",
               "127.0.0.1:0", "--http", "127.0.0.1:0", "--state-dir", str(self.state)]
        worker = build_dir / "gpupool-worker"
        if worker.is_file():
            cmd += ["--worker", str(worker)]
        self.log_path = (log_dir or self.state) / "gpupoold.log"
        log("starting " + " ".join(cmd[1:]))
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.address = self.http = ""
        identity: str | None | bool = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (self.address and self.http):
            text = self.log_path.read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("gpupoold: remoting on "):
                    self.address = line.split()[-1]
                if line.startswith("gpupoold: http on "):
                    self.http = line.split()[-1]
            identity = benchlib.identity_line(text)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        if not (self.address and self.http) or identity is False:
            text = self.log_path.read_text(errors="replace")  # before stop() removes the state
            self.stop()
            refusal = [ln for ln in text.splitlines() if ln.startswith("gpupoold: error: no GPU to serve")]
            if refusal:  # no GPU, and no fallback to a simulated one (allow_simulated)
                raise RuntimeError("gpupoold serves no real GPU here (no NVIDIA driver?): "
                                   + refusal[0][len("gpupoold: error: "):])
            what = "printed no identity line" if self.address and self.http else "did not start"
            raise RuntimeError(f"gpupoold {what}:\n" + text[-4000:])
        # The identity the remote children pin (None: tls = "off", they say plain TCP).
        self.fingerprint: str | None = identity or None
        made = subprocess.run([sys.executable, "-m", "gpupoold", "token", "create", "--name", "torchwl",
                               "--state-dir", str(self.state)], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        if made.returncode != 0:
            self.stop()
            raise RuntimeError(f"gpupoold token create failed:\n{made.stdout}{made.stderr}")
        self.token = made.stdout.strip().splitlines()[-1]
        self.admin = (self.state / "local-admin.token").read_text().strip()
        gpus = self.gpus()
        if not gpus or (any(g.get("simulated") for g in gpus) and not allow_simulated):
            self.stop()
            raise RuntimeError("gpupoold serves no real GPU here (no NVIDIA driver?): "
                               + ", ".join(f"{g.get('name')} (simulated: {g.get('simulated')})" for g in gpus))
        self.gpu_name = gpus[0].get("name", "?") + (" [count mode: kernels not run]" if count_mode else "")

    def gpus(self) -> list[dict[str, Any]]:
        host, port = self.http.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", "/api/v1/gpus", headers={"Authorization": f"Bearer {self.admin}"})
            return list(json.loads(conn.getresponse().read())["gpus"])
        finally:
            conn.close()

    def wait_free(self, timeout: float = 300) -> None:
        """Until GPU 0 is free with its worker started (after the start-up or post-lease scrub)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            g = self.gpus()[0]
            if g.get("state") == "free" and g.get("worker_ready", True):
                return
            if g.get("state") == "quarantined":
                raise RuntimeError(f"the GPU is quarantined: {g}")
            time.sleep(0.1)
        raise RuntimeError(f"the GPU did not become free within {timeout} s")

    def client_env(self, base: dict[str, str]) -> dict[str, str]:
        """What `gpupool run` gives a program: the shim first on LD_LIBRARY_PATH, server, token,
        and the daemon's identity pinned."""
        env = dict(base)
        for var in ("GPUPOOL_TLS", "GPUPOOL_TLS_FINGERPRINT", "GPUPOOL_TLS_CA"):
            env.pop(var, None)
        env.update(benchlib.trust_env(self.fingerprint))
        shim = str(self.build_dir / "client")
        rest = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and p != shim]
        env["LD_LIBRARY_PATH"] = ":".join([shim, *rest])
        env["GPUPOOL_SERVER"] = self.address
        env["GPUPOOL_TOKEN"] = self.token
        env["GPUPOOL_CONFIG"] = "none"
        return env

    def stop(self) -> None:
        benchlib.stop_process_group(self.proc, 60)
        self._log.close()
        # with the memory of a simulated GPU, had gpupoold fallen back to one (allow_simulated)
        benchlib.remove_state(self.state)


# ------------------------------------------------------------------------------------ running
def child_cmd(names: list[str], args: argparse.Namespace, perturb: bool) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", ",".join(names), "--device", args.device]
    if args.smoke:
        cmd += ["--smoke", "--steps", str(args.steps or 2), "--warmup", str(args.warmup or 1)]
    else:
        if args.steps is not None:
            cmd += ["--steps", str(args.steps)]
        elif args.quick:  # a fifth of the steps (one workload per child on the GPU)
            cmd += ["--steps", str(max(2, KNOWN[names[0]].steps // 5))]
        if args.warmup is not None:
            cmd += ["--warmup", str(args.warmup)]
    if args.compile_backend:
        cmd += ["--compile-backend", args.compile_backend]
    if getattr(args, "count", False):
        cmd.append("--count")
    if perturb:
        cmd.append("--perturb")
    return cmd


def run_child(names: list[str], side: str, args: argparse.Namespace, env: dict[str, str], perturb: bool,
              log_dir: Path | None) -> dict[str, dict[str, Any]]:
    """One child process running `names`; each workload's result (an "error" key if it failed)."""
    cmd = child_cmd(names, args, perturb)
    label = f"{'+'.join(names)} ({side})"
    log(f"{label}: {' '.join(cmd[2:])}")
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=args.child_timeout, stdin=subprocess.DEVNULL)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        stderr += f"\n[killed after {args.child_timeout} s]"
        rc = None
    if log_dir is not None:
        (log_dir / f"{'+'.join(names)}-{side}.log").write_text(
            f"$ {' '.join(cmd)}\n--- exit status {rc}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    results: dict[str, dict[str, Any]] = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                got = json.loads(line)
            except json.JSONDecodeError:
                continue
            if got.get("workload") in names:
                results[got["workload"]] = got
    for name in names:
        result = results.setdefault(name, {})
        if "error" in result or not result:
            why = result.get("error") or ("timed out" if rc is None else f"exit status {rc}, no JSON line")
            result.setdefault("error", why)
            result["stderr_tail"] = stderr[-3000:]
            log(f"{name} ({side}) FAILED: {why}\n{result.get('traceback', '')}{stderr[-3000:]}")
        else:
            log(f"{name} ({side}): {fmt_rate(result.get('rate'))} {result.get('unit')} "
                f"({result['steps']} steps in {result['seconds']:.3f} s, set-up {result['setup_s']:.1f} s)")
    return results


def base_env(tmp: Path, side: str) -> dict[str, str]:
    """The child's environment without anything of gpupool's; compile caches shared by both sides
    (the remote run reuses the native run's compiled kernels and autotuning choices)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # GPU 0 is nvidia-smi's 0, as gpupoold's `gpus = [0]`
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor")
    env["TRITON_CACHE_DIR"] = str(tmp / "triton")
    env["TORCH_WORKLOADS_SIDE"] = side  # for the logs only
    return env


def evaluate(spec: Workload, native: dict[str, Any], remote: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": spec.name, "title": spec.title, "unit": spec.unit,
                           "target": spec.target, "exact_expected": spec.exact, "rtol": spec.rtol,
                           "why_tolerance": spec.why_tolerance, "native": native, "remote": remote}
    if "error" in native or "error" in remote:
        row.update(status="error", ratio=None, ratio_text="n/a", verdict="n/a",
                   agreement={"ok": False, "bitexact": False, "max_rel_diff": None,
                              "detail": "; ".join(
                                  f"{s} failed: {first_line(r['error'])}" for s, r in (("native", native),
                                                                                       ("remote", remote))
                                  if "error" in r)})
        return row
    agree = compare(native["values"], remote["values"], spec.exact, spec.rtol)
    ratio = ratio_of(native.get("rate"), remote.get("rate"))
    text, verdict = fmt_ratio(ratio, spec.target)
    row.update(status="ok" if agree.ok else "disagree", ratio=ratio, ratio_text=text, verdict=verdict,
               agreement=agree.__dict__)
    return row


def first_line(text: str, width: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[:width - 3] + "..."


def agreement_text(row: dict[str, Any]) -> str:
    agree = row["agreement"]
    if row["status"] == "error":
        return f"RUN FAILED: {agree['detail']}"
    return f"{'agree' if agree['ok'] else 'DISAGREE'}: {agree['detail']}"


def text_table(rows: list[dict[str, Any]], remote_label: str) -> str:
    head = ("workload", "unit", "native", remote_label, "remote/native", "target", "result", "agreement")
    body = []
    for r in rows:
        if r["status"] in ("skipped", "not run"):
            body.append((r["workload"], r["unit"], "-", "-", "-", f"<= {r['target']:.2f}", r["status"],
                         r["skip_reason"]))
            continue
        body.append((r["workload"], r["unit"], fmt_rate(r["native"].get("rate")),
                     fmt_rate(r["remote"].get("rate")), r["ratio_text"], f"<= {r['target']:.2f}",
                     r["verdict"], agreement_text(r)))
    return benchlib.text_table(head, body)


def machine() -> str:
    return f"{benchlib.cpu_model()}, {os.cpu_count()} CPUs, Linux {platform.release()}"


def commit() -> str:
    """GPUPOOL_COMMIT if set (a copy of the tree without .git), else git's HEAD (+ a dirty mark)."""
    if os.environ.get("GPUPOOL_COMMIT"):
        return os.environ["GPUPOOL_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True, timeout=20).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, text=True,
                               capture_output=True, check=True, timeout=20).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_driver() -> tuple[str, str]:
    """(GPU name, driver version) from nvidia-smi, or ('', '') without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader",
                              "-i", "0"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "", ""
    name, _, driver = out.partition(",")
    return name.strip(), driver.strip()


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    out = [f"### PyTorch workload suite ({meta['date']}, commit {meta['commit']})", "",
           f"Machine: {meta['machine']}; GPU: {meta['gpu']} (driver {meta['driver']}); torch "
           f"{meta['torch']} (CUDA {meta['torch_cuda']}); {meta['remote_via']}. "
           f"Command: `{meta['command']}`.", "",
           f"| workload | unit | native | {meta['remote_label']} | ratio remote/native | target | result | "
           "agreement |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] in ("skipped", "not run"):
            out.append(f"| {r['workload']} | {r['unit']} | - | - | - | <= {r['target']:.2f} | {r['status']} | "
                       f"{r['skip_reason']} |")
            continue
        out.append(f"| {r['workload']} | {r['unit']} | {fmt_rate(r['native'].get('rate'))} | "
                   f"{fmt_rate(r['remote'].get('rate'))} | {r['ratio_text']} | <= {r['target']:.2f} | "
                   f"{r['verdict']} | {agreement_text(r).replace('|', '/')} |")
    if meta["mode"] == "smoke-cpu":
        out += ["", "Smoke mode (CPU, tiny models, 2 steps): it checks the harness; its ratios mean nothing."]
    else:
        out += ["", "Ratio = time per step through gpupool / time per step natively (targets: "
                "1.10 for training, 1.30 for generation). Timed steps exclude warm-up; each side is a "
                "fresh process on the same GPU, native first."]
    return "\n".join(out) + "\n"


def select(only: str | None, on_gpu: bool = False) -> list[Workload]:
    names = generate_variants.expand([n.strip() for n in (only or ",".join(REGISTRY)).split(",") if n.strip()], on_gpu)
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise SystemExit(f"torch_workloads: unknown workload(s) {', '.join(unknown)}; "
                         f"known: {', '.join(KNOWN)}")
    return [KNOWN[n] for n in names]


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM (`timeout`, the device tool's limit) as an exception: gpupoold is stopped on the way out."""
    raise KeyboardInterrupt(f"signal {signum}")


def parent_main(args: argparse.Namespace, argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    if args.device == "cpu" and not args.smoke:
        raise SystemExit("torch_workloads: --device cpu is the smoke mode: add --smoke")
    workloads = select(args.only, on_gpu=args.device != "cpu")
    log_dir = args.log_dir
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    smoke = args.device == "cpu"
    remote_via = ("smoke mode: two CPU runs, the second standing in for the remote one (no gpupool)"
                  if smoke else "remote: gpupoold on the same GPU over loopback (reset policy never)")
    rows: list[dict[str, Any]] = []
    daemon: RealGpuDaemon | None = None
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-torchwl-cache-"))
    runnable = [w for w in workloads if not (smoke and w.cpu_skip)]
    results: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        if smoke:
            # No GPU and no timing that matters: one child per side runs every workload, the two
            # sides side by side (--jobs 2), so that CI pays for two torch imports, not twelve.
            names = [w.name for w in runnable]
            with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
                futures = {side: pool.submit(run_child, names, side, args, base_env(tmp, side),
                                             side == "remote" and args.perturb_remote, log_dir)
                           for side in ("native", "remote")}
                for side, fut in futures.items():
                    for name, res in fut.result().items():
                        results[name, side] = res
        else:
            # One child at a time: the native and the remote run never share the GPU.
            build = args.build_dir.resolve()
            missing = [str(build / f) for f in ("client/libcuda.so.1", "gpupool-worker") if not (build / f).is_file()]
            if missing:
                log(f"not built: {', '.join(missing)} (run make)")
                return 2
            try:
                daemon = RealGpuDaemon(build, log_dir, args.allow_simulated)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                log(f"cannot start gpupoold on the real GPU: {exc}")
                return 2
            log(f"gpupoold on {daemon.address}, serving {daemon.gpu_name}")
            try:
                for w in runnable:
                    daemon.wait_free()  # the scrub after the last lease uses the GPU: let it finish
                    results[w.name, "native"] = run_child([w.name], "native", args, base_env(tmp, "native"),
                                                          False, log_dir)[w.name]
                    daemon.wait_free()
                    results[w.name, "remote"] = run_child([w.name], "remote", args, benchlib.with_profile(
                        daemon.client_env(base_env(tmp, "remote")), w.name), args.perturb_remote, log_dir)[w.name]
            except KeyboardInterrupt as exc:
                # Stopped from outside (a time limit): report the workloads that finished.
                log(f"interrupted ({exc}): reporting the workloads that finished")
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for spec in workloads:
        if spec not in runnable or (spec.name, "remote") not in results:
            status, why = (("skipped", spec.cpu_skip) if spec not in runnable
                           else ("not run", "not run: the time limit came first"))
            log(f"{spec.name}: {status} ({why})")
            rows.append({"workload": spec.name, "title": spec.title, "unit": spec.unit,
                         "target": spec.target, "status": status, "skip_reason": why})
            continue
        row = evaluate(spec, results[spec.name, "native"], results[spec.name, "remote"])
        rows.append(row)
        log(f"{spec.name}: ratio {row['ratio_text']} (target <= {spec.target:.2f}, {row['verdict']}); "
            f"{agreement_text(row)}")

    first = next((r[side] for side in ("native", "remote") for r in rows
                  if side in r and r[side].get("device_name")), {})
    first = first or next((r["native"] for r in rows if "native" in r and "torch" in r["native"]), {})
    smi_name, driver = ("", "") if smoke else gpu_driver()
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "commit": commit(), "mode": "smoke-cpu" if smoke else "gpu",
        "gpu": first.get("device_name") or smi_name or ("none (CPU smoke mode)" if smoke else "?"),
        "driver": driver or "n/a", "torch": first.get("torch", "?"), "torch_cuda": first.get("torch_cuda"),
        "remote_via": remote_via, "remote_label": "second run" if smoke else "through gpupool",
        "command": "python bench/torch_workloads.py " + " ".join(argv),
    }
    print()
    print(text_table(rows, meta["remote_label"]), generate_variants.profile_tops(rows), sep="\n\n")
    md = markdown(rows, meta)
    print()
    print(md)
    if args.markdown:
        args.markdown.write_text(md)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "workloads": rows}, indent=2) + "\n")
    bad = [r["workload"] for r in rows if r["status"] not in ("ok", "skipped")]
    if bad:
        log(f"failed or disagreeing: {', '.join(bad)}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help=f"comma-separated workloads (of {', '.join(REGISTRY)})")
    ap.add_argument("--steps", type=int, help="timed steps per run (default: each workload's own)")
    ap.add_argument("--warmup", type=int, help="untimed warm-up steps per run (default: each workload's own)")
    ap.add_argument("--quick", action="store_true", help="a fifth of the timed steps (a smoke run on the GPU)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (the benchmark) or cpu (with --smoke: the harness check)")
    ap.add_argument("--smoke", action="store_true", help="tiny models, 2 steps (with --device cpu)")
    ap.add_argument("--json", type=Path, help="write every result as JSON here")
    ap.add_argument("--markdown", type=Path, help="write the section for docs/benchmarks.md here")
    ap.add_argument("--log-dir", type=Path, help="keep each child's output and gpupoold's log here")
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build",
                    help="native build with client/libcuda.so.1 and gpupool-worker (default build/)")
    ap.add_argument("--jobs", type=int, default=2,
                    help="smoke mode only: the two sides' children side by side (the GPU runs one at a time)")
    ap.add_argument("--child-timeout", type=float, default=400.0, help="seconds one child run may take")
    ap.add_argument("--compile-backend", help="torch.compile backend (default: inductor; aot_eager in smoke mode)")
    ap.add_argument("--perturb-remote", action="store_true",
                    help="perturb the remote run's weights: the agreement check must then fail")
    # Testing the harness on a machine without a GPU only: the daemon's simulated GPU runs no
    # PyTorch kernel, so every workload then fails, but the whole path up to the launch is taken.
    ap.add_argument("--allow-simulated", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # NAME[,NAME...]: run here, print JSON lines
    ap.add_argument("--perturb", action="store_true", help=argparse.SUPPRESS)
    # With --child, through a count-mode gpupoold: record the shim's call counts (link_model.py).
    ap.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args)
    if args.count:
        raise SystemExit("torch_workloads: --count is for the child runs that bench/link_model.py "
                         "starts: run `python bench/link_model.py`")
    return parent_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
