"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A Messages body becomes a chat completions request and runs on the one generation path, so it
passes the same gates (the key, by `x-api-key` or `Authorization: Bearer`; limits; input
moderation; admission), stage list (reasoning split, tool calls constrained by the grammar,
output moderation) and usage ledger as a chat completion; `MessageRenderer` (anthropic_wire.py)
writes the `message` or its event stream:

    system (string or text blocks)            -> a system message
    user text / tool_result blocks            -> user turns / tool turns (tool_call_id = tool_use_id)
    assistant text / tool_use / thinking      -> assistant turns with tool_calls (thinking is dropped)
    max_tokens, stop_sequences, temperature, top_p, top_k, metadata.user_id -> the same fields
    tools [{name, description, input_schema}] -> function tools; tool_choice auto/any/tool/none ->
                                                 "auto"/"required"/named/"none";
                                                 disable_parallel_tool_use -> parallel_tool_calls false
    thinking {"type": "enabled", budget_tokens} -> reasoning_budget (a `thinking` block);
             {"type": "adaptive"} -> reasoning_effort (output_config.effort)
    output_config.format {"type": "json_schema", schema} -> response_format json_schema

Errors leave in Anthropic's shape (error_shapes.py). Images, documents and server tools are
refused with a 400 that says so.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from kvserve.errors import InvalidRequest
from kvserve.server.api.anthropic_wire import MessageRenderer
from kvserve.server.api.shared import count_prompt_tokens, deliver, start, under_lease
from kvserve.server.generation import run_generation
from kvserve.server.protocol import ChatCompletionRequest, _Strict, read_request, validate_body

if TYPE_CHECKING:
    from kvserve.server.state import ServerState


class Metadata(_Strict):
    user_id: str | None = None


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(_Strict):
    """The body of /v1/messages/count_tokens (content blocks are checked while converting)."""

    model: str
    messages: list[InputMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """The body of /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    # accepted and ignored: one tier, speed and region here; prompt caching is automatic (the prefix cache)
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


def _text(block: dict[str, Any], param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidRequest("A text block needs a string `text`.", param=f"{param}.text")
    return block["text"]


def _blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = "\n\n".join(_text(b, f"system[{i}]") if b.get("type") == "text" else _unsupported(b, f"system[{i}]")
                       for i, b in enumerate(_blocks(system)))
    return [{"role": "system", "content": text}]


def _unsupported(block: dict[str, Any], param: str) -> str:
    raise InvalidRequest(f"Content blocks of type {block.get('type')!r} are not supported here (text, tool_use, "
                         "tool_result and thinking are).", param=f"{param}.type")


def _tool_result(block: dict[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise InvalidRequest("A tool_result block needs the tool_use_id it answers.", param=f"{param}.tool_use_id")
    content = block.get("content", "")
    if not isinstance(content, str):
        content = "".join(_text(b, f"{param}.content[{j}]") if isinstance(b, dict) and b.get("type") == "text"
                          else _unsupported(b if isinstance(b, dict) else {}, f"{param}.content[{j}]")
                          for j, b in enumerate(content if isinstance(content, list) else [None]))
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat completions messages (see the module's docstring)."""
    out = _system(req.system)
    for i, m in enumerate(req.messages):
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(_blocks(m.content)):
            param, kind = f"messages[{i}].content[{j}]", b.get("type")
            if kind == "text":
                texts.append(_text(b, param))
            elif kind == "tool_result" and m.role == "user":
                out.append(_tool_result(b, param))
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise InvalidRequest("A tool_use block needs id and name.", param=param)
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue     # earlier reasoning is not sent back to the model
            else:
                _unsupported(b, param)
        if texts or calls or not m.content:
            turn: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            raise InvalidRequest("Only client tools are supported: {\"name\": ..., \"description\": ..., "
                                 "\"input_schema\": {...}}.", param=f"tools[{i}]")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None, chat: dict[str, Any]) -> None:
    if choice is None:
        return
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequest("tool_choice.type must be auto, any, tool or none.", param="tool_choice.type")
    chat["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}} if kind == "tool"
                           else {"any": "required"}.get(kind, kind))
    if choice.get("disable_parallel_tool_use") and chat.get("tools"):
        chat["parallel_tool_calls"] = False


def _thinking(thinking: dict[str, Any] | None, effort: Any, chat: dict[str, Any]) -> None:
    """thinking enabled: a budget of reasoning tokens; adaptive (or between_tools): reasoning at
    output_config.effort (xhigh and max: high), medium by default."""
    kind = None if thinking is None else thinking.get("type")
    if kind in (None, "disabled"):
        return
    if kind in ("adaptive", "between_tools"):
        chat["reasoning_effort"] = {"low": "low", "high": "high", "xhigh": "high", "max": "high"}.get(effort, "medium")
        return
    budget = thinking.get("budget_tokens") if thinking else None
    if kind != "enabled" or not isinstance(budget, int) or budget < 1:
        raise InvalidRequest("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": "
                             "\"adaptive\"} or {\"type\": \"disabled\"}.", param="thinking")
    chat["reasoning_budget"] = budget


def _output_format(config: dict[str, Any] | None, chat: dict[str, Any]) -> None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise InvalidRequest("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}.",
                             param="output_config.format")
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_body(req: CountTokensRequest) -> dict[str, Any]:
    """The chat completions body of a Messages (or count_tokens) request."""
    chat: dict[str, Any] = {"model": req.model, "messages": messages(req)}
    if (tools := _tools(req.tools)) is not None:
        chat["tools"] = tools
    _tool_choice(req.tool_choice, chat)
    _thinking(req.thinking, (req.output_config or {}).get("effort"), chat)
    _output_format(req.output_config, chat)
    if isinstance(req, MessagesRequest):
        chat.update(max_tokens=req.max_tokens, stream=req.stream)
        for src, dst in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k")):
            if getattr(req, src) is not None:
                chat[dst] = getattr(req, src)
        if req.metadata is not None and req.metadata.user_id is not None:
            chat["user"] = req.metadata.user_id
    return chat


def mount_anthropic(app: FastAPI, gw: ServerState) -> None:
    settings = gw.settings

    @app.post("/v1/messages")
    async def create(request: Request) -> Response:
        req = await read_request(request, MessagesRequest, settings)
        chat = validate_body(chat_body(req), ChatCompletionRequest)
        gen, lease = await start(gw, request, chat, "chat")
        render = MessageRenderer(gen, stop_sequences=req.stop_sequences or [])

        async def whole() -> Response:
            return JSONResponse(render.message(), headers=gen.plan.headers)

        def events():
            return under_lease(gen, lease, render.events(run_generation(gw, gen, lease)), render.failed)

        return await deliver(gw, request, gen, lease, events, whole)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        req = await read_request(request, CountTokensRequest, settings)
        chat = validate_body(chat_body(req), ChatCompletionRequest)
        return {"input_tokens": await count_prompt_tokens(gw, chat, request.state.record.key_name)}
