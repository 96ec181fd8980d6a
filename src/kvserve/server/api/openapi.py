"""`GET /openapi.json`: the OpenAPI 3.1 document with the real request bodies (the pydantic models
of protocol.py, not `dict`) and the error body of each operation's API (OpenAI's; Anthropic's on
/v1/messages, Ollama's on /api/*) as its error response, so schema-driven clients and fuzzers
(schemathesis, in tests/server/test_fuzz_api.py) can use the API.

The routes read raw bodies (gates/limits.py), so FastAPI cannot see their models: `openapi()` adds
each route's body from `BODIES` and its answers from `RESPONSES`. A new route with a body adds a
line to each.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import kvserve
from kvserve.server.api.anthropic import CountTokensRequest, MessagesRequest
from kvserve.server.api.batches import BatchRequest
from kvserve.server.api.embeddings import EmbeddingRequest
from kvserve.server.api.ollama import ChatBody, EmbedBody, GenerateBody
from kvserve.server.api.ollama_models import ShowBody
from kvserve.server.api.rerank import RERANK_PATHS, RerankRequest, ScoreRequest
from kvserve.server.error_shapes import api_of
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


class OllamaErrorResponse(BaseModel):
    error: str


ERRORS = {"openai": ErrorResponse, "anthropic": AnthropicErrorResponse, "ollama": OllamaErrorResponse}


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None          # generative models
    cost_per_1k_tokens: float | None = None   # generative models (docs/routing.md)
    kvserve_kind: Literal["embedding", "router"] | None = None
    dimensions: int | None = None             # the embedding model
    routes_to: list[str] | None = None        # the router


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    model: str
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: Literal["ok", "loading", "error"]
    engine: str | None = None
    replicas: dict[str, int] | None = None     # Ray replicas: slots by state (starting, serving, draining...)


class StoredMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str
    trace: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None


class ConversationCreate(BaseModel):
    title: str | None = None
    model: str | None = None
    settings: dict[str, Any] | None = None
    messages: list[StoredMessage] | None = None


class ConversationUpdate(BaseModel):
    title: str | None = None
    model: str | None = None
    settings: dict[str, Any] | None = None


class MessagesPut(BaseModel):
    messages: list[StoredMessage]
    start: int | None = None


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None = None
    expires_at: int | None = None


class CursorPage(BaseModel):
    """OpenAI's cursor page (api/files.py's `page`): a list model names its `data`'s items."""

    object: Literal["list"]
    data: list[Any]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class FileList(CursorPage):
    data: list[FileObject]


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: dict[str, Any] | None = None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled",
                    "expired"]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    expires_at: int | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchCounts
    metadata: dict[str, str] | None = None


class BatchList(CursorPage):
    data: list[BatchObject]


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: dict[str, str] | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: dict[str, int]
    meta: dict[str, Any] | None = None


class ScoreItem(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreItem]
    usage: dict[str, int]


FILE_UPLOAD = {"type": "object", "required": ["file", "purpose"],
               "properties": {"file": {"type": "string", "format": "binary"},
                              "purpose": {"type": "string", "enum": ["batch", "user_data"]}}}

CONV = "/v1/kvserve/conversations"
BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/completions", "post"): CompletionRequest,
    ("/tokenize", "post"): TokenizeRequest,
    ("/detokenize", "post"): DetokenizeRequest,
    ("/v1/embeddings", "post"): EmbeddingRequest,
    (CONV, "post"): ConversationCreate,
    (CONV + "/{conv_id}", "patch"): ConversationUpdate,
    (CONV + "/{conv_id}/messages", "post"): MessagesPut,
    ("/v1/messages", "post"): MessagesRequest,               # Anthropic (api/anthropic.py)
    ("/v1/messages/count_tokens", "post"): CountTokensRequest,
    ("/api/chat", "post"): ChatBody,                          # Ollama (api/ollama.py)
    ("/api/generate", "post"): GenerateBody,
    ("/api/embed", "post"): EmbedBody,
    ("/api/show", "post"): ShowBody,
    **{(path, "post"): RerankRequest for path in RERANK_PATHS},
    ("/v1/score", "post"): ScoreRequest,
    ("/v1/batches", "post"): BatchRequest,
}
STREAMS = {"/v1/chat/completions": "text/event-stream", "/v1/completions": "text/event-stream",
           "/v1/responses": "text/event-stream", "/v1/messages": "text/event-stream",
           "/api/chat": "application/x-ndjson", "/api/generate": "application/x-ndjson"}
RESPONSES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/models", "get"): ModelList,
    ("/v1/models/{model_id}", "get"): ModelCard,
    ("/tokenize", "post"): TokenizeResponse,
    ("/detokenize", "post"): DetokenizeResponse,
    ("/health", "get"): Health,
    ("/v1/files", "post"): FileObject,
    ("/v1/files", "get"): FileList,
    ("/v1/files/{file_id}", "get"): FileObject,
    ("/v1/files/{file_id}", "delete"): FileDeleted,
    ("/v1/batches", "post"): BatchObject,
    ("/v1/batches", "get"): BatchList,
    ("/v1/batches/{batch_id}", "get"): BatchObject,
    ("/v1/batches/{batch_id}/cancel", "post"): BatchObject,
    **{(path, "post"): RerankResponse for path in RERANK_PATHS},
    ("/v1/score", "post"): ScoreResponse,
}


def openapi(app: FastAPI) -> dict:
    """The document, built once: FastAPI's paths plus the bodies and answers it cannot see."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title="kvserve", version=kvserve.__version__, routes=app.routes,
                      description="OpenAI-compatible API of kvserve; see docs/api.md.")
    models = {*BODIES.values(), *RESPONSES.values(), *ERRORS.values()}
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    components = doc.setdefault("components", {})
    components.setdefault("schemas", {}).update(defs.get("$defs", {}))
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                      "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    doc["security"] = [{"bearer": []}, {"x-api-key": []}, {}]

    def ref(m: type[BaseModel]) -> dict:
        return {"$ref": f"#/components/schemas/{m.__name__}"}

    for path, ops in doc.get("paths", {}).items():
        api = api_of(path)      # each API's own error body (error_shapes.py)
        error = {"description": f"An error in {api}'s shape", "content": {"application/json": {
            "schema": ref(ERRORS[api])}}}
        for method, op in ops.items():
            body = BODIES.get((path, method))
            if body is not None:
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(body)}}}
            if (path, method) == ("/v1/files", "post"):
                op["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": FILE_UPLOAD}}}
            ok = RESPONSES.get((path, method))
            content = {"application/json": {"schema": ref(ok) if ok else {}}}
            if method == "post" and path in STREAMS:
                content[STREAMS[path]] = {"schema": {}}    # each event (line): a chunk or an error body
            if path == "/metrics":
                content = {"text/plain": {"schema": {"type": "string"}}}
            if path == "/v1/files/{file_id}/content":
                content = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
            op["responses"] = {"200": {"description": "OK", "content": content}, "default": error}
    app.openapi_schema = doc
    return doc


def mount_openapi(app: FastAPI) -> None:
    """Serve the document at /openapi.json (FastAPI's own is off: it cannot see the bodies)."""
    app.openapi = lambda: openapi(app)   # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_json() -> dict:
        return openapi(app)
