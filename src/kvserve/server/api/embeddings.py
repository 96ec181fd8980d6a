"""`POST /v1/embeddings` in OpenAI's shape, over the server's one sentence encoder
(routing/embedder.py, shared with the semantic cache and the model router).

    {"input": "text" | ["text", ...], "model": "all-minilm-l6-v2", "encoding_format": "float" | "base64",
     "dimensions": 384}
    -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...] | "base64"}],
        "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}

base64 is the little-endian float32 bytes of each vector (what the openai SDK decodes). Token-id
inputs (OpenAI's tiktoken ids) mean nothing to this encoder and are refused with a 400.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI, Request
from pydantic import Field

from kvserve.errors import InvalidRequest, KVServeError, ModelNotFound, Overloaded
from kvserve.server.protocol import _Strict, read_request
from kvserve.server.routing.embedder import Embedder

if TYPE_CHECKING:
    from kvserve.server.app import ServerState

MAX_INPUTS = 2048
MAX_INPUT_CHARS = 100_000


class EmbeddingRequest(_Strict):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


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


def mount_embeddings(app: FastAPI, server: ServerState, embedder: Embedder) -> None:
    settings = server.settings

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        return await create_embeddings(embedder, request, await read_request(request, EmbeddingRequest, settings))


async def create_embeddings(embedder: Embedder, request: Request, req: EmbeddingRequest) -> dict:
    """The `/v1/embeddings` answer to a validated request (Ollama's /api/embed renders it in its own
    shape: api/ollama.py)."""
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
