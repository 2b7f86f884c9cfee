"""Named event counters of the daemon (refusals, connections, lease ends...), kept in memory.

The API shows a snapshot (`/api/v1/status`); the Prometheus exporter reads the same object. A
counter is a name plus optional labels: `counters.inc("auth_refused", reason="expired")`.
Only code on the event loop touches it, so it needs no lock.
"""

from __future__ import annotations

from collections import Counter


class Counters:
    def __init__(self) -> None:
        self._values: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()

    def inc(self, name: str, amount: int = 1, **labels: str) -> None:
        self._values[(name, tuple(sorted(labels.items())))] += amount

    def get(self, name: str, **labels: str) -> int:
        return self._values[(name, tuple(sorted(labels.items())))]

    def total(self, name: str) -> int:
        """The sum over every label set of `name`."""
        return sum(v for (n, _), v in self._values.items() if n == name)

    def by_label(self, name: str, label: str) -> dict[str, int]:
        """{value of `label`: count} of the counter `name` (its other labels summed)."""
        out: dict[str, int] = {}
        for (n, labels), value in self._values.items():
            if n == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0) + value
        return out

    def snapshot(self) -> dict[str, object]:
        """{name: int} for unlabelled counters, {name: {"label=value,...": int}} for labelled."""
        out: dict[str, object] = {}
        for (name, labels), value in sorted(self._values.items()):
            if not labels:
                out[name] = value
                continue
            bucket = out.setdefault(name, {})
            assert isinstance(bucket, dict)
            bucket[",".join(f"{k}={v}" for k, v in labels)] = value
        return out
