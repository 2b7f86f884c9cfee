"""A small training loop that runs for a while: the job whose GPU must survive a gpupoold restart
(bench/restart_check.py). An MLP learns a fixed random linear map; every step synchronises, so a
server that loses the session fails the loop at once.

    python train_steps.py SECONDS

Prints `step N loss L` every 50 steps and then `PASS train_steps: N steps, loss A -> B` when the
loss fell to a tenth of its start (else `FAIL ...`, exit 1).
"""

from __future__ import annotations

import sys
import time

import torch


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    torch.manual_seed(0)
    dev = torch.device("cuda")
    target = torch.randn(256, 64, device=dev)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 64)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    first = last = None
    step = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        x = torch.randn(128, 256, device=dev)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.item()  # a synchronising copy every step
        first = value if first is None else first
        last = value
        if step % 50 == 0:
            print(f"step {step} loss {value:.5f}", flush=True)
        step += 1
    ok = first is not None and last is not None and last < first / 10
    print(f"{'PASS' if ok else 'FAIL'} train_steps: {step} steps, loss {first:.4f} -> {last:.4f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
