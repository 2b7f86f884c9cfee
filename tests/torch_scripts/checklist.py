"""What the torch scripts share: counting checks, saying each failed one, and the last line
`PASS NAME: N checks` or `FAIL NAME: K of N checks failed` that the tests read.

The scripts run as programs (`python tests/torch_scripts/x.py`), so this folder is first on
sys.path and they import this module by its name.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable


class Checklist:
    def __init__(self, name: str) -> None:
        self.name = name
        self.checks = 0
        self.failures: list[str] = []

    def check(self, cond: bool, what: str) -> bool:
        self.checks += 1
        if not cond:
            self.failures.append(what)
            print(f"  check failed: {what}", flush=True)
        return cond

    def section(self, fn: Callable[[], None], label: str = "") -> None:
        """Runs one group of checks; an exception counts as one failed check, with its trace."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the next group
            self.check(False, f"{label or fn.__name__} raised {type(exc).__name__}: {exc}")
            traceback.print_exc()

    def finish(self, note: str = "") -> int:
        """Prints the last line (with `note` in brackets, if any); the exit status."""
        tail = f" ({note})" if note else ""
        if self.failures:
            print(f"FAIL {self.name}: {len(self.failures)} of {self.checks} checks failed{tail}")
            return 1
        print(f"PASS {self.name}: {self.checks} checks{tail}")
        return 0
