"""Client requirements (gpupoold/pool/requirements.py) and the wait queue (gpupoold/pool/waitqueue.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gpupoold.gpu.inventory import Gpu
from gpupoold.pool.requirements import Requirements, format_bytes
from gpupoold.pool.waitqueue import ClientInfo, WaitQueue

GIB = 1 << 30


def gpu(i: int, name: str = "NVIDIA H100 80GB HBM3", memory: int = 80 * GIB) -> Gpu:
    return Gpu(index=i, name=name, uuid=f"GPU-{i:08x}-aaaa-bbbb-cccc-dddddddddddd",
               simulated=False, driver="libcuda.so.1", ordinal=i, memory_total=memory)


@pytest.mark.parametrize(("req", "index_ok"), [
    (Requirements(), [0, 1, 2]),
    (Requirements(gpu="1"), [1]),
    (Requirements(gpu="GPU-00000002"), [2]),
    (Requirements(gpu="gpu-00000002-AAAA"), [2]),
    (Requirements(model="h100"), [0, 1, 2]),
    (Requirements(model="A100"), []),
    (Requirements(min_memory=80 * GIB), [0, 1, 2]),
    (Requirements(min_memory=80 * GIB + 1), []),
    (Requirements(gpu="0", model="H100", min_memory=GIB), [0]),
])
def test_matching(req: Requirements, index_ok: list[int]) -> None:
    assert [g.index for g in (gpu(0), gpu(1), gpu(2)) if req.matches(g)] == index_ok


def test_refusal_names_every_gpu_and_the_variables() -> None:
    req = Requirements(model="A100", min_memory=100 * GIB)
    text = req.refusal([gpu(0), gpu(1, name="NVIDIA A100-SXM4-40GB", memory=40 * GIB)])
    assert "model 'A100', at least 100 GiB" in text
    assert "GPU 0 (NVIDIA H100 80GB HBM3): its name does not contain 'A100'" in text
    assert "GPU 1 (NVIDIA A100-SXM4-40GB): it has 40 GiB, less than 100 GiB" in text
    assert "GPUPOOL_GPU_MODEL" in text and "GPUPOOL_MIN_MEMORY" in text


def test_from_hello_and_describe() -> None:
    hello = SimpleNamespace(gpu=" 1 ", model="", min_memory=40 * GIB)
    req = Requirements.from_hello(hello)
    assert req == Requirements(gpu="1", min_memory=40 * GIB)
    assert req.describe() == "GPU 1, at least 40 GiB"
    assert Requirements().describe() == "any GPU"
    assert format_bytes(512 << 20) == "512 MiB" and format_bytes(1536 << 20) == "1536 MiB"
    assert format_bytes(40 * 10**9) == "40 GB" and format_bytes(GIB + 1) == "1 GiB"


async def test_queue_order_positions_and_first_eligible() -> None:
    q = WaitQueue()
    c = ClientInfo(host="h", user="u", pid=1, program="p", peer="x:1")
    a = q.join(Requirements(gpu="1"), "alice", c)
    b = q.join(Requirements(), "bob", c)
    d = q.join(Requirements(), "carol", c)
    assert [q.position(w) for w in (a, b, d)] == [1, 2, 3]
    assert q.first(lambda w: w.req.matches(gpu(0))) is b
    assert q.first(lambda w: w.req.matches(gpu(1))) is a
    q.leave(a)
    assert q.position(a) == 0 and q.position(d) == 2 and len(q) == 2
    view = q.view()
    assert [v["token"] for v in view] == ["bob", "carol"] and view[0]["position"] == 1
    assert all(isinstance(w.future, asyncio.Future) for w in q)


@pytest.mark.parametrize("text", ["²", "١", "1²", "𝟙", "٣"])
def test_a_gpu_that_is_not_ascii_digits_is_a_uuid_prefix(text: str) -> None:
    # str.isdigit() takes these (int() refuses "²" with ValueError, reads "١" as 1): an index is
    # ASCII digits only, anything else is a UUID prefix.
    req = Requirements(gpu=text)
    assert req.why_not(gpu(1)) == f"its UUID does not start with {text!r}"
    assert not req.matches(gpu(0))
    assert f"GPU 0 (NVIDIA H100 80GB HBM3): its UUID does not start with {text!r}" in \
        req.refusal([gpu(0)])


def test_an_index_is_ascii_digits() -> None:
    assert Requirements(gpu="01").matches(gpu(1))
    assert Requirements(gpu="2").why_not(gpu(1)) == "not GPU 2"
