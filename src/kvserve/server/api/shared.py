"""What the generation APIs share (OpenAI's, Responses, Anthropic's, Ollama's):

    start                the plan (the gates) and its lease
    deliver              SSE (or NDJSON) when the plan streams; else the run to its end under the
                         lease and one body

    under_lease          a rendered stream under its lease, for renderers that make the whole
                         event sequence (Anthropic's events, Ollama's NDJSON lines): the lease is
                         released once however the stream ends, and an error after the stream
                         started goes out as the API's own error event(s)
    count_prompt_tokens  the prompt a chat request would send, counted without running it
                         (Anthropic's count_tokens, Ollama's num_ctx cap)
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.errors import KVServeError
from kvserve.server.api.openai_wire import INTERNAL_ERROR
from kvserve.server.generation import ClientGone, Generation, Kind, Lease, ModelHandle, build_plan, run_to_end
from kvserve.server.generation.context import build_chat_prompt
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, check_caps
from kvserve.server.stages.tools import make_plan

if TYPE_CHECKING:
    from kvserve.server.state import ServerState

logger = logging.getLogger("kvserve.server")


async def under_lease(gen: Generation, lease: Lease, events: AsyncIterator[str],
                      failed: Callable[[int, str], list[str]]) -> AsyncIterator[str]:
    """`events` as they come; on an error, `failed(status, message)`'s events end the stream."""
    async with lease:
        try:
            async for event in events:
                yield event
        except KVServeError as e:
            lease.fail(e.status, e.message)
            for event in failed(e.status, e.message):
                yield event
        except Exception as e:
            logger.exception("error while streaming %s", gen.id)
            lease.fail(500, repr(e))
            for event in failed(500, INTERNAL_ERROR["error"]["message"]):
                yield event


async def count_prompt_tokens(gw: ServerState, chat: ChatCompletionRequest, caller: str | None) -> int:
    """The prompt tokens of `chat` as build_plan would render them (template, tools, the opening of
    a reasoning block), whatever the window; the model's name is checked (404, another key's
    adapter included; 503)."""
    check_caps(chat, gw.settings)     # messages, tools: what build_plan checks first
    model = ModelHandle.resolve(gw, chat.model, caller)
    tools = make_plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
    prompt = await asyncio.to_thread(build_chat_prompt, model.tokenizer, chat.messages, max_model_len=sys.maxsize,
                                     max_tokens=None, truncate=None, tools=tools,
                                     think=chat.reasoning_budget is not None or chat.reasoning_effort is not None)
    return len(prompt.token_ids)


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
