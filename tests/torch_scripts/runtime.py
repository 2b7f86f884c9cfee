"""PyTorch's CUDA runtime pieces that need no kernel: synchronize, memory statistics, streams,
events, pinned memory.

Prints one line per failed check and a summary `PASS runtime: N checks` or
`FAIL runtime: K of N checks failed`; exits 1 on any failure.
"""

from __future__ import annotations

import sys
import time

import torch
from checklist import Checklist

checklist = Checklist("runtime")
check = checklist.check


def sync_and_memory() -> None:
    torch.cuda.synchronize()
    torch.cuda.synchronize(0)
    free, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0)
    check(total == props.total_memory, f"mem_get_info total {total} != total_memory "
          f"{props.total_memory}")
    check(0 < free <= total, f"mem_get_info free {free} of {total}")
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    x = torch.empty(10 << 20, dtype=torch.uint8, device="cuda")
    check(torch.cuda.memory_allocated() >= base + (10 << 20),
          f"memory_allocated {torch.cuda.memory_allocated()} after a 10 MiB tensor (was {base})")
    check(torch.cuda.memory_reserved() >= torch.cuda.memory_allocated(),
          "memory_reserved < memory_allocated")
    free2, _ = torch.cuda.mem_get_info()
    check(free2 <= free, f"free memory grew from {free} to {free2} after allocating")
    stats = torch.cuda.memory_stats()
    check(stats.get("allocation.all.current", 0) >= 1, "memory_stats shows no allocation")
    del x
    torch.cuda.empty_cache()
    check(torch.cuda.memory_allocated() == base,
          f"memory_allocated {torch.cuda.memory_allocated()} after free, expected {base}")
    peak = torch.cuda.max_memory_allocated()
    check(peak >= 10 << 20, f"max_memory_allocated {peak}")
    # Many small allocations through the caching allocator.
    tensors = [torch.empty(1000 + 17 * i, dtype=torch.float32, device="cuda") for i in range(200)]
    check(len({t.data_ptr() for t in tensors}) == 200, "two live tensors share an address")
    del tensors
    torch.cuda.empty_cache()


def streams_and_events() -> None:
    s1 = torch.cuda.Stream()
    s2 = torch.cuda.Stream(priority=-1)
    check(s1.query(), "an idle new stream is not complete")
    data = torch.arange(1 << 20, dtype=torch.int32).pin_memory()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s1):
        start.record()
        g = data.to("cuda", non_blocking=True)
        end.record()
    s2.wait_event(end)
    with torch.cuda.stream(s2):
        g2 = g.clone()  # D2D on s2 after s1's copy
        done = torch.cuda.Event()
        done.record()
    done.synchronize()
    check(done.query(), "event not complete after synchronize()")
    check(end.query(), "s1's event not complete although s2 waited for it")
    ms = start.elapsed_time(end)
    check(ms >= 0.0, f"elapsed_time {ms} < 0")
    s2.synchronize()
    back = g2.cpu()
    check(torch.equal(back, data), "data copied across two streams differs")
    # The default stream and current stream accessors.
    cur = torch.cuda.current_stream()
    check(cur == torch.cuda.default_stream(), "current stream is not the default stream")
    cur.synchronize()
    # An event waited on by the current stream, and a timed copy.
    e0 = torch.cuda.Event(enable_timing=True)
    e1 = torch.cuda.Event(enable_timing=True)
    e0.record()
    big = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    gbig = big.to("cuda", non_blocking=True)
    e1.record()
    e1.synchronize()
    ms = e0.elapsed_time(e1)
    check(ms > 0.0, f"64 MiB copy timed at {ms} ms")
    print(f"  64 MiB pinned upload: {ms:.2f} ms by CUDA events")
    del gbig


def pinned_memory() -> None:
    t = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    check(t.is_pinned(), "torch.empty(pin_memory=True) is not pinned")
    u = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).pin_memory()
    check(u.is_pinned(), "pin_memory() is not pinned")
    g = u.to("cuda", non_blocking=True)
    back = torch.empty_like(u).pin_memory()
    back.copy_(g, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    check(torch.equal(back, u), "pinned round trip differs")


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)
    if not torch.cuda.is_available():
        print("FAIL runtime: torch.cuda.is_available() is False")
        return 1
    t0 = time.monotonic()
    for fn in (sync_and_memory, streams_and_events, pinned_memory):
        checklist.section(fn)
    return checklist.finish(f"{time.monotonic() - t0:.1f} s")

if __name__ == "__main__":
    sys.exit(main())
