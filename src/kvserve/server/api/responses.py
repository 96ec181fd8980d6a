"""The Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A Responses body becomes a chat request, planned and run on the one generation path, so it passes
the same gates (auth, limits, input moderation, admission) and stage list (tool calls, output
moderation) as a chat completion; `ResponseRenderer` (responses_wire.py) writes the answer:

    input items + instructions + stored history (previous_response_id)
        -> context.conversation() -> a ChatCompletionRequest (tools, text.format ->
           response_format, truncation "auto" -> truncate "oldest") -> build_plan -> Lease
        -> run_generation -> a `response` object (or Responses stream events)
        -> stored per key (stores/responses.py) when `store` is true (the default)

Plan + lease and the choice between a stream and one body are api/openai.py's `start` and
`deliver`, shared with chat and completions.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from kvserve.errors import InvalidRequest, KVServeError
from kvserve.server.api.openai_wire import INTERNAL_ERROR
from kvserve.server.api.responses_wire import ResponseRenderer
from kvserve.server.api.shared import deliver, start
from kvserve.server.gates.limits import read_json
from kvserve.server.generation import Generation, Lease, run_generation
from kvserve.server.generation.context import conversation
from kvserve.server.protocol import ChatCompletionRequest, validate_body

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from kvserve.server.state import ServerState

logger = logging.getLogger("kvserve.server")
FIELDS = {"model", "input", "instructions", "previous_response_id", "store", "stream", "tools", "tool_choice",
          "parallel_tool_calls", "text", "temperature", "top_p", "max_output_tokens", "metadata", "user",
          "truncation", "include", "reasoning", "seed", "kvserve_trace", "stream_options", "service_tier"}


MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512   # OpenAI's caps


def check_metadata(metadata: Any) -> None:
    """OpenAI's rules for `metadata`: an object of at most 16 string pairs, keys up to 64
    characters, values up to 512 (400 naming the field)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise InvalidRequest("metadata must be an object of string keys and string values.", param="metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(f"metadata holds {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}.", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise InvalidRequest(f"metadata key {key[:MAX_METADATA_KEY]!r}... is longer than {MAX_METADATA_KEY} "
                                 "characters.", param="metadata")
        if not isinstance(value, str):
            raise InvalidRequest(f"metadata.{key} must be a string.", param=f"metadata.{key}")
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidRequest(f"metadata.{key} is {len(value)} characters long; at most {MAX_METADATA_VALUE}.",
                                 param=f"metadata.{key}")


def _owner(request: Request) -> str:
    name = request.state.record.key_name
    return f"key:{name}" if name else "anonymous"


def _tools(tools: list | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise InvalidRequest("Only function tools are supported: {\"type\": \"function\", \"name\": ..., "
                                 "\"parameters\": {...}}.", param=f"tools[{i}]")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: Any) -> dict | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("text.format.type must be text, json_object or json_schema.", param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def chat_body(body: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """(the chat completions body, the request's new turns) for a Responses body."""
    unknown = set(body) - FIELDS
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {min(unknown)}.", param=min(unknown))
    if "input" not in body or not isinstance(body["input"], str | list):
        raise InvalidRequest("input must be a string or a list of items.", param="input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("instructions must be a string.", param="instructions")
    check_metadata(body.get("metadata"))
    if body.get("truncation", "disabled") not in ("auto", "disabled"):
        raise InvalidRequest("truncation must be auto or disabled.", param="truncation")
    messages, new = conversation(instructions, history, body["input"])
    if not messages:
        raise InvalidRequest("input is empty.", param="input")
    chat: dict[str, Any] = {"messages": messages, "stream": bool(body.get("stream"))}
    for src, dst in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("max_output_tokens", "max_completion_tokens"), ("parallel_tool_calls", "parallel_tool_calls"),
                     ("seed", "seed"), ("kvserve_trace", "kvserve_trace")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    if (tools := _tools(body.get("tools"))) is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if (rf := _response_format(body.get("text"))) is not None:
        chat["response_format"] = rf
    if body.get("truncation") == "auto":
        chat["truncate"] = "oldest"
    return chat, new


def mount_responses(app: FastAPI, gw: ServerState) -> None:
    store = gw.backends.responses   # SQLite, or PostgreSQL with --database-url (stores/)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        body = await read_json(request, gw.settings, off_loop=True)
        if not isinstance(body, dict):
            raise InvalidRequest("The body must be a JSON object.", param=None)
        owner = _owner(request)
        prev = body.get("previous_response_id")
        if prev is not None and not isinstance(prev, str):
            raise InvalidRequest("previous_response_id must be a string.", param="previous_response_id")
        history = await run_in_threadpool(store.messages, owner, prev) if prev else []
        chat, new = chat_body(body, history)
        gen, lease = await start(gw, request, validate_body(chat, ChatCompletionRequest), "chat")
        render = ResponseRenderer(body, gen)

        async def save(final: dict) -> None:
            if body.get("store", True) is not False:
                await run_in_threadpool(store.put, owner, final, history + new + [render.answer_turn()])

        async def whole() -> Response:
            final = render.whole()
            await save(final)
            return JSONResponse(final, headers=gen.plan.headers)

        return await deliver(gw, request, gen, lease, lambda: _stream(gw, gen, lease, render, save), whole)

    @app.get("/v1/responses/{response_id}")
    async def get(response_id: str, request: Request) -> dict:
        return await run_in_threadpool(store.get, _owner(request), response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> dict:
        await run_in_threadpool(store.delete, _owner(request), response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _stream(gw: ServerState, gen: Generation, lease: Lease, render: ResponseRenderer,
                  save: Callable[[dict], Awaitable[None]]) -> AsyncIterator[str]:
    """The stream's events; an error after it started is an `error` and a `response.failed` event."""
    async with lease:
        try:
            async for event in render.events(run_generation(gw, gen, lease), save):
                yield event
        except KVServeError as e:
            lease.fail(e.status, e.message)
            for event in render.failed(e.to_dict()["error"]):
                yield event
        except Exception as e:
            logger.exception("error while streaming %s", gen.id)
            lease.fail(500, repr(e))
            for event in render.failed(INTERNAL_ERROR["error"]):
                yield event
