"""The server's one sentence encoder (`Embedder`) and a request's query embedding.

The encoder (model/bert.py, all-MiniLM-L6-v2) is shared by /v1/embeddings, the semantic cache and
the router. It loads on first use in a worker thread (a second or two), or at startup when a
feature that needs it is on; every encode runs off the event loop and is timed into
`kvserve:embedding_latency_seconds`.

Concurrent calls are coalesced: while one forward runs in the worker thread, the texts of every
call that arrives meanwhile wait in a queue and go together into the next forward (one batch,
sorted by length), so N requests that each embed one query cost about one batched forward, not N
(the >= 500 sentences/s the encoder reaches only in batches). A lone call starts at once: nothing
waits for a batch to fill.

The `/v1/embeddings` route over this encoder is api/embeddings.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram

if TYPE_CHECKING:
    import numpy as np

EMBEDDING_MODEL = "all-minilm-l6-v2"
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COALESCE_MAX_TEXTS = 256    # a call with more texts runs alone (it is a batch already)


class QueryEmbedding:
    """One request's query text (normalized last user message) and its vectors, computed on first
    use and shared by the router and the semantic cache: the embedding (the encoder's full depth)
    and the router's shallower feature (`depth` layers). `full_later`: the semantic cache will ask
    for the embedding after the router, so the router's forward goes the whole depth and keeps both
    (one forward per request); otherwise it stops at the router's depth."""

    def __init__(self, text: str, full_later: bool = True):
        self.text = text
        self.full_later = full_later
        self.vectors: dict[int | None, np.ndarray] = {}

    @property
    def vector(self) -> np.ndarray | None:
        """The full-depth embedding, if computed."""
        return self.vectors.get(None)

    async def get(self, embedder: Embedder, use: str, depth: int | None = None) -> np.ndarray:
        """The query's vector at `depth` layers (None: the full embedding)."""
        if depth not in self.vectors:
            want = {depth} | ({None} if self.full_later else set())
            vecs, _ = await embedder.encode_depths([self.text], tuple(want), use=use)
            self.vectors.update({d: v[0].numpy() for d, v in vecs.items()})
        return self.vectors[depth]


class Embedder:
    """The shared encoder behind a lock-free lazy load; `encode` is async (runs in a thread,
    concurrent calls coalesced into one forward)."""

    def __init__(self, registry: CollectorRegistry | None = None, name: str = EMBEDDING_MODEL):
        self.name = name
        self._encoder = None
        self._lock = threading.Lock()
        self._queue: list[tuple[list[str], asyncio.Future, str, tuple]] = []
        self._draining = False
        self.batches = 0    # forwards run by `encode` (coalesced calls count once)
        self.latency = Histogram("kvserve:embedding_latency_seconds", "Time to embed one batch of texts.",
                                 ["use"], buckets=LATENCY_BUCKETS, registry=registry)

    def get(self):
        """The encoder, loading it on first call (blocking)."""
        if self._encoder is None:
            with self._lock:
                if self._encoder is None:
                    from kvserve.model.bert import default_encoder

                    self._encoder = default_encoder()
        return self._encoder

    def layers(self) -> int:
        """The encoder's depth, read from its config when it is not loaded yet."""
        if self._encoder is not None:
            return self._encoder.layers
        from kvserve.model.bert import encoder_layers

        return encoder_layers()

    def encode_sync(self, texts: list[str], use: str = "api"):
        """([n, dim] tensor of unit rows, tokens) in this thread."""
        t0 = time.perf_counter()
        out = self.get().encode(texts)
        self.latency.labels(use).observe(time.perf_counter() - t0)
        return out

    async def encode(self, texts: list[str], use: str = "api"):
        """([n, dim] tensor of unit rows, tokens), computed in a worker thread together with the
        other calls waiting at that moment."""
        vecs, tokens = await self.encode_depths(texts, (None,), use)
        return vecs[None], tokens

    async def encode_depths(self, texts: list[str], depths: tuple, use: str = "api"):
        """({depth: [n, dim] unit rows}, tokens): vectors pooled after `depth` layers (None: the
        full embedding; model/bert.py `encode_depths`), coalesced with waiting calls that ask
        for the same depths."""
        depths = tuple(sorted(set(depths), key=lambda d: -1 if d is None else d))
        if len(texts) > COALESCE_MAX_TEXTS:
            self.batches += 1
            vecs, counts = await asyncio.to_thread(self._encode_counted, texts, use, depths)
            return vecs, sum(counts)
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((texts, fut, use, depths))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._queue:
                depths = self._queue[0][3]     # one forward per set of depths, oldest first
                calls = [c for c in self._queue if c[3] == depths]
                self._queue = [c for c in self._queue if c[3] != depths]
                texts = [t for c in calls for t in c[0]]
                self.batches += 1
                try:
                    vecs, counts = await asyncio.to_thread(self._encode_counted, texts, calls[0][2], depths)
                except BaseException as e:   # every waiting call gets the error
                    for _, fut, _, _ in calls:
                        if not fut.done():
                            fut.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
                    continue
                at = 0
                for call_texts, fut, _, _ in calls:
                    n = len(call_texts)
                    if not fut.done():
                        fut.set_result(({d: v[at:at + n] for d, v in vecs.items()}, sum(counts[at:at + n])))
                    at += n
        finally:
            self._draining = False

    def _encode_counted(self, texts: list[str], use: str, depths: tuple = (None,)):
        t0 = time.perf_counter()
        enc = self.get()
        vecs, counts = enc.encode_depths(texts, tuple(enc.layers if d is None else d for d in depths))
        self.latency.labels(use).observe(time.perf_counter() - t0)
        return {d: vecs[enc.layers if d is None else d] for d in depths}, counts

    def card(self, created: int) -> dict:
        return {"id": self.name, "object": "model", "created": created, "owned_by": "kvserve",
                "kvserve_kind": "embedding", "dimensions": 384}
