"""`POST /v1/embeddings` in OpenAI's shape, over the server's one sentence encoder
(routing/embedder.py, shared with the semantic cache and the model router).

    {"input": "text" | ["text", ...], "model": "all-minilm-l6-v2", "encoding_format": "float" | "base64",
     "dimensions": 384}
    -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...] | "base64"}],
        "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}

base64 is the little-endian float32 bytes of each vector (what the openai SDK decodes). Token-id
inputs (OpenAI's tiktoken ids) mean nothing to this encoder and are refused with a 400.

Cost: a request holds at most `--max-embedding-inputs` inputs and `--max-embedding-tokens` tokens
(counted as the encoder counts them, on its thread, before any forward; 400 naming `input`
past either). Those tokens are reserved from the key's token bucket like a chat's prompt
(generation/lease.py's `Reservation`: 429 when the bucket cannot hold them) and written to the
usage ledger as prompt tokens. The encoder interleaves big requests' slices with the other
callers' (routing/embedder.py), so none of them starves a chat's semantic-cache lookup.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from kvserve.errors import InvalidRequest, ModelNotFound
from kvserve.server.gates.encoder_usage import charged_encode
from kvserve.server.generation import ClientGone, until_disconnected
from kvserve.server.protocol import _Strict, read_request
from kvserve.server.routing.embedder import Embedder

if TYPE_CHECKING:
    from kvserve.server.state import ServerState

MAX_INPUT_CHARS = 100_000


class EmbeddingRequest(_Strict):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


def _texts(req: EmbeddingRequest, max_inputs: int) -> list[str]:
    inp = req.input
    texts = [inp] if isinstance(inp, str) else inp
    if not texts:
        raise InvalidRequest("input is empty; send a string or a list of strings.", param="input")
    if not all(isinstance(t, str) for t in texts):
        raise InvalidRequest("input holds token ids; this server embeds text: send strings.", param="input")
    if len(texts) > max_inputs:
        raise InvalidRequest(f"input holds {len(texts)} items; at most {max_inputs} per request: send them in "
                             "several requests.", param="input")
    for i, t in enumerate(texts):
        if not t:
            raise InvalidRequest(f"input[{i}] is an empty string.", param="input")
        if len(t) > MAX_INPUT_CHARS:
            raise InvalidRequest(f"input[{i}] is longer than {MAX_INPUT_CHARS} characters.", param="input")
    return texts


def mount_embeddings(app: FastAPI, server: ServerState, embedder: Embedder) -> None:
    settings = server.settings

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req = await read_request(request, EmbeddingRequest, settings)
        try:
            vecs, tokens = await embed_texts(server, embedder, request, req)
        except ClientGone:
            return Response(status_code=499)
        body = await embedder.run(_body, vecs, req.encoding_format, embedder.name, tokens)
        return Response(body, media_type="application/json")


async def embed_texts(server: ServerState, embedder: Embedder, request: Request, req: EmbeddingRequest):
    """The vectors and token count of a validated request, under its caps and charged to its key
    (Ollama's /api/embed renders them in its own shape: api/ollama.py). A client that hangs up
    stops costing forwards: its texts leave the encoder's queue (ClientGone; nothing is charged)."""
    settings = server.settings
    if req.model not in (None, "", embedder.name):
        raise ModelNotFound(f"The model {req.model!r} is not an embedding model of this server; use "
                            f"{embedder.name!r}.", param="model")
    texts = _texts(req, settings.max_embedding_inputs)
    if req.dimensions is not None and req.dimensions != 384:
        raise InvalidRequest(f"{embedder.name} makes 384-dimensional vectors; dimensions={req.dimensions} "
                             "is not supported.", param="dimensions")
    return await until_disconnected(request.receive, charged_encode(server, request.state.record, texts))


def _body(vecs, encoding_format: str, model: str, tokens: int) -> bytes:
    """The response's JSON (`json_body`)."""
    rows = ([base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() for v in vecs]
            if encoding_format == "base64" else vecs.tolist())
    return json_body({"object": "list",
                      "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(rows)],
                      "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def json_body(obj) -> bytes:
    """`obj` as JSON, tensors as lists of floats, run on the encoder's thread (never the event loop)
    by msgspec's encoder: a 200 x 384 list of floats in about 8 ms where the standard library's
    takes 70, the same numbers (each float's shortest round-trip text)."""
    import msgspec

    return msgspec.json.encode(obj, enc_hook=lambda t: t.tolist())
