"""The server's one sentence encoder (`Embedder`) and a request's query embedding.

The encoder (model/bert.py, all-MiniLM-L6-v2) is shared by /v1/embeddings, the semantic cache and
the router. It loads on first use in a worker thread (a second or two), or at startup when a
feature that needs it is on; every encode runs off the event loop and is timed into
`kvserve:embedding_latency_seconds`.

Concurrent calls are coalesced: while one forward runs, the texts of every call that arrives
meanwhile wait in a queue and go together into the next forward (one batch, sorted by length), so
N requests that each embed one query cost about one batched forward, not N (the >= 500
sentences/s the encoder reaches only in batches). A lone call starts at once: nothing waits for a
batch to fill.

Fairness: a forward holds at most `SLICE_TEXTS` texts and `SLICE_CHARS` characters (a text
counted as at most `WINDOW_CHARS`, about the encoder's 256-token window: at most one window of
tokens a forward, about 50 ms on one core of a Xeon, so a 75 ms chat stays within 2x). A big call (an /v1/embeddings request of
hundreds of inputs) is cut into slices that take turns with the other waiting calls, round robin,
so two big requests share the encoder instead of one waiting for the other. The lookups on a
request's path (`use` not in `BULK_USES`: the semantic cache, the router, moderation) wait for no
slice at all: they have their own lane, a queue and a thread of their own (`_Lane`), so a chat's
lookup runs beside a big call's forward, not after it (one 256-token text is a forward of about
100 ms on a busy core; a short lookup is a few). That lane slices too, in its own smaller slices:
a conversation of hundreds of turns has as many moderation windows, and another chat's lookup
waits for one slice of them, not all. Forwards run on the lanes' threads, never in
asyncio's default pool: template rendering, store reads and usage writes in that pool never
queue behind embeddings. The bulk lane also counts tokens and formats responses (`run`).

The `/v1/embeddings` route over this encoder is api/embeddings.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram

from kvserve.errors import Overloaded

if TYPE_CHECKING:
    import numpy as np

EMBEDDING_MODEL = "all-minilm-l6-v2"
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SLICE_TEXTS = 16      # texts per forward, and
SLICE_CHARS = 512     # their characters: how long a big call holds the bulk lane at a time
LOOKUP_SLICE_TEXTS = 8      # the lookup lane's slices: a request's many moderation windows (a long
LOOKUP_SLICE_CHARS = 1024   # conversation) take turns with other requests' one-text lookups
WINDOW_CHARS = 1024   # a longer text costs no more than this (the encoder truncates at 256 tokens)
BULK_USES = {"api", "batch"}   # the encoder's callers off a request's path: /v1/embeddings (and rerank), batch lines


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
        return await self.features(embedder, use, (depth,))

    async def features(self, embedder: Embedder, use: str, depths: tuple) -> np.ndarray:
        """The query's vectors at `depths`, side by side (one forward for those not made yet)."""
        missing = {d for d in depths if d not in self.vectors}
        if missing:
            want = missing | ({None} if self.full_later else set())
            vecs, _ = await embedder.encode_depths([self.text], tuple(want), use=use)
            self.vectors.update({d: v[0].numpy() for d, v in vecs.items()})
        if len(depths) == 1:
            return self.vectors[depths[0]]
        from kvserve.safety.head import features

        return features(self.vectors, depths)


def shutting_down() -> Overloaded:
    """The error of an encoder call the server's shutdown cut (503, retryable: not a 500)."""
    return Overloaded("The server is shutting down; retry the request (on another replica or when it is back).",
                      retry_after=5.0)


class _Lane:
    """Calls waiting for forwards, the flag of the task draining them, and the one thread that runs
    them."""

    def __init__(self, name: str, slice_texts: int, slice_chars: int):
        self.slice_texts, self.slice_chars = slice_texts, slice_chars
        self.queue: list[_Call] = []
        self.draining = False
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)


@dataclass(eq=False)
class _Call:
    """One `encode_depths` call waiting for (the rest of) its vectors."""

    texts: list[str]
    depths: tuple
    use: str
    fut: asyncio.Future
    done: int = 0                                       # texts already encoded
    parts: list[dict] = field(default_factory=list)     # per forward: {depth: rows}
    counts: list[int] = field(default_factory=list)

    @property
    def lookup(self) -> bool:
        return self.use not in BULK_USES


class Embedder:
    """The shared encoder behind a lock-free lazy load; `encode` is async (runs on the encoder's
    thread, concurrent calls coalesced and sliced; see the module's docstring)."""

    def __init__(self, registry: CollectorRegistry | None = None, name: str = EMBEDDING_MODEL,
                 slice_texts: int = SLICE_TEXTS, slice_chars: int = SLICE_CHARS):
        self.name = name
        self.slice_texts, self.slice_chars = slice_texts, slice_chars
        self._encoder = None
        self._lock = threading.Lock()
        self._bulk = _Lane("kvserve-embed", slice_texts, slice_chars)
        self._lookups = _Lane("kvserve-embed-lookup", LOOKUP_SLICE_TEXTS, LOOKUP_SLICE_CHARS)
        self.batches = 0    # forwards run by `encode` (coalesced calls count once)
        self.closed = False
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

    async def run(self, fn, *args: Any) -> Any:
        """`fn(*args)` on the encoder's thread (tokenizing a request's inputs, say)."""
        return await asyncio.get_running_loop().run_in_executor(self._bulk.executor, fn, *args)

    async def token_counts(self, texts: list[str]) -> list[int]:
        """Each text's tokens as the encoder counts them (truncated at its sequence length)."""
        return await self.run(lambda: self.get().token_counts(texts))

    async def encode(self, texts: list[str], use: str = "api"):
        """([n, dim] tensor of unit rows, tokens), computed on the encoder's thread together with
        the other calls waiting at that moment."""
        vecs, tokens = await self.encode_depths(texts, (None,), use)
        return vecs[None], tokens

    async def encode_depths(self, texts: list[str], depths: tuple, use: str = "api"):
        """({depth: [n, dim] unit rows}, tokens): vectors pooled after `depth` layers (None: the
        full embedding; model/bert.py `encode_depths`), coalesced with waiting calls that ask
        for the same depths."""
        depths = tuple(sorted(set(depths), key=repr))     # canonical: calls asking the same coalesce
        if self.closed:
            raise shutting_down()
        if not texts:
            vecs, _ = await self.run(self._encode_counted, [], use, depths)
            return vecs, 0
        call = _Call(list(texts), depths, use, asyncio.get_running_loop().create_future())
        lane = self._lookups if call.lookup else self._bulk
        lane.queue.append(call)
        if not lane.draining:
            lane.draining = True
            asyncio.get_running_loop().create_task(self._drain(lane))
        try:
            return await call.fut
        finally:   # a caller gone (cancelled) stops costing forwards
            if call in lane.queue:
                lane.queue.remove(call)

    def _next_batch(self, lane: _Lane) -> list[tuple[_Call, int]]:
        """The lane's next forward's (call, texts taken): the waiting calls in turn, all asking for
        the depths of the first one, each up to the lane's slice of texts and characters (at least
        one text a forward), a call with texts left going to the back of the queue."""
        queue = list(lane.queue)
        depths = queue[0].depths
        texts, chars, batch = lane.slice_texts, lane.slice_chars, []
        for call in queue:
            if call.depths != depths:
                continue
            take = 0
            for text in call.texts[call.done:]:
                cost = min(len(text), WINDOW_CHARS)
                first = not batch and take == 0      # a forward takes at least one text
                if not first and (texts <= 0 or cost > chars):
                    break
                take, texts, chars = take + 1, texts - 1, chars - cost
            if take == 0:
                break
            batch.append((call, take))
        for call, take in batch:
            lane.queue.remove(call)
            if call.done + take < len(call.texts):
                lane.queue.append(call)
        return batch

    async def _drain(self, lane: _Lane) -> None:
        import torch

        loop = asyncio.get_running_loop()
        try:
            while lane.queue:
                batch = self._next_batch(lane)
                texts = [t for call, take in batch for t in call.texts[call.done:call.done + take]]
                self.batches += 1
                try:
                    vecs, counts = await loop.run_in_executor(lane.executor, self._encode_counted, texts,
                                                              batch[0][0].use, batch[0][0].depths)
                except BaseException as e:   # every call in the forward gets the error
                    if self.closed and isinstance(e, RuntimeError):   # the executor shut down under it
                        e = shutting_down()
                    for call, _ in batch:
                        if call in lane.queue:
                            lane.queue.remove(call)
                        if not call.fut.done():
                            call.fut.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
                    continue
                at = 0
                for call, take in batch:
                    call.parts.append({d: v[at:at + take] for d, v in vecs.items()})
                    call.counts += counts[at:at + take]
                    call.done += take
                    at += take
                    if call.done == len(call.texts) and not call.fut.done():
                        whole = {d: torch.cat([p[d] for p in call.parts]) for d in call.depths}
                        call.fut.set_result((whole, sum(call.counts)))
        finally:
            lane.draining = False

    def _encode_counted(self, texts: list[str], use: str, depths: tuple = (None,)):
        from kvserve.model.bert import one_thread

        t0 = time.perf_counter()
        enc = self.get()
        with one_thread():
            vecs, counts = enc.encode_depths(texts, tuple(enc.layers if d is None else d for d in depths))
        self.latency.labels(use).observe(time.perf_counter() - t0)
        return {d: vecs[enc.layers if d is None else d] for d in depths}, counts

    def card(self, created: int) -> dict:
        return {"id": self.name, "object": "model", "created": created, "owned_by": "kvserve",
                "kvserve_kind": "embedding", "dimensions": 384}

    def close(self) -> None:
        self.closed = True
        for lane in (self._bulk, self._lookups):
            lane.executor.shutdown(wait=False, cancel_futures=True)
