"""OpenAI's generation routes, /v1/chat/completions and /v1/completions, read top to bottom.

    (the key's request bucket was taken by the middleware: 429)
    parse + validate (400) → build_plan: the gates (generation/plan.py) → Lease.acquire: token
    reservation (429), admission slot (waits; 503 when the queue is full) → run_generation
    (generation/run.py) → OpenAIRenderer (openai_wire.py): SSE events or one JSON body

`answer` is the whole of it after parsing; the arena (api/arena.py) renders the same stream with
the model's name hidden. `start` (plan + lease) and `deliver` (SSE, or run to the end and one
body) are the steps every generation route shares (api/shared.py); the Responses, Anthropic and
Ollama APIs use them with renderers of their own. An error after the stream started goes out as an SSE error event before
`[DONE]`; the lease gives everything back once however the response ends (generation/lease.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.errors import KVServeError
from kvserve.server.api.openai_wire import INTERNAL_ERROR, OpenAIRenderer
from kvserve.server.api.shared import deliver, start
from kvserve.server.generation import (
    Generation,
    Kind,
    Lease,
    TokenTexts,
    run_generation,
)
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, read_request

if TYPE_CHECKING:
    from kvserve.server.state import ServerState

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
                 *, model_alias: str | None = None,
                 on_answered: Callable[[], Awaitable[None]] | None = None) -> Response:
    """One validated request, planned, leased, run and rendered (SSE when it streams).
    `on_answered()` runs once the answer is complete and succeeded (by the lease's outcome), before
    the stream's `[DONE]` or the JSON body: the arena marks a side answered there."""
    gen, lease = await start(gw, request, req, kind)
    render = OpenAIRenderer(gen, TokenTexts(gen.plan.model.tokenizer), model=model_alias)

    async def whole() -> Response:
        if on_answered is not None and lease.status == 200:
            await on_answered()
        t0 = time.perf_counter_ns()
        response = JSONResponse(render.body(), headers=gen.plan.headers)
        gw.http_ns += time.perf_counter_ns() - t0
        return response

    return await deliver(gw, request, gen, lease, lambda: sse_events(gw, gen, lease, render, on_answered), whole)


async def sse_events(gw: ServerState, gen: Generation, lease: Lease, render: OpenAIRenderer,
                     on_answered: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[str]:
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
    if on_answered is not None and lease.status == 200:
        await on_answered()
    yield render.done()
