"""The routing step: which model a request runs on, and whether it needs to run at all.

    step.py            `RoutingStep`, what the plan builder calls: route, then the cache lookup
    pool.py            the served models (`ModelPool.resolve(name)` → engine client; 404/503)
    residency.py       models on demand: loaded at first use, held by requests, unloaded when idle
    model_router.py    the "auto" model: a classifier picks the cheapest model good enough
    semantic_cache.py  answers stored by meaning, looked up by the query's embedding
    embedder.py        the one sentence encoder (router, cache and /v1/embeddings), calls coalesced
    cache_scope.py     the prefix-cache salt: which callers may share cached KV blocks
"""
