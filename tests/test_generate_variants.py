"""generate's A/B on a GPU (bench/generate_variants.py, issue 31, item 2): which variants run
with `generate`, what each changes in the child before attention first runs, and the profile
lines printed after the table. The runs themselves need a GPU (scripts/gpu-validation.sh)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from test_bench_workloads import load_bench


@pytest.fixture(scope="module")
def wl() -> ModuleType:
    return load_bench()


@pytest.fixture(scope="module")
def gv(wl: ModuleType) -> ModuleType:
    return sys.modules["generate_variants"]  # imported by torch_workloads from bench/


def test_generate_brings_its_variants_on_a_gpu_only(wl: ModuleType) -> None:
    names = lambda only, on_gpu: [w.name for w in wl.select(only, on_gpu=on_gpu)]  # noqa: E731
    assert names("generate", False) == ["generate"]
    assert names("mlp,generate,cnn", True) == ["mlp", "generate", "generate_nocudnn",
                                                "generate_norecompile", "cnn"]
    assert names("generate,generate_norecompile", True) == ["generate", "generate_nocudnn",
                                                             "generate_norecompile"]
    assert names("generate_nocudnn", False) == ["generate_nocudnn"]
    assert names(None, True)[3:6] == ["generate", "generate_nocudnn", "generate_norecompile"]
    assert list(wl.REGISTRY) == ["mlp", "cnn", "gpt", "generate", "compile", "cuda_graph"]


def test_the_variants_are_generate_with_fewer_steps(wl: ModuleType) -> None:
    gen = wl.REGISTRY["generate"]
    for name in ("generate_norecompile", "generate_nocudnn"):
        v = wl.KNOWN[name]
        assert (v.unit, v.target, v.exact) == (gen.unit, gen.target, gen.exact)
        assert v.steps < gen.steps and 0 < v.warmup < gen.warmup and v.steps // 5 >= 10 and v.cpu_skip
        args = SimpleNamespace(device="cuda", smoke=False, steps=None, quick=True, warmup=None,
                               compile_backend=None, count=False)
        assert wl.child_cmd([name], args, False)[-2:] == ["--steps", str(v.steps // 5)]


class FakeBackends:
    def __init__(self) -> None:
        self.cudnn_sdp: list[bool] = []
        self.cuda = SimpleNamespace(enable_cudnn_sdp=self.cudnn_sdp.append)


@pytest.mark.parametrize(("name", "env", "cudnn_sdp"), [
    ("generate_norecompile", {"TORCH_CUDNN_SDPA_AVOID_RECOMPILE": "1"}, True),
    ("generate_nocudnn", {}, False),
])
def test_a_variant_is_applied_before_generate_builds(
        wl: ModuleType, monkeypatch: pytest.MonkeyPatch, name: str, env: dict[str, str],
        cudnn_sdp: bool) -> None:
    monkeypatch.delenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", raising=False)
    backends = FakeBackends()
    seen: dict[str, Any] = {}

    def base(ctx: Any) -> str:
        seen["env"] = os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE")
        seen["cudnn_sdp"] = list(backends.cudnn_sdp)
        return "step"

    assert sys.modules["generate_variants"].VARIANTS[name][1:] == (env, cudnn_sdp)
    ctx = SimpleNamespace(cuda=True, torch=SimpleNamespace(backends=backends), notes={})
    build = sys.modules["generate_variants"].variant_build(base, env, cudnn_sdp)
    assert build(ctx) == "step"
    assert seen == {"env": env.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"), "cudnn_sdp": [cudnn_sdp]}
    assert ctx.notes["cudnn_sdp"] is cudnn_sdp


PROFILE = """\
# gpupool profile of python (pid 5759), 30.546 s from load to exit
# round trips: ...

protocol op              calls  round trips   detached      bytes sent  bytes received     client ms   worker ms
module_load                 85           85          0        57394348            1700       792.812     737.326
stream_synchronize         170          170          0            4080            3400       629.005       1.009
launch                    6536            0          0         3001694               0        70.731       7.649
get_function                58           58          0            8856            4432        20.574       0.398
func_set_attribute          56           56          0            1792            1120        15.477       0.073
func_get_attribute          20           20          0             560             480         7.077       0.018
mem_alloc                   26           26          0             936             936         6.524       0.436
total                     7266          472         21       555207503           14580      2965.363    2676.678

CUDA entry point                   calls      frames  round trips      bytes sent  client ms    waiting ms
cuLibraryLoadData                     51          83           83        57393987   1198.537       792.263
cuStreamSynchronize                  170          170          170            4080    629.265       629.005
"""


def test_the_profiles_top_lines_follow_the_table(gv: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "generate.txt").write_text(PROFILE)
    rows = [{"workload": "mlp"}, {"workload": "generate"}, {"workload": "generate_nocudnn"}]
    text = gv.profile_tops(rows, str(tmp_path))
    lines = text.splitlines()
    assert lines[0] == f"--- generate through gpupool: {tmp_path / 'generate.txt'}"
    assert lines[1].startswith("protocol op") and lines[2].startswith("module_load")
    assert lines[1 + gv.TOP_LINES].startswith("func_get_attribute")  # the header and 6 ops
    assert not any(ln.startswith(("mem_alloc", "total", "#")) for ln in lines)
    assert any(ln.startswith("cuLibraryLoadData") for ln in lines)
    assert lines[-1].startswith("--- generate_nocudnn: no profile (No such file")
    assert "mlp" not in text
    assert gv.profile_tops(rows, "") == ""
