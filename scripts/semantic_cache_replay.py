"""Replay a held-out run's requests (kvserve.bench.semantic_heldout's "records") through a semantic
cache's keys and lookup, without the model, and count what that cache would have served without
verification: hits, and false hits (a served answer that is not the model's own for the request).

Uses only what the cache module had before issue 47 too (make_plan, SemanticCache, SQLiteBackend,
CacheOptions, Embedder), so the same script measures the previous cache from its own tree:

    git archive 10357bd src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src python scripts/semantic_cache_replay.py records.json   # the old keys
    PYTHONPATH=src python scripts/semantic_cache_replay.py records.json            # the new keys
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys
import tempfile

from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.routing.embedder import Embedder
from kvserve.server.routing.semantic_cache import CacheOptions, SemanticCache, SQLiteBackend, make_plan


def main(path: str) -> dict:
    from prometheus_client import CollectorRegistry

    records = json.loads(pathlib.Path(path).read_text())["records"]
    with tempfile.TemporaryDirectory() as d:
        options = CacheOptions()
        cache = SemanticCache(SQLiteBackend(pathlib.Path(d) / "c.db"), Embedder(CollectorRegistry()), options)
        out: dict = {}
        seen: set = set()
        for r in records:
            req = ChatCompletionRequest(messages=[{"role": "user", "content": r["content"]}], temperature=0,
                                        max_tokens=16)
            plan = make_plan(req, "m", None, options)
            hit = asyncio.run(cache.lookup(plan))
            s = out.setdefault(r["set"], {"asked": 0, "hits": 0, "false_hits": 0})
            first = (r["set"], r["group"]) not in seen
            seen.add((r["set"], r["group"]))
            if not first:
                s["asked"] += 1
                s["hits"] += hit is not None
                s["false_hits"] += hit is not None and hit.entry.answer != r["own"]
            if hit is None:      # a miss stores the model's answer, as the server does
                cache.store(plan, r["own"], "length", 0, 0)
        cache.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), indent=1))
