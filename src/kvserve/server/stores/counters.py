"""Live counters (cumulative, named): in this process's memory by default, in Redis
(redis_state.RedisCounters) with --redis-url, summed over every replica."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Protocol

from prometheus_client.core import CounterMetricFamily

from kvserve.errors import KVServeError


class CounterBackend(Protocol):
    def incr(self, name: str, amount: int = 1) -> None: ...
    def snapshot(self) -> dict[str, int]: ...
    def close(self) -> None: ...


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


class CountersCollector:
    """Prometheus view of the live counters: `kvserve:gateway_requests_total{outcome=...}` (summed
    over every replica when the counters are in Redis; left out of a scrape when Redis is down)."""

    def __init__(self, counters) -> None:
        self.counters = counters

    def collect(self):
        try:
            counts = self.counters.snapshot()
        except KVServeError:
            return
        family = CounterMetricFamily("kvserve:gateway_requests", "Requests the gateway let through "
                                     "(outcome=requests) or refused (rate_limited, refused_401, refused_503), "
                                     "over every server sharing the counters.", labels=["outcome"])
        for name, value in sorted(counts.items()):
            family.add_metric([name], float(value))
        yield family
