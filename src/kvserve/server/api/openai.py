"""OpenAI's generation routes, /v1/chat/completions and /v1/completions, read top to bottom.

    (the key's request bucket was taken by the middleware: 429)
    parse + validate (400) → build_plan: the gates (generation/plan.py) → Lease.acquire: token
    reservation (429), admission slot (waits; 503 when the queue is full) → run_generation
    (generation/run.py) → OpenAIRenderer (openai_wire.py): SSE events or one JSON body

`answer` is the whole of it after parsing; the arena (api/arena.py) renders the same stream with
the model's name hidden. `start` (plan + lease) and `deliver` (SSE, or run to the end and one
body) are the steps every generation route shares; the Responses API (api/responses.py) uses them
with its own renderer. An error after the stream started goes out as an SSE error event before
`[DONE]`; the lease gives everything back once however the response ends (generation/lease.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.errors import KVServeError
from kvserve.server.api.openai_wire import INTERNAL_ERROR, OpenAIRenderer
from kvserve.server.generation import (
    ClientGone,
    Generation,
    Kind,
    Lease,
    TokenTexts,
    build_plan,
    run_generation,
    run_to_end,
)
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, read_request

if TYPE_CHECKING:
    from kvserve.server.app import ServerState

logger = logging.getLogger("kvserve.server")


def mount_openai(app: FastAPI, gw: ServerState) -> None:
    """Add the generation routes to `app`."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer(gw, request, await read_request(request, ChatCompletionRequest, gw.settings), "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(gw, request, await read_request(request, CompletionRequest, gw.settings), "completion")


async def answer(gw: ServerState, request: Request, req: ChatCompletionRequest | CompletionRequest, kind: Kind,
                 *, model_alias: str | None = None) -> Response:
    """One validated request, planned, leased, run and rendered (SSE when it streams)."""
    gen, lease = await start(gw, request, req, kind)
    render = OpenAIRenderer(gen, TokenTexts(gen.plan.model.tokenizer), model=model_alias)

    async def whole() -> Response:
        t0 = time.perf_counter_ns()
        response = JSONResponse(render.body(), headers=gen.plan.headers)
        gw.http_ns += time.perf_counter_ns() - t0
        return response

    return await deliver(gw, request, gen, lease, lambda: sse_events(gw, gen, lease, render), whole)


async def start(gw: ServerState, request: Request, req: ChatCompletionRequest | CompletionRequest,
                kind: Kind) -> tuple[Generation, Lease]:
    """The plan (the gates, generation/plan.py) and its lease: token reservation (429), then an
    admission slot (waits; 503 when the queue is full)."""
    record = request.state.record
    gen = Generation.start(await build_plan(gw, record, req, kind))
    return gen, await Lease.acquire(gw, gen, record, request.receive)


async def deliver(gw: ServerState, request: Request, gen: Generation, lease: Lease,
                  events: Callable[[], AsyncIterator[str]], whole: Callable[[], Awaitable[Response]],
                  media_type: str = "text/event-stream") -> Response:
    """`events()` as an SSE response (`media_type`: Ollama's NDJSON) when the plan streams (the lease
    is released with 499 if the body never starts); else the run to its end under the lease, then
    `whole()`, or 499 when the client hangs up first."""
    if gen.plan.stream:
        return StreamingResponse(events(), media_type=media_type, headers=gen.plan.headers,
                                 background=BackgroundTask(lease.release, 499))
    try:
        await run_to_end(gw, gen, lease, request.receive)
    except ClientGone:
        return Response(status_code=499)
    return await whole()


async def sse_events(gw: ServerState, gen: Generation, lease: Lease, render: OpenAIRenderer) -> AsyncIterator[str]:
    """The SSE body; an error after the stream started is sent as `data: {"error": ...}` before [DONE]."""
    async with lease:
        try:
            for event in render.opening():
                yield event
            async for pi, ci, d in run_generation(gw, gen, lease):
                t0 = time.perf_counter_ns()
                if (event := render.event(pi, ci, d)) is not None:
                    yield event      # returns once the response has written it
                gw.http_ns += time.perf_counter_ns() - t0
            if render.include_usage:
                yield render.usage()
        except KVServeError as e:
            lease.fail(e.status, e.message)
            yield render.error(e.to_dict())
        except Exception as e:
            logger.exception("error while streaming %s", gen.id)
            lease.fail(500, repr(e))
            yield render.error(INTERNAL_ERROR)
    yield render.done()
