"""What the shared state backends cost per request, against the embedded ones, every variant
interleaved so the machine's load hits them alike. Issue 20's numbers in BENCHMARKS.md.

    PYTHONPATH=src python scripts/bench_state_backends.py [--rounds 15] [--calls 200]

Starts its own redis-server and PostgreSQL (tests/server/state_servers.py) on free ports and
measures, per call (median over rounds of the mean of `--calls` calls):
- the request bucket: `acquire_request` in memory vs the Redis Lua script;
- key lookup: SQLite (in memory after the first) vs PostgreSQL (one indexed query) vs PostgreSQL
  behind the Redis key cache (a hit);
- the usage-ledger upsert: SQLite vs PostgreSQL;
- a whole authenticated `GET /v1/models` through an in-process gateway (no model): embedded
  stores vs PostgreSQL + Redis (auth, bucket, counters and x-ratelimit headers).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics as st
import sys
import tempfile
import time

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "server"))

from conftest import InProcessServer
from state_servers import PostgresServer, RedisServer

from kvserve.server.gates.ratelimit import RateLimiter
from kvserve.server.settings import ServerSettings
from kvserve.server.stores.factory import open_key_backend
from kvserve.server.stores.redis_state import RedisRateLimiter, connect_redis


def per_call_us(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    redis_srv, pg = RedisServer(), PostgresServer()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvserve-bench-state-"))
    try:
        r_url, db_url = redis_srv.fresh_url(), pg.new_database()
        big = 10**9
        mem, red = RateLimiter(), RedisRateLimiter(connect_redis(r_url))
        sqlite_keys = open_key_backend(tmp / "k.db")
        pg_keys = open_key_backend(None, db_url)
        cached = open_key_backend(None, db_url, r_url)
        k_sqlite, k_pg = sqlite_keys.create("bench"), pg_keys.create("bench")
        embedded = InProcessServer(ServerSettings(load_model=False, data_dir=tmp / "e")).__enter__()
        shared = InProcessServer(ServerSettings(load_model=False, data_dir=tmp / "s", database_url=pg.new_database(),
                                                redis_url=redis_srv.fresh_url())).__enter__()
        http = httpx.Client()
        servers = {}
        for name, srv in (("embedded", embedded), ("shared", shared)):
            key = srv.state.keystore.create("bench", rpm=big)
            servers[name] = (srv.base_url + "/v1/models", {"Authorization": f"Bearer {key}"})

        def get(name: str):
            url, headers = servers[name]
            return lambda: http.get(url, headers=headers).raise_for_status()

        variants = {
            "bucket: memory": lambda: mem.acquire_request("k", big),
            "bucket: Redis Lua": lambda: red.acquire_request("k", big),
            "key lookup: SQLite": lambda: sqlite_keys.lookup(k_sqlite),
            "key lookup: PostgreSQL": lambda: pg_keys.lookup(k_pg),
            "key lookup: PostgreSQL + Redis cache": lambda: cached.lookup(k_pg),
            "ledger upsert: SQLite": lambda: sqlite_keys.record_usage("bench", 10, 5, 0),
            "ledger upsert: PostgreSQL": lambda: pg_keys.record_usage("bench", 10, 5, 0),
            "GET /v1/models: embedded": get("embedded"),
            "GET /v1/models: PostgreSQL + Redis": get("shared"),
        }
        for fn in variants.values():   # warm up (connections, caches)
            per_call_us(fn, 20)
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                samples[name].append(per_call_us(fn, args.calls))
        print(f"{'per call':<40} {'median us':>10} {'p10':>8} {'p90':>8}")
        for name, xs in samples.items():
            q = st.quantiles(xs, n=10)
            print(f"{name:<40} {st.median(xs):>10.0f} {q[0]:>8.0f} {q[-1]:>8.0f}")
        http.close()
        for srv in (embedded, shared):
            srv.__exit__(None, None, None)
        for s in (sqlite_keys, pg_keys, cached):
            s.close()
    finally:
        redis_srv.stop()
        pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
