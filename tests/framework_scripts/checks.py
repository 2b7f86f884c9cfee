"""What every framework probe shares: counted checks, sections that report an exception as one
failed check (so one broken part never hides the others), and the one summary line the GPU
validation reads (`PASS NAME: N checks` or `FAIL NAME: K of N checks failed`, exit 1)."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable


class Checks:
    def __init__(self, name: str) -> None:
        self.name = name
        self.total = 0
        self.failed = 0

    def check(self, cond: bool, what: str) -> None:
        self.total += 1
        if not cond:
            self.failed += 1
            print(f"  check failed: {what}", flush=True)

    def section(self, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the next part runs
            self.total += 1
            self.failed += 1
            print(f"  check failed: {fn.__name__} raised {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
        print(f"  {fn.__name__}: {time.perf_counter() - t0:.2f} s", flush=True)

    def finish(self) -> None:
        if self.failed:
            print(f"FAIL {self.name}: {self.failed} of {self.total} checks failed", flush=True)
            sys.exit(1)
        print(f"PASS {self.name}: {self.total} checks", flush=True)
