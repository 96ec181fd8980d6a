"""`POST /v1/rerank` (Cohere's and Jina's shape; also at /rerank and /v2/rerank, where the cohere
client sends it) and `POST /v1/score` (vLLM's shape), over the server's one sentence encoder
(routing/embedder.py): a relevance score is the cosine of the two texts' unit vectors.

    /v1/rerank {"query": "...", "documents": ["...", {"text": "..."}], "top_n": 3, "return_documents": true}
      -> {"id", "model", "results": [{"index", "relevance_score", "document": {"text"}}], "usage"}
         (best first; `document` unless return_documents is false)
    /v1/score  {"text_1": "q" | ["a", ...], "text_2": "d" | ["d1", ...]}
      -> {"id", "object": "list", "created", "model", "data": [{"index", "object": "score", "score"}], "usage"}
         (one text_1 against every text_2, or pair by pair for lists of equal length)

Every text of a request goes into one batched encoder call, charged to the key's token bucket and
usage ledger (gates/encoder_usage.py) and capped like /v1/embeddings (count and length of texts).
Cosines are in [-1, 1]; unrelated texts score near 0.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from kvserve.errors import InvalidRequest, ModelNotFound
from kvserve.server.gates.encoder_usage import charged_encode
from kvserve.server.protocol import _Strict, read_request

if TYPE_CHECKING:
    from kvserve.server.state import ServerState

MAX_DOCUMENTS = 1000
MAX_TEXT_CHARS = 100_000


class RerankDocument(BaseModel):
    text: str


class RerankRequest(_Strict):
    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    max_tokens_per_doc: int | None = Field(default=None, ge=1)   # the encoder reads 512 at most anyway
    priority: int | None = None     # Cohere's; one queue here


class ScoreRequest(_Strict):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)   # the encoder reads 512 at most anyway
    user: str | None = None


def check_texts(texts: list, param: str) -> None:
    """400 unless `texts` holds 1 to MAX_DOCUMENTS non-empty strings of at most MAX_TEXT_CHARS."""
    if not texts:
        raise InvalidRequest(f"{param} is empty.", param=param)
    if len(texts) > MAX_DOCUMENTS:
        raise InvalidRequest(f"{param} holds {len(texts)} texts; at most {MAX_DOCUMENTS} per request.", param=param)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidRequest(f"{param}[{i}] is not a string (this server embeds text).", param=param)
        if not t:
            raise InvalidRequest(f"{param}[{i}] is an empty string.", param=param)
        if len(t) > MAX_TEXT_CHARS:
            raise InvalidRequest(f"{param}[{i}] is longer than {MAX_TEXT_CHARS} characters.", param=param)


def _check_model(gw: ServerState, model: str | None) -> str:
    name = gw.routing.embedder.name
    if model not in (None, "", name):
        raise ModelNotFound(f"The model {model!r} cannot score; rerank and score use the sentence encoder "
                            f"{name!r}.", param="model")
    return name


async def rerank(gw: ServerState, request: Request) -> dict:
    req = await read_request(request, RerankRequest, gw.settings)
    model = _check_model(gw, req.model)
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    check_texts([req.query], "query")
    check_texts(docs, "documents")
    vecs, tokens = await charged_encode(gw, request.state.record, [req.query, *docs])
    scores = (vecs[1:] @ vecs[0]).tolist()
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or len(docs)]
    results = []
    for i in order:
        item = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
            "usage": {"total_tokens": tokens}, "meta": {"billed_units": {"search_units": 1}}}


async def score(gw: ServerState, request: Request) -> dict:
    req = await read_request(request, ScoreRequest, gw.settings)
    model = _check_model(gw, req.model)
    left = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    right = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    check_texts(left, "text_1")
    check_texts(right, "text_2")
    if len(left) != 1 and len(left) != len(right):
        raise InvalidRequest(f"text_1 holds {len(left)} texts and text_2 {len(right)}: send one text_1 to score "
                             "against every text_2, or lists of the same length to score pair by pair.",
                             param="text_1")
    vecs, tokens = await charged_encode(gw, request.state.record, [*left, *right])
    a, b = vecs[:len(left)], vecs[len(left):]
    scores = ((b @ a[0]) if len(left) == 1 else (a * b).sum(dim=1)).tolist()
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")   # the last two: where the cohere client sends it


def mount_rerank(app: FastAPI, gw: ServerState) -> None:
    """/v1/rerank (and /rerank, /v2/rerank) and /v1/score."""

    async def rerank_route(request: Request) -> dict:
        return await rerank(gw, request)

    async def score_route(request: Request) -> dict:
        return await score(gw, request)

    for path in RERANK_PATHS:
        app.add_api_route(path, rerank_route, methods=["POST"])
    app.add_api_route("/v1/score", score_route, methods=["POST"])
