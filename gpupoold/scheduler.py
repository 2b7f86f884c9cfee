"""Which GPU a new connection gets.

For now: the first GPU with no session, else the least loaded one, round robin among equals;
several sessions may share a GPU (logged). Leases, exclusive GPUs and the FIFO queue replace this
in issue 4.
"""

from __future__ import annotations

from gpupoold.gpus import Gpu, Inventory
from gpupoold.sessions import SessionRegistry


class NoGpu(Exception):
    """No GPU matches the client's request; the message says why."""


def matches(gpu: Gpu, request: str) -> bool:
    """A client's device request: '' (any), an inventory index, a UUID (prefix) or a name part."""
    request = request.strip()
    if not request:
        return True
    if request.isdigit():
        return gpu.index == int(request)
    if gpu.uuid and gpu.uuid.lower().startswith(request.lower()):
        return True
    return request.lower() in gpu.name.lower()


class Scheduler:
    def __init__(self, inventory: Inventory, sessions: SessionRegistry) -> None:
        self._inventory = inventory
        self._sessions = sessions
        self._next = 0  # round-robin start among equally loaded GPUs

    def pick(self, request: str = "") -> Gpu:
        candidates = [g for g in self._inventory.gpus if matches(g, request)]
        if not candidates:
            have = ", ".join(f"{g.index}: {g.name}" for g in self._inventory.gpus)
            raise NoGpu(f"no GPU on this server matches the request {request!r} (GPUs: {have})")
        n = len(self._inventory.gpus)

        def key(g: Gpu) -> tuple[int, int]:
            load = len(self._sessions.on_gpu(g.index))
            # An idle GPU: the lowest index. Busy ones: round robin from the last pick.
            return (load, g.index if load == 0 else (g.index - self._next) % n)

        chosen = min(candidates, key=key)
        self._next = (chosen.index + 1) % n
        return chosen
