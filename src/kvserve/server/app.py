"""The FastAPI app: `create_app(engine, settings)`.

The HTTP server comes up at once; the model loads in a background thread, and until it has
/health answers 503 and generation endpoints answer 503 with Retry-After. Every error a client
can cause leaves as an OpenAI-shaped body (`{"error": {message, type, param, code}}`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.errors import KVServeError
from kvserve.server.api.anthropic import mount_anthropic
from kvserve.server.api.arena import mount_arena
from kvserve.server.api.batch_runner import BatchRunner
from kvserve.server.api.batches import mount_batches
from kvserve.server.api.embeddings import mount_embeddings
from kvserve.server.api.files import mount_files
from kvserve.server.api.lora_admin import mount_lora
from kvserve.server.api.models import mount_models
from kvserve.server.api.moderations import mount_moderations
from kvserve.server.api.ollama import mount_ollama
from kvserve.server.api.openai import mount_openai
from kvserve.server.api.openapi import mount_openapi
from kvserve.server.api.rerank import mount_rerank
from kvserve.server.api.responses import mount_responses
from kvserve.server.api.tokenizer import mount_tokenizer
from kvserve.server.api.webui import mount_webui
from kvserve.server.error_shapes import shape_error
from kvserve.server.gates.auth import GatewayMiddleware
from kvserve.server.settings import ServerSettings
from kvserve.server.state import ServerState

logger = logging.getLogger("kvserve.server")


def _error_response(err: KVServeError, path: str) -> JSONResponse:
    headers = {}
    retry_after = getattr(err, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(retry_after + 0.999)))
        headers["x-should-retry"] = "false" if getattr(err, "should_retry", True) is False else "true"
    headers.update(getattr(err, "headers", None) or {})   # a quota's x-ratelimit-* (api/files.py)
    return _shaped(path, err.status, err.to_dict(), headers)


def _shaped(path: str, status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    """An OpenAI-shaped error body in the shape of the API asked (error_shapes.py)."""
    status, body = shape_error(path, status, body)
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(engine, settings: ServerSettings) -> FastAPI:
    """The server app. With `engine=None` (and settings.load_model) the model loads after startup."""
    state = ServerState(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.pool.loop = state.loop
        await state.pool.start()
        if settings.load_model and any(e.engine is None for e in state.pool.pinned()):
            threading.Thread(target=state.load, name="kvserve-model-load", daemon=True).start()
        watchdog = asyncio.create_task(state.pool.watch()) if settings.load_model else None
        state.batch_runner = BatchRunner(state, state.backends.batches, state.backends.files,
                                         settings.batch_concurrency)
        state.batch_runner.start()
        yield
        await state.batch_runner.stop()
        if watchdog is not None:
            watchdog.cancel()
        await state.pool.shutdown()
        state.routing.close()
        state.backends.close()
        state.moderation.close()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    @app.exception_handler(KVServeError)
    async def _kvserve_error(request: Request, exc: KVServeError) -> JSONResponse:
        return _error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return _shaped(request.url.path, exc.status_code, {"error": {
            "message": f"{exc.detail}: {request.method} {request.url.path}", "type": "invalid_request_error",
            "param": None, "code": code}})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %r", request.url.path)   # repr: a newline in a path stays escaped
        return _shaped(request.url.path, 500, {"error": {"message": "Internal server error.", "type": "server_error",
                                                         "param": None, "code": "internal_error"}})

    mount_openai(app, state)       # /v1/chat/completions, /v1/completions
    mount_moderations(app, state)  # /v1/moderations
    mount_responses(app, state)    # /v1/responses
    mount_lora(app, state)         # /v1/load_lora_adapter, /v1/unload_lora_adapter
    mount_anthropic(app, state)    # /v1/messages, /v1/messages/count_tokens
    mount_ollama(app, state)       # /api/chat, /api/generate, /api/embed, /api/tags, ...

    @app.get("/health")
    async def health() -> Response:
        """Open without a key, so it says only ok / loading / error and which engine client runs;
        the reason for an error is in the server's log."""
        if any(e.engine is None for e in state.pool.pinned()):   # models on demand load at first use
            body = {"status": "error"} if state.load_error else {"status": "loading"}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        kind = getattr(state.engine, "kind", None)   # which engine client: "inproc" or "process"
        try:
            for e in state.pool.loaded():
                if hasattr(e.engine, "health"):
                    e.engine.health()   # raises when the engine (process) is gone
        except KVServeError:
            return JSONResponse({"status": "error", "engine": kind}, status_code=503,
                                headers={"Retry-After": "5"})
        # Ray replicas (engine/replica_supervisor.py): how many slots start, serve, drain
        states = [e.engine.replica_states() for e in state.pool.entries if hasattr(e.engine, "replica_states")]
        if not states:
            return JSONResponse({"status": "ok", "engine": kind})
        replicas = {k: sum(s[k] for s in states) for k in states[0]}
        if any(s["serving"] == 0 for s in states):     # a model's every replica is (re)starting
            return JSONResponse({"status": "loading", "engine": kind, "replicas": replicas}, status_code=503,
                                headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok", "engine": kind, "replicas": replicas})

    @app.get("/version")
    async def version() -> dict:
        return {"version": kvserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    mount_tokenizer(app, state)    # /tokenize, /detokenize, /tokenizer_info
    mount_models(app, state)       # /v1/models, /v1/models/{id}
    mount_embeddings(app, state, state.routing.embedder)   # /v1/embeddings
    mount_rerank(app, state)       # /v1/rerank (/rerank, /v2/rerank), /v1/score
    mount_files(app, state)        # /v1/files
    mount_batches(app, state)      # /v1/batches
    mount_webui(app, settings.db_path, settings.store_limits(), store=state.backends.conversations)   # /, /static
    mount_arena(app, state, settings.arena_contestants, store=state.backends.arena)   # /v1/kvserve/arena
    mount_openapi(app)             # /openapi.json

    app.add_middleware(GatewayMiddleware, keystore=state.keystore, api_key=settings.api_key,
                       limiter=state.limiter, counters=state.backends.counters, metrics_key=settings.metrics_key)
    return app
