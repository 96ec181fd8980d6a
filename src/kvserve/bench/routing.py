"""`python -m kvserve.bench.routing`: the routing step's numbers.

1. embeddings: sentences/s of `model/bert.py` on 1,000 sentences in batches (wall and this
   process's CPU seconds, fp32 and the bf16 path);
2. a semantic-cache hit end to end: a real `kvserve serve` (default model, `--router auto`), one
   question asked, then paraphrases of it over HTTP: wall p50 per request, and the lookup's own
   time (embedding + match, `kvserve_trace.semantic_cache.lookup_ms`), and the floor: the same
   request refused at validation (a 400), i.e. HTTP, middleware and parsing alone;
3. the router's overhead: `kvserve_trace.router.router_ms` of model "auto" requests (p50).
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
    for bf16 in (False, True, False, True):
        enc.bf16 = bf16
        t, c = time.perf_counter(), time.process_time()
        enc.encode(texts)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        key = "bf16" if bf16 else "fp32"
        best = out.get(key, {"per_s_wall": 0})
        if len(texts) / wall > best["per_s_wall"]:
            out[key] = {"per_s_wall": round(len(texts) / wall, 1), "per_cpu_s": round(len(texts) / cpu, 1)}
    enc.bf16 = None
    return out


def server(requests: int = 40) -> dict:
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
            hits, lookups, routes, floors = [], [], [], []
            for i in range(requests):
                t = time.perf_counter()
                r = ask(PARAPHRASES[i % len(PARAPHRASES)], kvserve_trace=True)
                hits.append(time.perf_counter() - t)
                assert r.headers.get("x-kvserve-cache") == "semantic", r.text
                lookups.append(r.json()["kvserve_trace"]["semantic_cache"]["lookup_ms"])
                t = time.perf_counter()
                assert ask("What is the capital of France?", temperature=5).status_code == 400
                floors.append(time.perf_counter() - t)   # the same HTTP path, refused at validation
                r = ask(f"Write a function number {i} that parses JSON, with tests.", model="auto", cache=False,
                        max_tokens=1, kvserve_trace=True)
                routes.append(r.json()["kvserve_trace"]["router"]["router_ms"])
        return {"cache_hit_p50_ms": round(1000 * statistics.median(hits), 2),
                "cache_hit_min_ms": round(1000 * min(hits), 2),
                "cache_lookup_p50_ms": round(statistics.median(lookups), 2),
                "http_floor_p50_ms": round(1000 * statistics.median(floors), 2),
                "router_p50_ms": round(statistics.median(routes), 2), "router_min_ms": round(min(routes), 2),
                "requests": requests}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    print(json.dumps({"load": os.getloadavg(), "embeddings": embeddings(), "server": server()}, indent=2))
