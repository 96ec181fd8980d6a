"""The routing step: which model a request runs on and whether its answer is already cached.

`RoutingStep` holds the step's optional parts for the app: the sentence encoder (embedder.py,
also behind /v1/embeddings), the semantic cache (semantic_cache.py) and the model router
(model_router.py). The model pool (pool.py) resolves the chosen name to an engine client, and
cache_scope.py salts the prefix cache per key.

The plan builder (generation/plan.py) calls, in order: `route(req)` (which model a request with
model "auto" goes to), the pool's `resolve`, then `from_cache(...)` (a Hit and, with `verify`, the
request's CachePlan: the hit's tokens go to the engine as the request's draft and the run is a
miss's with them verified; without `verify` the run streams the stored answer as a cached source;
or None and the request's CachePlan), and, when the answer is complete, the lease calls
`store(gen, plan)` (which also counts how the verification went).

Both the router and the cache look at the same thing: the embedding of the request's last user
message, normalized (semantic_text.normalize). `route` returns it as a `QueryEmbedding` that
`from_cache` takes, so a request embeds its query once (a routed miss also stores that vector).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter

from kvserve.errors import Overloaded
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.routing.embedder import Embedder, QueryEmbedding
from kvserve.server.routing.model_router import ModelRouter
from kvserve.server.routing.semantic_cache import (
    CacheBackend,
    CacheOptions,
    CachePlan,
    Hit,
    SemanticCache,
    SQLiteBackend,
    bypass_reason,
    make_plan,
)
from kvserve.server.stores.redis_cache import RedisCacheBackend

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvserve.server.gates.admission import Admission
    from kvserve.server.routing.pool import ModelPool
    from kvserve.server.settings import ServerSettings

GenerationRequest = ChatCompletionRequest | CompletionRequest
logger = logging.getLogger("kvserve.server")


class RoutingStep:
    def __init__(self, admission: Admission, registry: CollectorRegistry, embedder: Embedder,
                 cache: SemanticCache | None, router: ModelRouter | None = None):
        self.admission = admission
        self.embedder = embedder
        self.cache = cache
        self.router = router
        r = registry
        self.cache_queries = Counter("kvserve:semantic_cache_queries", "Chat requests looked up in the semantic "
                                     "cache, by result (hit, miss, or the bypass reason).", ["model_name", "result"],
                                     registry=r)
        self.cache_hits = Counter("kvserve:semantic_cache_hits", "Chat requests answered from the semantic cache.",
                                  ["model_name"], registry=r)
        self.cache_verified = Counter("kvserve:semantic_cache_verified", "Semantic-cache candidates the model "
                                      "checked, by result (verified, partial, rejected).", ["model_name", "result"],
                                      registry=r)
        self.router_decisions = Counter("kvserve:router_decisions", "Requests the router sent to each model.",
                                        ["router", "model_name", "reason"], registry=r)

    @classmethod
    def create(cls, s: ServerSettings, pool: ModelPool, admission: Admission,
               registry: CollectorRegistry) -> RoutingStep:
        embedder = Embedder(registry)
        cache = None
        if s.semantic_cache and s.load_model:
            options = CacheOptions.from_dict(s.semantic_cache_options or {})
            if s.redis_url:   # shared by every replica on this Redis (stores/redis_cache.py)
                backend: CacheBackend = RedisCacheBackend(s.redis_url, options.ttl_s)
            else:
                backend = SQLiteBackend(s.data_dir / "semantic_cache.db", options.max_entries)
            cache = SemanticCache(backend, embedder, options)
        router = ModelRouter.from_config(s.router, pool, embedder) if s.router else None
        step = cls(admission, registry, embedder, cache, router)
        if (cache is not None or router is not None) and s.load_model:   # load the encoder in the background
            threading.Thread(target=step._warm, name="kvserve-encoder-load", daemon=True).start()
        return step

    def _warm(self) -> None:
        try:
            self.embedder.encode_sync(["warm up"], use="warmup")
            if self.router is not None:
                self.router.load()
        except Exception:   # reported on first use instead
            logger.exception("sentence encoder / router failed to load")

    def model_cards(self, created: int) -> list[dict]:
        cards = [self.embedder.card(created)]
        if self.router is not None:
            cards.insert(0, self.router.card(created))
        return cards

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
        self.embedder.close()

    # ---- the router -----------------------------------------------------------------------
    async def route(self, req: GenerationRequest, kind: str, tier: str,
                    made: QueryEmbedding | None = None) -> tuple[str | None, dict | None, QueryEmbedding | None]:
        """The model a request goes to, the router's decision for the trace (None: not routed), and
        the query's embedding when the router computed it (for `from_cache`). `made`: the embedding
        input moderation made of the last message (used when it is the router's query text)."""
        if self.router is None or req.model != self.router.name:
            return req.model, None, None
        # The semantic cache will embed this query after the router unless it is bypassed: then
        # the router's forward runs the whole depth and hands the embedding on (one forward).
        full_later = self.cache is not None and bypass_reason(req, self.cache.options) is None
        query = QueryEmbedding(self.router.query_text(req, kind), full_later=full_later)
        if made is not None and made.text == query.text:     # input moderation embedded it already
            query.vectors.update(made.vectors)
        decision = await self.router.choose(req, kind, overloaded=self.admission.prefers_cheaper(tier),
                                            query=query)
        if decision["model"] is None:
            raise Overloaded("The models are still loading; retry in a few seconds.", retry_after=5.0,
                             code="model_not_ready")
        self.router_decisions.labels(self.router.name, decision["model"], decision["reason"]).inc()
        return decision["model"], decision, query

    # ---- the semantic cache ---------------------------------------------------------------
    async def from_cache(self, req: GenerationRequest, kind: str, model_name: str, key_name: str | None, capped: bool,
                         query: QueryEmbedding | None = None,
                         moderation=None) -> tuple[Hit | None, CachePlan | None]:
        """(the hit, its CachePlan with `verify`, else None) or (None, the key a complete answer is
        stored under; None: bypassed). `moderation`: the caller's policy (a partition field)."""
        if self.cache is None:
            return None, None
        options = self.cache.options
        reason = "max_tokens_capped" if capped else bypass_reason(req, options)
        if reason is None and options.verify and req.seed is not None and req.temperature != 0:
            reason = "seeded"     # its tokens must not depend on a draft, so a candidate could not help
        if reason is not None:
            self.cache_queries.labels(model_name, "bypass_" + reason).inc()
            return None, None
        plan = make_plan(req, model_name, key_name, options, moderation)
        try:
            if query is None or query.text != plan.text:
                query = QueryEmbedding(plan.text)
            t0 = time.perf_counter()    # the lookup's time includes the embedding when it runs here
            hit = await self.cache.lookup(plan, await query.get(self.embedder, "semantic_cache"))
            if hit is not None:
                hit.lookup_ms = (time.perf_counter() - t0) * 1000
        except Exception:   # noqa: BLE001 - the encoder failed to load: serve without the cache
            self.cache_queries.labels(model_name, "error").inc()
            return None, None
        if hit is None:
            self.cache_queries.labels(model_name, "miss").inc()
            return None, plan
        self.cache_queries.labels(model_name, "hit").inc()
        self.cache_hits.labels(model_name).inc()
        hit.min_logprob = options.sampled_min_logprob
        return hit, (plan if options.verify else None)

    def store(self, plan: CachePlan | None, candidate: Hit | None, model_name: str, answer: CachedAnswer) -> None:
        """After a complete answer (one choice, no tool calls, no reasoning; the lease picks it):
        store it under the request's plan, unless it is a candidate the model verified whole (the
        stored answer is this one)."""
        if self.cache is None or plan is None:
            return
        if candidate is not None:
            result = candidate.verification(answer.token_ids, answer.finish_reason)["result"]
            self.cache_verified.labels(model_name, result).inc()
            if result == "verified":
                return
        self.cache.store(plan, answer.content, answer.finish_reason or "", answer.prompt_tokens,
                         answer.completion_tokens, list(answer.token_ids))


@dataclass(frozen=True)
class CachedAnswer:
    """The one choice of a finished answer, as the semantic cache stores it."""

    content: str
    token_ids: Sequence[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
