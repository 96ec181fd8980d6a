"""Live counters in this process's memory (the embedded default of `CounterBackend`)."""

from __future__ import annotations

import threading
from collections import Counter


class MemoryCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def incr(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        pass
