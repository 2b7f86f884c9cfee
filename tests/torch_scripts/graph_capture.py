"""PyTorch CUDA graphs with no kernel: torch.cuda.graph capture of device-to-device copies
(`dst.copy_(src)` and `src.clone()`, plain cuMemcpyAsync calls, the clone's memory from the
graph's private pool allocated during the capture), replayed with new inputs in between.

Prints one line per failed check and a summary `PASS graph_capture: N checks` or
`FAIL graph_capture: K of N checks failed`; exits 1 on any failure.
"""

from __future__ import annotations

import sys

import torch
from checklist import Checklist

checklist = Checklist("graph_capture")
check = checklist.check
N = 1 << 16
REPLAYS = 10


def to_gpu(t: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(t)  # host to device: a plain copy, no kernel


def capture_and_replay() -> None:
    cpu_src = torch.linspace(0, 1, N, dtype=torch.float32)
    src = torch.empty(N, dtype=torch.float32, device="cuda")
    dst = torch.empty(N, dtype=torch.float32, device="cuda")
    to_gpu(cpu_src, src)
    sentinel = torch.full((N,), -7.0, dtype=torch.float32)
    to_gpu(sentinel, dst)
    torch.cuda.synchronize()
    check(not torch.cuda.is_current_stream_capturing(), "capturing before the capture")

    g = torch.cuda.CUDAGraph()
    seen: list[bool] = []
    with torch.cuda.graph(g):
        seen.append(torch.cuda.is_current_stream_capturing())
        dst.copy_(src)
        out = src.clone()  # allocated from the graph's pool during the capture
    check(seen == [True], f"is_current_stream_capturing inside the capture: {seen}")
    check(not torch.cuda.is_current_stream_capturing(), "capturing after the capture")
    torch.cuda.synchronize()
    check(torch.equal(dst.cpu(), sentinel), "the capture itself ran the copy")

    for r in range(REPLAYS):
        new = torch.full((N,), float(r), dtype=torch.float32) + cpu_src
        to_gpu(new, src)
        g.replay()
        torch.cuda.synchronize()
        check(torch.equal(dst.cpu(), new), f"replay {r}: dst is not the new src")
        check(torch.equal(out.cpu(), new), f"replay {r}: the clone is not the new src")
    g.reset()
    del g
    torch.cuda.synchronize()


def main() -> int:
    checklist.section(capture_and_replay)
    return checklist.finish()


if __name__ == "__main__":
    sys.exit(main())
