"""The Responses API's wire format, written here and nowhere else: the `response` object and its
stream events, from a Generation's events and state.

Streaming follows OpenAI's event sequence: response.created, response.in_progress, then per output
item output_item.added / content_part.added / output_text.delta ... / output_text.done /
content_part.done / output_item.done (function calls: function_call_arguments.delta/.done), and
response.completed (or response.incomplete on max_output_tokens or a content filter). An error
after the stream started is an `error` event and `response.failed`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvserve.server.api.openai_wire import finish_reason
from kvserve.server.generation import ChoiceEvent, Generation, TokenTexts, Usage, request_trace

INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


class ResponseRenderer:
    """One `response` object, filled from the first choice's deltas (or its accumulated state)."""

    def __init__(self, body: dict, gen: Generation):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.body = body
        self.gen = gen
        self.created = int(time.time())
        self.model = gen.plan.model.name
        self.text = ""
        self.calls: list[dict] = []          # OpenAI chat tool_calls, accumulated
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.trace: dict | None = None
        self._seq = 0

    # ---- the response object ----------------------------------------------------------------
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
        incomplete = INCOMPLETE.get(self.finish or "")
        status = status or ("incomplete" if incomplete else "completed")
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
            "usage": None if status == "in_progress" else self._usage(),
        }
        if self.trace is not None:
            out["kvserve_trace"] = self.trace
        return out

    def _usage(self) -> dict:
        u = self.usage or Usage(0, 0, 0)
        return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.total_tokens}

    def _finish(self) -> None:
        gen = self.gen
        self.usage = gen.usage()
        if gen.plan.trace:
            self.trace = request_trace(gen, TokenTexts(gen.plan.model.tokenizer))

    def whole(self) -> dict:
        """The final `response` of a run drained without streaming."""
        ch = self.gen.prompts[0].choices[0]
        self.text = ch.content
        self.calls = [c.to_dict() for c in ch.calls]
        self.finish = finish_reason(ch.finish_reason, ch.calls)
        self._finish()
        return self.response()

    def answer_turn(self) -> dict:
        """The assistant's turn, as stored for a later previous_response_id."""
        turn: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            turn["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                                  for c in self.calls]
        return turn

    # ---- the stream -------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, "sequence_number": self._seq, **fields}, ensure_ascii=False,
                          separators=(",", ":"))
        self._seq += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def failed(self, err: dict) -> list[str]:
        """The events of an answer that failed after the stream started (`err`: OpenAI's error object)."""
        return [self.event("error", code=err.get("code"), message=err.get("message"), param=err.get("param")),
                self.event("response.failed", response={**self.response("failed"), "error": {
                    "code": err.get("code") or "server_error", "message": err.get("message")}})]

    async def events(self, run: AsyncIterator[ChoiceEvent], on_done: Callable[[dict], Awaitable[None]]
                     ) -> AsyncIterator[str]:
        """The run's events in, Responses stream events out; `on_done(final)` before the last one."""
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        opened = False
        async for pi, ci, d in run:
            if pi or ci:
                continue
            if d.text:
                if not opened:
                    opened = True
                    for e in self._open_message():
                        yield e
                self.text += d.text
                yield self.event("response.output_text.delta", item_id=self.msg_id, output_index=0,
                                 content_index=0, delta=d.text, logprobs=[])
            for tc in d.tool_calls:
                self._add_call(tc)
            if d.done:
                self.finish = finish_reason(d.finish_reason, d.calls)
        self._finish()
        final = self.response()
        for e in self._close_items(final["output"], opened):
            yield e
        await on_done(final)
        yield self.event("response.completed" if final["status"] == "completed" else "response.incomplete",
                         response=final)

    def _open_message(self) -> list[str]:
        item = {"id": self.msg_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        return [self.event("response.output_item.added", output_index=0, item=item),
                self.event("response.content_part.added", item_id=self.msg_id, output_index=0, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": []})]

    def _add_call(self, tc: dict) -> None:
        i = tc.get("index", 0)
        while len(self.calls) <= i:
            self.calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call = self.calls[i]
        call["id"] = tc.get("id") or call["id"]
        fn = tc.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""

    def _close_items(self, items: list[dict], opened: bool) -> list[str]:
        out: list[str] = []
        index = 0
        if opened or not self.calls:
            if not opened:
                out += self._open_message()
            out += [self.event("response.output_text.done", item_id=self.msg_id, output_index=0, content_index=0,
                               text=self.text, logprobs=[]),
                    self.event("response.content_part.done", item_id=self.msg_id, output_index=0, content_index=0,
                               part=items[0]["content"][0]),
                    self.event("response.output_item.done", output_index=0, item=items[0])]
            index = 1
        for item in items[index:]:
            out += [self.event("response.output_item.added", output_index=index,
                               item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
            index += 1
        return out
