"""What a client asks of its GPUs (from its hello): a specific GPU, a model, a minimum of memory,
how many GPUs (all or nothing, issue 37) and how much memory on them (issue 32).

A requirement no GPU of this server can ever meet is refused at once, with the reason for each
GPU, so the user can fix the variable (`GPUPOOL_GPU`, `GPUPOOL_GPU_MODEL`, `GPUPOOL_MIN_MEMORY`,
`GPUPOOL_GPUS`) or pick another server instead of waiting in a queue forever; so is a request
for more GPUs than this server has that meet it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import gpupool_protocol as gp

from gpupoold.gpu.inventory import Gpu

GIB = 1 << 30
# The largest spread_group a hello may name: a group is a fleet ticket (a PostgreSQL BIGINT), and
# the lease records keep it in a signed 64-bit integer (SQLite's too).
MAX_SPREAD_GROUP = (1 << 63) - 1
_INDEX = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit() also takes "²", which int() refuses


def format_bytes(n: int, exact: bool = False) -> str:
    """In the unit `n` is a whole multiple of (as users write GPUPOOL_MIN_MEMORY: "40 GB",
    "40 GiB"), else approximately in GiB or MiB, or with `exact` in bytes."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GIB), ("TB", 10**12), ("GB", 10**9),
                       ("MiB", 1 << 20), ("MB", 10**6)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    if exact or n < 1 << 20:
        return f"{n} bytes"
    if n >= GIB:
        return f"{n / GIB:.4g} GiB"
    return f"{n / (1 << 20):.0f} MiB"


@dataclass(frozen=True)
class Requirements:
    gpu: str = ""  # an inventory index, or a UUID (prefix); "" = any
    model: str = ""  # a case-insensitive substring of the GPU name; "" = any
    min_memory: int = 0  # bytes of total device memory; 0 = any
    # How many GPUs the process wants, all at once (hello.gpus; a hello of 0, or of a client
    # before protocol 1.6, is 1). Each of them must meet the requirements above.
    gpus: int = 1
    # Bytes of device memory the process asks for on each GPU (hello.memory; 0 = a whole GPU).
    # Not a requirement a GPU must meet: the worker's quota (`memory_quota`, capped at the GPU's
    # total memory by the lease manager).
    memory: int = 0
    # The client takes its GPUs from several servers of a fleet when no one server has them all
    # (hello flag GP_HELLO_SPREAD, protocol 1.8; pool/fleet.py's `match`). Not a requirement a
    # GPU must meet; ignored outside a fleet.
    spread: bool = False
    # A part's hello of a spread lease (protocol 1.8): the group its parts share (the fleet
    # ticket), which part this is and how many there are; 0 for any other hello. It claims the
    # GPUs held for it.
    spread_group: int = 0
    part: int = 0
    parts: int = 0

    @classmethod
    def from_hello(cls, hello: Any) -> Requirements:
        return cls(gpu=str(getattr(hello, "gpu", "")).strip(),
                   model=str(getattr(hello, "model", "")).strip(),
                   min_memory=int(getattr(hello, "min_memory", 0)),
                   gpus=max(1, int(getattr(hello, "gpus", 0) or 0)),
                   memory=max(0, int(getattr(hello, "memory", 0) or 0)),
                   spread=bool(int(getattr(hello, "flags", 0) or 0) & gp.GP_HELLO_SPREAD),
                   spread_group=int(getattr(hello, "spread_group", 0) or 0),
                   part=int(getattr(hello, "part", 0) or 0),
                   parts=int(getattr(hello, "parts", 0) or 0))

    def malformed(self) -> str | None:
        """The refusal of a hello whose spread fields no server ever gave (None: they may be)."""
        if self.spread_group > MAX_SPREAD_GROUP:
            return (f"spread_group {self.spread_group} is above {MAX_SPREAD_GROUP}, and no "
                    "spread lease has such a number: a part's hello says the spread_group its "
                    "redirect named (a client bug: upgrade the gpupool client)")
        return None

    def outside_fleet(self) -> Requirements:
        """These requirements on a server that is in no fleet: a spread lease's part fields
        are dropped (no fleet gave that lease; they would be only the client's word in the lease
        record and view), and the request is an ordinary one for its GPUs."""
        return replace(self, spread_group=0, part=0, parts=0) if self.spread_group else self

    def quota(self, gpu: Gpu) -> int:
        """The worker's memory_quota on `gpu`: the memory asked for, at most the GPU's total
        (0: none, the whole GPU)."""
        if self.memory <= 0:
            return 0
        return min(self.memory, gpu.memory_total) if gpu.memory_total > 0 else self.memory

    def why_not(self, gpu: Gpu) -> str | None:
        """None when `gpu` meets the requirements, else the reason in words."""
        if self.gpu:
            if _INDEX.fullmatch(self.gpu):
                if gpu.index != int(self.gpu):
                    return f"not GPU {self.gpu}"
            elif not (gpu.uuid and gpu.uuid.lower().startswith(self.gpu.lower())):
                return f"its UUID does not start with {self.gpu!r}"
        if self.model and self.model.lower() not in gpu.name.lower():
            return f"its name does not contain {self.model!r}"
        total = gpu.memory_total
        if self.min_memory and total < self.min_memory:
            return f"it has {format_bytes(total)}, less than {format_bytes(self.min_memory)}"
        return None

    def matches(self, gpu: Gpu) -> bool:
        return self.why_not(gpu) is None

    def describe(self) -> str:
        parts = []
        if self.gpus > 1:
            parts.append(f"{self.gpus} GPUs" + (" (spread)" if self.spread else ""))
        if self.spread_group:
            parts.append(f"part {self.part} of {self.parts} of spread lease {self.spread_group}")
        if self.gpu:
            parts.append(f"GPU {self.gpu}")
        if self.model:
            parts.append(f"model {self.model!r}")
        if self.min_memory:
            parts.append(f"at least {format_bytes(self.min_memory)}")
        if self.memory:
            parts.append(f"{format_bytes(self.memory)} of memory")
        return ", ".join(parts) if parts else "any GPU"

    def refusal(self, gpus: Iterable[Gpu]) -> str:
        """The message for a client whose requirements no GPU here meets."""
        reasons = "; ".join(f"GPU {g.index} ({g.name}): {self.why_not(g)}" for g in gpus)
        return (f"no GPU on this server meets the request ({self.describe()}): {reasons}. "
                "Change GPUPOOL_GPU / GPUPOOL_GPU_MODEL / GPUPOOL_MIN_MEMORY, or use another "
                "server")

    def too_many(self, gpus: Iterable[Gpu]) -> str | None:
        """The refusal when fewer GPUs of this server meet the requirements than the process
        asks for (GPUPOOL_GPUS): they would never all be free at once. None when enough do."""
        gpus = list(gpus)
        matching = sum(1 for g in gpus if self.matches(g))
        if matching >= self.gpus:
            return None
        which = "" if matching == len(gpus) else f" that meet the request ({self.describe()})"
        return (f"GPUPOOL_GPUS asked for {self.gpus} GPUs at once, and this server has "
                f"{matching} GPU{'' if matching == 1 else 's'}{which}; ask for at most "
                f"{matching} (GPUPOOL_GPUS / gpus =) or use a server with {self.gpus}")
