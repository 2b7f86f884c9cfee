"""The generate A/B of bench/torch_workloads.py (issue 31, item 2): batch-1 generation ran at
4.8-6.6x native through gpupool on the H200, with a module load each token. PyTorch prefers
cuDNN's SDPA on sm90, and cuDNN builds (runtime-compiles) its attention graph again whenever the
sequence length changes, which in decoding is every token. Run next to `generate`, on a GPU:

  generate_nocudnn      torch.backends.cuda.enable_cudnn_sdp(False): flash or efficient SDPA,
                        precompiled kernels, no build per token.
  generate_norecompile  TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (pytorch#155958): one graph for
                        every length. PyTorch warns and falls back where the layout does not
                        allow it (it wants Q, K, V in BSHD memory layout; generate's KV cache is
                        allocated (B, H, S, D), so look for the warning in the child's log).

Each natively and through gpupool like any workload (tokens/s, the ratio against 1.30), and
with GPUPOOL_PROFILE_DIR set (scripts/gpu-validation.sh) each remote run's profile's top lines
are printed after the table: which op took the time (module_load: an upload or a JIT per token;
its worker ms: the driver's load) names the cause in one run. They are selected with `generate`
on a GPU only: the smoke mode's CPU has no cuDNN, and bench/link_model.py's count mode runs
workloads by name.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

# name -> (what it changes, environment for the child's CUDA libraries, cuDNN SDPA on)
# The likelier fix first: a step cut short by its time limit still reports the variants that ran.
VARIANTS: dict[str, tuple[str, dict[str, str], bool]] = {
    "generate_nocudnn": ("cuDNN SDPA off", {}, False),
    "generate_norecompile": ("TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1",
                             {"TORCH_CUDNN_SDPA_AVOID_RECOMPILE": "1"}, True),
}
# Fewer steps than generate (128 and 8; --quick: 10 timed steps and 4 of warm-up instead of 25
# and 8): at 458 ms a token through gpupool (the H200's 2026-11-27 figure) a variant pair costs
# about 30 s with its two processes' set-up, and a 5x difference shows in 10 tokens.
STEPS, WARMUP = 50, 4
TOP_LINES = 6  # of each profile's two tables: the ops and the entry points that took longest


def variant_build(base: Callable[[Any], Any], env: dict[str, str], cudnn_sdp: bool) -> Callable[[Any], Any]:
    """generate's build with the variant applied first: before the prompt's forward pass, the
    first SDPA call, where PyTorch reads these (the child's process has imported torch, not run
    attention yet)."""

    def build(ctx: Any) -> Any:
        os.environ.update(env)
        if ctx.cuda:
            ctx.torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
        ctx.notes.update(cudnn_sdp=cudnn_sdp, **{k.lower(): v for k, v in env.items()})
        return base(ctx)

    return build


def variants(generate: Any) -> dict[str, Any]:
    """The variants as workloads of their own, from the `generate` Workload."""
    return {name: dataclasses.replace(
                generate, name=name, title=f"{generate.title}, {what}",
                steps=STEPS, warmup=WARMUP,
                build=variant_build(generate.build, env, cudnn_sdp),
                cpu_skip="cuDNN SDPA variants need a CUDA device")
            for name, (what, env, cudnn_sdp) in VARIANTS.items()}


def expand(names: list[str], on_gpu: bool) -> list[str]:
    """`generate` brings its variants along on a GPU (after it, unless named themselves)."""
    if not on_gpu or "generate" not in names:
        return names
    i = names.index("generate") + 1
    return names[:i] + [v for v in VARIANTS if v not in names] + names[i:]


def profile_tops(rows: list[dict[str, Any]], folder: str | None = None) -> str:
    """The top lines of the remote profile (GPUPOOL_PROFILE_DIR/NAME.txt, as benchlib.with_profile
    names them) of each of these result rows that is generate or a variant; "" without a profile
    folder."""
    folder = folder if folder is not None else os.environ.get("GPUPOOL_PROFILE_DIR")
    if not folder:
        return ""
    out = []
    for name in [r["workload"] for r in rows if r["workload"] == "generate" or r["workload"] in VARIANTS]:
        path = Path(folder) / f"{name}.txt"
        try:
            text = path.read_text()
        except OSError as exc:
            out.append(f"--- {name}: no profile ({exc.strerror or exc}: {path})")
            continue
        out.append(f"--- {name} through gpupool: {path}")
        for table in text.split("\n\n"):
            lines = [ln for ln in table.splitlines() if ln.strip()]
            if lines and not lines[0].startswith("#"):  # the header, then the longest first
                out += lines[:TOP_LINES + 1]
    return "\n".join(out)
