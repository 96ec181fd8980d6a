"""What the APIs that convert into a chat request share (Anthropic's, Ollama's):

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
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from kvserve.errors import KVServeError
from kvserve.server.api.openai_wire import INTERNAL_ERROR
from kvserve.server.generation import Generation, Lease, ModelHandle
from kvserve.server.generation.context import build_chat_prompt
from kvserve.server.protocol import ChatCompletionRequest, check_caps
from kvserve.server.stages.tools import make_plan

if TYPE_CHECKING:
    from kvserve.server.app import ServerState

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
