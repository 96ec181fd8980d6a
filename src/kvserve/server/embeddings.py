"""`POST /v1/embeddings` (OpenAI's shape) and the server's one sentence encoder.

The encoder (model/bert.py, all-MiniLM-L6-v2) is shared by this endpoint, the semantic cache and
the router. It loads on first use in a worker thread (a second or two), or at startup when a
feature that needs it is on; every encode runs off the event loop and is timed into
`kvserve:embedding_latency_seconds`.

Concurrent calls are coalesced: while one forward runs in the worker thread, the texts of every
call that arrives meanwhile wait in a queue and go together into the next forward (one batch,
sorted by length), so N requests that each embed one query cost about one batched forward, not N
(the >= 500 sentences/s the encoder reaches only in batches). A lone call starts at once: nothing
waits for a batch to fill.

    {"input": "text" | ["text", ...], "model": "all-minilm-l6-v2", "encoding_format": "float" | "base64",
     "dimensions": 384}
    -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...] | "base64"}],
        "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}

base64 is the little-endian float32 bytes of each vector (what the openai SDK decodes). Token-id
inputs (OpenAI's tiktoken ids) mean nothing to this encoder and are refused with a 400.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI, Request
from prometheus_client import Histogram
from pydantic import Field

from kvserve.errors import InvalidRequest, KVServeError, ModelNotFound, Overloaded
from kvserve.server.gates.limits import read_body
from kvserve.server.protocol import _Strict, parse_body

if TYPE_CHECKING:
    import numpy as np

EMBEDDING_MODEL = "all-minilm-l6-v2"
MAX_INPUTS = 2048
MAX_INPUT_CHARS = 100_000
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EmbeddingRequest(_Strict):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


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

    def __init__(self, registry=None, name: str = EMBEDDING_MODEL):
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


def _texts(req: EmbeddingRequest) -> list[str]:
    inp = req.input
    texts = [inp] if isinstance(inp, str) else inp
    if not texts:
        raise InvalidRequest("input is empty; send a string or a list of strings.", param="input")
    if not all(isinstance(t, str) for t in texts):
        raise InvalidRequest("input holds token ids; this server embeds text: send strings.", param="input")
    if len(texts) > MAX_INPUTS:
        raise InvalidRequest(f"input holds {len(texts)} items; at most {MAX_INPUTS} per request.", param="input")
    for i, t in enumerate(texts):
        if not t:
            raise InvalidRequest(f"input[{i}] is an empty string.", param="input")
        if len(t) > MAX_INPUT_CHARS:
            raise InvalidRequest(f"input[{i}] is longer than {MAX_INPUT_CHARS} characters.", param="input")
    return texts


def mount_embeddings(app: FastAPI, server, embedder: Embedder) -> None:
    settings = server.settings

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        req = parse_body(await read_body(request, settings.max_body_bytes, settings.body_timeout_s),
                         EmbeddingRequest, settings.max_json_depth)
        if req.model not in (None, "", embedder.name):
            raise ModelNotFound(f"The model {req.model!r} is not an embedding model of this server; use "
                                f"{embedder.name!r}.", param="model")
        texts = _texts(req)
        if req.dimensions is not None and req.dimensions != 384:
            raise InvalidRequest(f"{embedder.name} makes 384-dimensional vectors; dimensions={req.dimensions} "
                                 "is not supported.", param="dimensions")
        try:
            vecs, tokens = await embedder.encode(texts)
        except (KVServeError, OSError) as e:   # the weights package missing or broken: the server stays up
            raise Overloaded(f"The embedding model could not be loaded: {getattr(e, 'message', e)}", retry_after=30.0,
                             code="model_not_ready") from None
        data = []
        for i, v in enumerate(vecs):
            emb = (base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() if req.encoding_format == "base64"
                   else v.tolist())
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return {"object": "list", "data": data, "model": embedder.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
