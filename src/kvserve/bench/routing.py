"""`python -m kvserve.bench.routing`: the routing step's numbers.

1. embeddings: sentences/s of `model/bert.py` on 1,000 sentences in batches (wall and this
   process's CPU seconds, fp32 and the bf16 path, then the default path on one thread), and the
   CPU ms of a one-query forward;
2. a semantic-cache hit end to end: a real `kvserve serve` (default model, `--router auto`), one
   question asked, then paraphrases of it over HTTP: wall p50 per request, and the lookup's own
   time (embedding + match, `kvserve_trace.semantic_cache.lookup_ms`), and the floor: the same
   request refused at validation (a 400), i.e. HTTP, middleware and parsing alone;
3. the router's overhead: `kvserve_trace.router.router_ms` of model "auto" requests (p50), split
   into the query's embedding (`embed_ms`, reused by the semantic cache) and the classifier;
4. coalesced embeddings: 32 concurrent callers of one sentence each through the server's Embedder.

Wall times need a quiet machine; the CPU ms the server process spends per request (all threads,
from /proc) and this process's CPU seconds are the figures that hold under load.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PARAPHRASES = ["Which city is the capital of France?", "Tell me the capital of France.",
               "What's the capital city of France?", "Name the capital of France."]


def embeddings(n: int = 1000) -> dict:
    import torch

    from kvserve.bench.semantic_pairs import pairs
    from kvserve.model.bert import default_encoder

    enc = default_encoder()
    _, asked = pairs()
    texts = [p.query for p in asked][:n]
    enc.encode(texts[:64])
    out = {"sentences": len(texts), "threads": torch.get_num_threads()}
    default_bf16 = enc.bf16
    for bf16 in (False, True, False, True):
        enc.bf16 = bf16
        t, c = time.perf_counter(), time.process_time()
        enc.encode(texts)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        key = "bf16" if bf16 else "fp32"
        best = out.get(key, {"per_s_wall": 0})
        if len(texts) / wall > best["per_s_wall"]:
            out[key] = {"per_s_wall": round(len(texts) / wall, 1), "per_cpu_s": round(len(texts) / cpu, 1)}
    enc.bf16 = default_bf16
    one, t, c = texts[:60], time.perf_counter(), time.process_time()
    for q in one:     # a lookup's or a routing decision's forward: one short query, one thread
        enc.encode([q])
    out["one_query"] = {"cpu_ms": round(1000 * (time.process_time() - c) / len(one), 2),
                        "wall_ms": round(1000 * (time.perf_counter() - t) / len(one), 2)}
    torch.set_num_threads(1)
    enc.encode(texts[:64])
    t, c = time.perf_counter(), time.process_time()
    enc.encode(texts)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    out["one_thread"] = {"per_s_wall": round(len(texts) / wall, 1), "per_cpu_s": round(len(texts) / cpu, 1)}
    torch.set_num_threads(out["threads"])
    return out


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) the process has used so far (Linux /proc)."""
    from pathlib import Path

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server(requests: int = 40) -> dict:
    """Three blocks of `requests` HTTP requests each, one at a time: cache hits, the validation
    floor, routed requests; wall p50 per request and the server process's CPU ms per request."""
    import httpx

    from kvserve.bench.common import wait_healthy
    from kvserve.bench.serve_launch import free_port

    port, data = free_port(), tempfile.mkdtemp(prefix="kvserve-routing-bench-")
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.server", "serve", "--port", str(port), "--data-dir",
                             data, "--router", "auto", "--kv-cache-memory", "128MiB"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base)
        with httpx.Client(base_url=base, timeout=120) as c:
            def ask(q: str, **kw) -> httpx.Response:
                return c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": q}],
                                                            "max_tokens": 16, "temperature": 0, **kw})
            ask("What is the capital of France?")
            for q in PARAPHRASES:
                ask(q)   # warm
            walls: dict[str, list[float]] = {"hit": [], "floor": [], "routed": []}
            cpu: dict[str, float] = {}
            lookups, routes, embeds, classify = [], [], [], []
            for block, times in walls.items():
                c0 = _cpu_s(proc.pid)
                for i in range(requests):
                    t = time.perf_counter()
                    if block == "hit":
                        r = ask(PARAPHRASES[i % len(PARAPHRASES)], kvserve_trace=True)
                        assert r.headers.get("x-kvserve-cache") == "semantic", r.text
                        lookups.append(r.json()["kvserve_trace"]["semantic_cache"]["lookup_ms"])
                    elif block == "floor":   # the same HTTP path, refused at validation
                        assert ask("What is the capital of France?", temperature=5).status_code == 400
                    else:
                        r = ask(f"Write a function number {i} that parses JSON, with tests.", model="auto",
                                cache=False, max_tokens=1, kvserve_trace=True)
                        route = r.json()["kvserve_trace"]["router"]
                        routes.append(route["router_ms"])
                        embeds.append(route["embed_ms"])
                        classify.append(route["classify_ms"])
                    times.append(time.perf_counter() - t)
                cpu[block] = 1000 * (_cpu_s(proc.pid) - c0) / requests
        return {"cache_hit_p50_ms": round(1000 * statistics.median(walls["hit"]), 2),
                "cache_hit_min_ms": round(1000 * min(walls["hit"]), 2),
                "cache_hit_server_cpu_ms": round(cpu["hit"], 2),
                "cache_lookup_p50_ms": round(statistics.median(lookups), 2),
                "http_floor_p50_ms": round(1000 * statistics.median(walls["floor"]), 2),
                "http_floor_server_cpu_ms": round(cpu["floor"], 2),
                "router_p50_ms": round(statistics.median(routes), 2), "router_min_ms": round(min(routes), 2),
                "router_embed_p50_ms": round(statistics.median(embeds), 2),
                "router_classify_p50_ms": round(statistics.median(classify), 3),
                "routed_request_server_cpu_ms": round(cpu["routed"], 2), "requests": requests}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def coalesced(n: int = 256, concurrency: int = 32) -> dict:
    """Sentences/s when `concurrency` callers each embed one sentence at a time through the
    server's Embedder (what concurrent lookups and routing do): coalesced into shared forwards."""
    import asyncio

    from kvserve.bench.semantic_pairs import pairs
    from kvserve.server.routing.embedder import Embedder

    emb = Embedder()
    texts = [p.query for p in pairs()[1]][:n]
    emb.encode_sync(texts[:8])

    async def run() -> None:
        queue = list(texts)

        async def worker() -> None:
            while queue:
                await emb.encode([queue.pop()])
        await asyncio.gather(*(worker() for _ in range(concurrency)))

    emb.batches = 0
    t, c = time.perf_counter(), time.process_time()
    asyncio.run(run())
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    return {"sentences": n, "concurrency": concurrency, "forwards": emb.batches,
            "per_s_wall": round(n / wall, 1), "per_cpu_s": round(n / cpu, 1)}


if __name__ == "__main__":
    print(json.dumps({"load": os.getloadavg(), "embeddings": embeddings(), "coalesced": coalesced(),
                      "server": server(), "load_after": os.getloadavg()}, indent=2))
