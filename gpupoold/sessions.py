"""The registry of live sessions: one per client connection handed to a worker.

Issue 4 turns sessions into leases (persisted, one client per GPU, with a queue); the registry is
the in-memory view the API and the scheduler read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Session:
    id: int
    gpu: int  # inventory index
    peer: str  # client address as the daemon saw it
    client_host: str
    client_user: str
    client_pid: int
    program: str
    started: float = field(default_factory=time.time)
    worker_pid: int | None = None

    def describe(self) -> str:
        return (f"{self.client_user}@{self.client_host} pid {self.client_pid} "
                f"({self.program or '?'}) from {self.peer}")

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id, "gpu": self.gpu, "peer": self.peer,
            "client": {"host": self.client_host, "user": self.client_user,
                       "pid": self.client_pid, "program": self.program},
            "started": self.started, "worker_pid": self.worker_pid,
        }


class SessionRegistry:
    def __init__(self) -> None:
        self._sessions: dict[int, Session] = {}
        self._last_id = 0

    def new_id(self) -> int:
        self._last_id += 1
        return self._last_id

    def add(self, session: Session) -> None:
        self._sessions[session.id] = session

    def remove(self, session_id: int) -> Session | None:
        return self._sessions.pop(session_id, None)

    def get(self, session_id: int) -> Session | None:
        return self._sessions.get(session_id)

    def all(self) -> list[Session]:
        return sorted(self._sessions.values(), key=lambda s: s.id)

    def on_gpu(self, gpu: int) -> list[Session]:
        return [s for s in self.all() if s.gpu == gpu]

    def __len__(self) -> int:
        return len(self._sessions)
