"""The Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A Responses request is turned into a chat request and handed to the chat handler
(`handlers.generate`), so it passes the same gates (auth, limits, input moderation, admission)
and stage list (tool calls, output moderation) and has no second generation path:

    input items + instructions + stored history (previous_response_id)
        -> context.conversation() -> chat body (tools, text.format -> response_format,
           truncation "auto" -> truncate "oldest") -> handlers.generate
        -> chat.completion (or its chunks) -> a `response` object (or Responses stream events)
        -> stored per key (responses_store.py) when `store` is true (the default)

Streaming follows OpenAI's event sequence: response.created, response.in_progress, then per output
item output_item.added / content_part.added / output_text.delta ... / output_text.done /
content_part.done / output_item.done (function calls: function_call_arguments.delta/.done), and
response.completed (or response.incomplete on max_output_tokens or a content filter).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvserve.errors import InvalidRequest
from kvserve.server.context import conversation
from kvserve.server.limits import load_json, read_body

FIELDS = {"model", "input", "instructions", "previous_response_id", "store", "stream", "tools", "tool_choice",
          "parallel_tool_calls", "text", "temperature", "top_p", "max_output_tokens", "metadata", "user",
          "truncation", "include", "reasoning", "seed", "kvserve_trace", "stream_options", "service_tier"}


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
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    return chat, new


class ResponseBuilder:
    """The `response` object, filled from a chat completion (whole, or chunk by chunk)."""

    def __init__(self, body: dict, model: str | None):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.body = body
        self.created = int(time.time())
        self.model = model or body.get("model") or ""
        self.text = ""
        self.calls: list[dict] = []          # chat tool_calls, accumulated
        self.finish: str | None = None
        self.usage: dict | None = None
        self.trace: dict | None = None

    def output(self) -> list[dict]:
        out: list[dict] = []
        if self.text or not self.calls:
            out.append({"type": "message", "id": self.msg_id, "status": "completed", "role": "assistant",
                        "content": [{"type": "output_text", "text": self.text, "annotations": []}]})
        for c in self.calls:
            out.append({"type": "function_call", "id": f"fc_{c['id']}", "call_id": c["id"],
                        "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                        "status": "completed"})
        return out

    def response(self, status: str | None = None) -> dict:
        b = self.body
        incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(self.finish or "")
        status = status or ("incomplete" if incomplete else "completed")
        u = self.usage or {}
        out = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": self.output() if status != "in_progress" else [],
            "instructions": b.get("instructions"), "previous_response_id": b.get("previous_response_id"),
            "store": b.get("store", True), "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
            "max_output_tokens": b.get("max_output_tokens"), "tools": b.get("tools") or [],
            "tool_choice": b.get("tool_choice", "auto"), "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "text": b.get("text") or {"format": {"type": "text"}}, "truncation": b.get("truncation", "disabled"),
            "metadata": b.get("metadata") or {}, "user": b.get("user"), "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete and status == "incomplete" else None,
            "reasoning": {"effort": None, "summary": None},
            "usage": None if status == "in_progress" else {
                "input_tokens": u.get("prompt_tokens", 0),
                "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
                "output_tokens": u.get("completion_tokens", 0), "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.get("total_tokens", 0)},
        }
        if self.trace is not None:
            out["kvserve_trace"] = self.trace
        return out

    def from_completion(self, completion: dict) -> dict:
        choice = completion["choices"][0]
        msg = choice["message"]
        self.model = completion.get("model") or self.model
        self.text = msg.get("content") or ""
        self.calls = msg.get("tool_calls") or []
        self.finish = choice.get("finish_reason")
        self.usage = completion.get("usage")
        self.trace = completion.get("kvserve_trace")
        return self.response()

    def answer_turn(self) -> dict:
        turn: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            turn["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                                  for c in self.calls]
        return turn


def _event(seq: list[int], kind: str, **fields: Any) -> str:
    seq[0] += 1
    data = json.dumps({"type": kind, "sequence_number": seq[0] - 1, **fields}, ensure_ascii=False,
                      separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


async def _events(chunks: AsyncIterator, rb: ResponseBuilder, on_done) -> AsyncIterator[str]:
    """Chat completion chunks in, Responses stream events out."""
    seq = [0]
    yield _event(seq, "response.created", response=rb.response("in_progress"))
    yield _event(seq, "response.in_progress", response=rb.response("in_progress"))
    opened = False
    msg_item = {"id": rb.msg_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    buffer = ""
    async for raw in chunks:
        buffer += raw if isinstance(raw, str) else raw.decode()
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            if not event.startswith("data: ") or event == "data: [DONE]":
                continue
            chunk = json.loads(event[6:])
            if "error" in chunk:
                err = chunk["error"]
                yield _event(seq, "error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
                yield _event(seq, "response.failed", response={**rb.response("failed"), "error": {
                    "code": err.get("code") or "server_error", "message": err.get("message")}})
                return
            if chunk.get("usage"):
                rb.usage = chunk["usage"]
            if chunk.get("kvserve_trace"):
                rb.trace = chunk["kvserve_trace"]
            rb.model = chunk.get("model") or rb.model
            for c in chunk.get("choices", []):
                delta = c.get("delta") or {}
                if delta.get("content"):
                    if not opened:
                        opened = True
                        yield _event(seq, "response.output_item.added", output_index=0, item=msg_item)
                        yield _event(seq, "response.content_part.added", item_id=rb.msg_id, output_index=0,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    rb.text += delta["content"]
                    yield _event(seq, "response.output_text.delta", item_id=rb.msg_id, output_index=0,
                                 content_index=0, delta=delta["content"], logprobs=[])
                for tc in delta.get("tool_calls") or []:
                    i = tc.get("index", 0)
                    while len(rb.calls) <= i:
                        rb.calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                    call = rb.calls[i]
                    call["id"] = tc.get("id") or call["id"]
                    fn = tc.get("function") or {}
                    call["function"]["name"] += fn.get("name") or ""
                    call["function"]["arguments"] += fn.get("arguments") or ""
                if c.get("finish_reason"):
                    rb.finish = c["finish_reason"]
    final = rb.response()
    items = final["output"]
    index = 0
    if opened or not rb.calls:
        if not opened:
            yield _event(seq, "response.output_item.added", output_index=0, item=msg_item)
            yield _event(seq, "response.content_part.added", item_id=rb.msg_id, output_index=0, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": []})
        part = items[0]["content"][0]
        yield _event(seq, "response.output_text.done", item_id=rb.msg_id, output_index=0, content_index=0,
                     text=rb.text, logprobs=[])
        yield _event(seq, "response.content_part.done", item_id=rb.msg_id, output_index=0, content_index=0, part=part)
        yield _event(seq, "response.output_item.done", output_index=0, item=items[0])
        index = 1
    for item in items[index:]:
        yield _event(seq, "response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                 "status": "in_progress"})
        yield _event(seq, "response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                     delta=item["arguments"])
        yield _event(seq, "response.function_call_arguments.done", item_id=item["id"], output_index=index,
                     arguments=item["arguments"])
        yield _event(seq, "response.output_item.done", output_index=index, item=item)
        index += 1
    await on_done(final)
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield _event(seq, kind, response=final)


def mount_responses(app: FastAPI, server) -> None:
    store = server.backends.responses   # SQLite, or PostgreSQL with --database-url (backends/)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        from kvserve.server.arena import _sse_request
        from kvserve.server.handlers import generate

        s = server.settings
        body = await run_in_threadpool(load_json, await read_body(request, s.max_body_bytes, s.body_timeout_s),
                                       s.max_json_depth)
        if not isinstance(body, dict):
            raise InvalidRequest("The body must be a JSON object.", param=None)
        owner = _owner(request)
        prev = body.get("previous_response_id")
        if prev is not None and not isinstance(prev, str):
            raise InvalidRequest("previous_response_id must be a string.", param="previous_response_id")
        history = await run_in_threadpool(store.messages, owner, prev) if prev else []
        chat, new = chat_body(body, history)
        rb = ResponseBuilder(body, server.model_name)

        async def save(final: dict) -> None:
            if body.get("store", True) is not False:
                await run_in_threadpool(store.put, owner, final, history + new + [rb.answer_turn()])

        resp = await generate(server, _sse_request(request, chat), "chat")
        if resp.status_code != 200:
            return resp
        if isinstance(resp, StreamingResponse):
            return StreamingResponse(_events(resp.body_iterator, rb, save), media_type="text/event-stream",
                                     headers={k: v for k, v in resp.headers.items() if k.startswith("x-")},
                                     background=resp.background)
        final = rb.from_completion(json.loads(resp.body))
        await save(final)
        return JSONResponse(final, headers={k: v for k, v in resp.headers.items() if k.startswith("x-")})

    @app.get("/v1/responses/{response_id}")
    async def get(response_id: str, request: Request) -> dict:
        return await run_in_threadpool(store.get, _owner(request), response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> dict:
        await run_in_threadpool(store.delete, _owner(request), response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
