"""GPU choice for a new session (gpupoold/scheduler.py) and the session registry."""

from __future__ import annotations

import pytest

from gpupoold.gpus import Gpu, Inventory
from gpupoold.scheduler import NoGpu, Scheduler
from gpupoold.sessions import Session, SessionRegistry


def inventory(n: int) -> Inventory:
    return Inventory(tuple(
        Gpu(index=i, name=f"NVIDIA H100 (gpupool simulated) {i}", uuid=f"GPU-{i:08x}-aaaa",
            simulated=True, driver="sim.so", ordinal=0) for i in range(n)))


def add(sessions: SessionRegistry, gpu: int) -> Session:
    s = Session(id=sessions.new_id(), gpu=gpu, peer="p", client_host="h", client_user="u",
                client_pid=1, program="x")
    sessions.add(s)
    return s


def test_first_idle_gpu_then_least_loaded_round_robin() -> None:
    sessions = SessionRegistry()
    sched = Scheduler(inventory(3), sessions)
    picks = []
    for _ in range(7):
        gpu = sched.pick()
        picks.append(gpu.index)
        add(sessions, gpu.index)
    assert picks == [0, 1, 2, 0, 1, 2, 0]


def test_a_freed_gpu_is_preferred() -> None:
    sessions = SessionRegistry()
    sched = Scheduler(inventory(2), sessions)
    a = add(sessions, sched.pick().index)
    add(sessions, sched.pick().index)
    sessions.remove(a.id)
    assert sched.pick().index == a.gpu


@pytest.mark.parametrize(("request_text", "index"), [
    ("1", 1), ("GPU-00000002", 2), ("gpu-00000002-AAAA", 2), ("simulated) 1", 1), ("", 0)])
def test_device_request(request_text: str, index: int) -> None:
    assert Scheduler(inventory(3), SessionRegistry()).pick(request_text).index == index


@pytest.mark.parametrize("request_text", ["7", "A100", "GPU-ffff"])
def test_device_request_without_match(request_text: str) -> None:
    with pytest.raises(NoGpu, match="no GPU on this server matches"):
        Scheduler(inventory(2), SessionRegistry()).pick(request_text)


def test_registry() -> None:
    sessions = SessionRegistry()
    a, b = add(sessions, 0), add(sessions, 1)
    assert (a.id, b.id) == (1, 2) and len(sessions) == 2
    assert sessions.on_gpu(1) == [b] and sessions.get(1) is a
    assert sessions.remove(1) is a and sessions.remove(1) is None
    assert [s.id for s in sessions.all()] == [2]
    assert b.to_json()["client"] == {"host": "h", "user": "u", "pid": 1, "program": "x"}
