"""The semantic cache's backends per call: SQLite (vectors mirrored in memory) vs Redis (one
HGETALL + HGET per lookup, one Lua script per store), interleaved rounds. Issue 20's numbers in
BENCHMARKS.md.

    PYTHONPATH=src python scripts/bench_semantic_cache_backends.py [--rounds 5] [--entries 20]

Starts its own redis-server (tests/server/state_servers.py); a partition of `--entries` 384-dim
entries (MiniLM's size); `nearest` 400 times and `put` 100 times per round and backend.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "server"))

from state_servers import RedisServer

from kvserve.server.routing.semantic_cache import Entry, SQLiteBackend
from kvserve.server.stores.redis_cache import RedisCacheBackend


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--entries", type=int, default=20)
    args = ap.parse_args()
    redis_server = RedisServer()
    try:
        vecs = np.random.default_rng(0).standard_normal((args.entries, 384)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        backends = {"sqlite": SQLiteBackend(pathlib.Path(tempfile.mkdtemp()) / "c.db"),
                    "redis": RedisCacheBackend(redis_server.fresh_url(), ttl_s=3600)}
        part, now = "p" * 64, time.time()
        for b in backends.values():
            for i, v in enumerate(vecs):
                b.put(Entry(f"e{i}", part, f"q{i}", v, "answer " * 20, "stop", 10, 20, now, now), 10_000)
        res: dict[str, dict[str, list[float]]] = {k: {"nearest": [], "put": []} for k in backends}
        for rnd in range(args.rounds):
            for name, b in backends.items():
                t = time.perf_counter()
                for _ in range(400):
                    b.nearest(part, vecs[3], time.time(), 3600)
                res[name]["nearest"].append((time.perf_counter() - t) / 400 * 1e3)
                t = time.perf_counter()
                for j in range(100):
                    b.put(Entry(f"x{rnd}-{j}", f"q{j % 10}", "q", vecs[j % len(vecs)], "a", "stop", 1, 1,
                                time.time(), time.time()), 10_000)
                res[name]["put"].append((time.perf_counter() - t) / 100 * 1e3)
        for name, r in res.items():
            print(name, "  ".join(f"{k}: median {np.median(v):.3f} ms (min {min(v):.3f})" for k, v in r.items()))
        for b in backends.values():
            b.close()
    finally:
        redis_server.stop()


if __name__ == "__main__":
    main()
