"""torch.distributed with the gloo backend and CUDA tensors, one GPU per process
(tests/test_e2e_torch_multi_gpu.py; issue 37, "Processes that talk to each other").

Run without --rank, it starts `--world` ranks of itself (the same environment, so each one is a
gpupool client with a lease of its own) and waits for them; each rank prints its own
`PASS gloo rank R: N checks` or `FAIL ...` line, and the launcher's last line is
`PASS gloo: W ranks` or `FAIL gloo: ...` (exit 1).

Each rank: all_reduce (sum) and broadcast (from every rank in turn) of CUDA tensors of several
dtypes and sizes, compared bit-exact with what the CPU computes; all_gather of CUDA tensors;
and a barrier. The tensors are made on the CPU and moved with .to("cuda"): the simulated device
runs no PyTorch kernel, and gloo's CUDA path needs none (it copies each tensor to pinned host
memory on a side stream, reduces on the CPU, and copies back).

The ranks meet through a file store (--init file:///...), so that parallel test runs share no
port.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from datetime import timedelta

import torch
from checklist import Checklist

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.float16]
SIZES = [1, 1000, (4 << 20) // 4 + 3]  # one element, a small tensor, just over 4 MiB of fp32


def rank_values(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """What rank `rank` contributes: small integers (exact in every dtype and in any sum of a
    few of them), different on each rank and for each salt."""
    gen = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(0, 100, (n,), generator=gen).to(dtype)


def run_rank(rank: int, world: int, init: str) -> int:
    import torch.distributed as dist

    checklist = Checklist(f"gloo rank {rank}")
    check = checklist.check
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    check(torch.cuda.device_count() >= 1, f"torch.cuda.device_count() = "
          f"{torch.cuda.device_count()}")
    torch.cuda.set_device(0)

    def all_reduce() -> None:
        for salt, (dtype, n) in enumerate((d, n) for d in DTYPES for n in SIZES):
            mine = rank_values(rank, n, dtype, salt)
            expect = sum(rank_values(r, n, dtype, salt).to(torch.float64) for r in range(world))
            t = mine.to("cuda")
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            got = t.cpu()
            check(t.is_cuda and got.dtype == dtype, f"all_reduce {dtype} x{n}: the result is "
                  f"on {t.device}, {got.dtype}")
            check(torch.equal(got.to(torch.float64), expect),
                  f"all_reduce {dtype} x{n}: the sum differs from the CPU's")

    def broadcast() -> None:
        for src in range(world):
            for salt, dtype in enumerate(DTYPES):
                n = SIZES[salt % len(SIZES)]
                t = rank_values(rank, n, dtype, 100 + salt).to("cuda")
                dist.broadcast(t, src=src)
                check(torch.equal(t.cpu(), rank_values(src, n, dtype, 100 + salt)),
                      f"broadcast {dtype} x{n} from rank {src}: differs from rank {src}'s tensor")

    def all_gather() -> None:
        n = 4097
        mine = rank_values(rank, n, torch.float32, 200).to("cuda")
        out = [torch.empty(n, dtype=torch.float32, device="cuda") for _ in range(world)]
        dist.all_gather(out, mine)
        for r in range(world):
            check(torch.equal(out[r].cpu(), rank_values(r, n, torch.float32, 200)),
                  f"all_gather: the tensor from rank {r} differs")

    checklist.section(all_reduce)
    checklist.section(broadcast)
    checklist.section(all_gather)
    checklist.section(dist.barrier, "barrier")
    dist.destroy_process_group()
    return checklist.finish()


def launch(world: int, init: str, timeout: float) -> int:
    """Starts the ranks, each writing into a file of its own (their lines would interleave on a
    shared stdout), waits for them, and prints what each one wrote, rank by rank."""
    outs = [tempfile.TemporaryFile(mode="w+") for _ in range(world)]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world),
                               "--init", init], stdin=subprocess.DEVNULL, stdout=outs[r],
                              stderr=subprocess.STDOUT)
             for r in range(world)]
    failed = []
    for r, p in enumerate(procs):
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            code = p.wait()
            failed.append(f"rank {r} still running after {timeout} s (killed)")
        if code != 0:
            failed.append(f"rank {r} exited with {code}")
    for out in outs:
        out.seek(0)
        print(out.read().rstrip("\n"), flush=True)
        out.close()
    if failed:
        print(f"FAIL gloo: {'; '.join(failed)}")
        return 1
    print(f"PASS gloo: {world} ranks")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--init", required=True, help="file:///... for the ranks' store")
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    if args.rank is None:
        return launch(args.world, args.init, args.timeout)
    return run_rank(args.rank, args.world, args.init)


if __name__ == "__main__":
    sys.exit(main())
