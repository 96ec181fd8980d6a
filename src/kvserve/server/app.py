"""The FastAPI app: `create_app(engine, settings)`.

The HTTP server comes up at once; the model loads in a background thread, and until it has
/health answers 503 and generation endpoints answer 503 with Retry-After. Every error a client
can cause leaves as an OpenAI-shaped body (`{"error": {message, type, param, code}}`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.errors import InvalidRequest, KVServeError, ModelNotFound, Overloaded
from kvserve.server.admission import Admission
from kvserve.server.cache_scope import CacheScope
from kvserve.server.conformance import mount_conformance
from kvserve.server.handlers import mount
from kvserve.server.keys import KeyStore
from kvserve.server.limits import read_body
from kvserve.server.lora_admin import lora_model_cards, mount_lora
from kvserve.server.metrics import ServerMetrics
from kvserve.server.middleware import GatewayMiddleware
from kvserve.server.protocol import DetokenizeRequest, TokenizeRequest, parse_body
from kvserve.server.ratelimit import RateLimiter
from kvserve.server.settings import ServerSettings

logger = logging.getLogger("kvserve.server")


class ServerState:
    """What the routes share: settings, the engine once loaded, keys, limits, admission, metrics."""

    def __init__(self, engine, settings: ServerSettings):
        self.settings = settings
        self.engine = engine
        self.load_error: str | None = None
        self.on_load_failed = None   # set by `kvserve serve`: stop the server, exit non-zero
        self.engine_restarts = 0
        self.keystore = KeyStore(settings.db_path)
        self.limiter = RateLimiter()
        self.cache_scope = CacheScope(settings.prefix_cache_scope, settings.shared_prompts)
        self.admission = Admission(settings)
        self.http_ns = 0    # the generation handlers' time on the event loop (stages, formatting, writes)
        self.metrics = ServerMetrics(self.engine_stats, lambda: self.model_name or "")
        self.metrics.gateway_waiting.set_function(lambda: self.admission.num_waiting)

    @property
    def model_name(self) -> str | None:
        if self.engine is None:
            return None
        return self.settings.served_model_name or self.engine.model_name

    def engine_stats(self) -> dict | None:
        """The engine's stats, its step profile (`phase_seconds`) completed with the two phases
        that run on this server's event loop: `output` (the engine client's output processing:
        detokenization, stop strings, RequestOutputs) and `http` (stages, SSE/JSON formatting and
        the socket writes)."""
        if self.engine is None:
            return None
        stats = self.engine.stats()
        stats["phase_seconds"] = {**(stats.get("phase_seconds") or {}),
                                  "output": self.engine.outputs.process_ns / 1e9, "http": self.http_ns / 1e9}
        return stats

    def require_engine(self, requested: str | None):
        if self.engine is None:
            msg = (f"The model failed to load: {self.load_error}" if self.load_error else
                   "The model is still loading; retry in a few seconds.")
            raise Overloaded(msg, retry_after=5.0, code="model_not_ready")
        name = self.model_name
        if requested not in (None, "", name, self.engine.model_name):
            if requested in self.engine.lora_names():   # a LoRA adapter over this engine's base
                return self.engine.with_lora(requested), requested
            raise ModelNotFound(f"The model {requested!r} does not exist on this server; it serves {name!r} "
                                "(GET /v1/models).", param="model")
        return self.engine, name

    def load(self) -> None:
        """Runs in a background thread: build the engine client (blocking), then start it. The
        client is the only handle on the engine: in this process or in its own (--engine-process)."""
        from kvserve.engine.client import make_engine_client

        s = self.settings
        try:
            engine = make_engine_client(s.model, engine_process=s.engine_process, weight_format=s.weight_format,
                                        **s.engine_kwargs)
        except Exception as e:
            self.load_error = str(e)
            if not isinstance(e, KVServeError):
                logger.exception("model load failed")
            if self.on_load_failed is not None:
                self.on_load_failed(self.load_error)   # `kvserve serve` prints it and exits 1
            elif isinstance(e, KVServeError):
                logger.error("model load failed: %s", e)
            return
        fut = asyncio.run_coroutine_threadsafe(engine.start(), self.loop)
        fut.result()
        self.engine = engine
        logger.info("model %s loaded", engine.model_name)


    async def watch_engine(self, every_s: float = 0.5) -> None:
        """Restart an engine process that died: its in-flight requests end with a retryable 503
        (EngineDeadError), /health says "loading" and new requests get 503 + Retry-After until the
        new engine is up. An in-process engine dies only with this process."""
        while True:
            await asyncio.sleep(every_s)
            engine = self.engine
            if engine is None or getattr(engine, "kind", None) != "process":
                continue
            try:
                engine.health()
                continue
            except KVServeError as e:
                message = e.message
            logger.error("the engine process died (%s); restarting it", message)
            self.engine = None
            self.engine_restarts += 1
            engine.fail_all(message)
            with contextlib.suppress(Exception):
                await engine.shutdown()
            threading.Thread(target=self.load, name="kvserve-model-reload", daemon=True).start()


def _error_response(err: KVServeError) -> JSONResponse:
    headers = {}
    retry_after = getattr(err, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(retry_after + 0.999)))
        headers["x-should-retry"] = "false" if getattr(err, "should_retry", True) is False else "true"
    return JSONResponse(err.to_dict(), status_code=err.status, headers=headers)


def create_app(engine, settings: ServerSettings) -> FastAPI:
    """The server app. With `engine=None` (and settings.load_model) the model loads after startup."""
    state = ServerState(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        if state.engine is not None:
            await state.engine.start()
        elif settings.load_model:
            threading.Thread(target=state.load, name="kvserve-model-load", daemon=True).start()
        watchdog = asyncio.create_task(state.watch_engine()) if settings.load_model else None
        yield
        if watchdog is not None:
            watchdog.cancel()
        if state.engine is not None:
            with contextlib.suppress(Exception):
                await state.engine.shutdown()
        state.keystore.close()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    @app.exception_handler(KVServeError)
    async def _kvserve_error(request: Request, exc: KVServeError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse({"error": {"message": f"{exc.detail}: {request.method} {request.url.path}",
                                       "type": "invalid_request_error", "param": None, "code": code}},
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse({"error": {"message": "Internal server error.", "type": "server_error",
                                       "param": None, "code": "internal_error"}}, status_code=500)

    mount(app, state)   # /v1/chat/completions, /v1/completions
    mount_lora(app, state)   # /v1/load_lora_adapter, /v1/unload_lora_adapter

    @app.get("/v1/models")
    async def models() -> dict:
        data = []
        if state.engine is not None:
            data.append({"id": state.model_name, "object": "model", "created": int(time.time()),
                         "owned_by": "kvserve", "max_model_len": state.engine.max_model_len})
            data += lora_model_cards(state)
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> Response:
        """Open without a key, so it says only ok / loading / error and which engine client runs;
        the reason for an error is in the server's log."""
        if state.engine is None:
            body = {"status": "error"} if state.load_error else {"status": "loading"}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        kind = getattr(state.engine, "kind", None)   # which engine client: "inproc" or "process"
        try:
            if hasattr(state.engine, "health"):
                state.engine.health()   # raises when the engine (process) is gone
        except KVServeError:
            return JSONResponse({"status": "error", "engine": kind}, status_code=503,
                                headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok", "engine": kind})

    @app.get("/version")
    async def version() -> dict:
        return {"version": kvserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = parse_body(await read_body(request, settings.max_body_bytes, settings.body_timeout_s),
                         TokenizeRequest, settings.max_json_depth)
        engine, name = state.require_engine(req.model)
        tok = engine.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("Send exactly one of prompt or messages.", param="prompt")
        if req.messages is not None:
            from kvserve.server.context import template_messages
            from kvserve.server.tools import make_plan

            msgs, tools = template_messages(tok, req.messages, make_plan(req.tools, "auto", None))
            text = await asyncio.to_thread(tok.apply_chat_template, msgs, tools=tools,
                                           add_generation_prompt=req.add_generation_prompt)
            ids = await asyncio.to_thread(tok.encode, text, add_special_tokens=False)
        else:
            ids = await asyncio.to_thread(tok.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        out = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len, "model": name}
        if req.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = parse_body(await read_body(request, settings.max_body_bytes, settings.body_timeout_s),
                         DetokenizeRequest, settings.max_json_depth)
        engine, _ = state.require_engine(req.model)
        vocab = getattr(engine.tokenizer, "vocab_size", None)
        if any(t < 0 or (vocab is not None and t >= vocab) for t in req.tokens):
            raise InvalidRequest("tokens holds an id outside the vocabulary.", param="tokens")
        text = await asyncio.to_thread(engine.tokenizer.decode, req.tokens, skip_special_tokens=False)
        return {"prompt": text}

    if importlib.util.find_spec("kvserve.server.webui") is not None:
        from kvserve.server.webui import mount_webui

        mount_webui(app, settings.db_path, settings.store_limits())
        from kvserve.server.arena import mount_arena

        mount_arena(app, settings.db_path, settings.arena_contestants)
    mount_conformance(app, state)   # /v1/models/{id}, /tokenizer_info, /openapi.json

    app.add_middleware(GatewayMiddleware, keystore=state.keystore, api_key=settings.api_key,
                       limiter=state.limiter)
    return app
