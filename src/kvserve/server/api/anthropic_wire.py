"""Anthropic's Messages wire format, written here and nowhere else: the `message` object and its
stream events, from a Generation's events and state.

The stream follows Anthropic's documented sequence:

    message_start (the message with empty content, input usage) → ping →
    per content block: content_block_start → content_block_delta ... → content_block_stop
        (thinking: thinking_delta ..., then one signature_delta just before its stop; text:
        text_delta; tool_use: input_json_delta) →
    message_delta (stop_reason, stop_sequence, cumulative usage) → message_stop

An error after the stream started is an `error` event, and the stream ends there. Usage is
Anthropic's: `input_tokens` excludes the prompt tokens read from the prefix cache, which are
`cache_read_input_tokens`.

A thinking block's `signature` (in the `message` and in its `signature_delta`) is an opaque digest
of its text, so clients that store and pass thinking blocks back (as the SDK and agents do in a tool
loop) find the field they expect. It is not checked when a block comes back: earlier thinking is
never shown to the model again (api/anthropic.py), and a conversation moved here from another
server carries that server's signatures.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from kvserve.server.error_shapes import anthropic_error
from kvserve.server.generation import ChoiceEvent, Generation
from kvserve.server.generation.state import ended_with_calls
from kvserve.server.stages.tools import ParsedCall

STOP_REASONS = {"length": "max_tokens", "content_filter": "refusal"}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the `input` object (empty when they are not a complete JSON object,
    as after max_tokens cut the call off)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def thinking_signature(thinking: str) -> str:
    """The `signature` of a thinking block with this text (see the module's docstring)."""
    return "kvs1" + base64.b64encode(hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).digest()).decode()


def sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class MessageRenderer:
    """One `message` from the first choice: the whole object, or its stream events."""

    def __init__(self, gen: Generation, stop_sequences: list[str]):
        self.gen = gen
        self.id = "msg_" + uuid.uuid4().hex
        self.stop_sequences = stop_sequences
        self.blocks = 0                       # content blocks opened so far
        self.open: tuple[str, int] | None = None   # (kind, tool call index) of the open block
        self.kinds: set[str] = set()          # the kinds of block opened so far
        self.thinking: list[str] = []         # the open thinking block's text so far (for its signature)

    def _stop(self, reason: str | None, stop_reason: Any, calls: list) -> dict[str, Any]:
        if ended_with_calls(calls, reason):
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if reason == "stop" and isinstance(stop_reason, str) and stop_reason in self.stop_sequences:
            return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
        return {"stop_reason": STOP_REASONS.get(reason or "", "end_turn"), "stop_sequence": None}

    def usage(self) -> dict[str, Any]:
        u = self.gen.usage()
        return {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": u.cached_tokens, "output_tokens": u.completion_tokens}

    def _shell(self, content: list[dict[str, Any]], stop: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.gen.plan.model.name,
                "content": content, **stop, "usage": usage}

    # ---- whole ------------------------------------------------------------------------------
    def message(self) -> dict[str, Any]:
        """The `message` of a run drained without streaming."""
        ch = self.gen.prompts[0].choices[0]
        content: list[dict[str, Any]] = []
        if ch.reasoning:
            content.append({"type": "thinking", "thinking": ch.reasoning,
                            "signature": thinking_signature(ch.reasoning)})
        if ch.content or not ch.calls:
            content.append({"type": "text", "text": ch.content})
        content += [self._tool_use(c, tool_input(c.arguments)) for c in ch.calls]
        return self._shell(content, self._stop(ch.finish_reason, ch.stop_reason, ch.calls), self.usage())

    @staticmethod
    def _tool_use(call: ParsedCall | dict[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
        cid, name = (call.id, call.name) if isinstance(call, ParsedCall) else (call["id"], call["function"]["name"])
        return {"type": "tool_use", "id": tool_use_id(cid), "name": name, "input": arguments}

    # ---- the stream -------------------------------------------------------------------------
    def failed(self, status: int, message: str) -> list[str]:
        return [sse("error", anthropic_error(529 if status == 503 else status, message))]

    def _start(self, kind: str, block: dict[str, Any], call: int = -1) -> list[str]:
        out = self._close()
        self.open = (kind, call)
        self.kinds.add(kind)
        out.append(sse("content_block_start", {"type": "content_block_start", "index": self.blocks,
                                               "content_block": block}))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open[0] == "thinking":   # the signature, just before the block's stop
            out.append(self._delta({"type": "signature_delta", "signature": thinking_signature("".join(self.thinking))}))
            self.thinking = []
        self.open = None
        self.blocks += 1
        return out + [sse("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.blocks, "delta": delta})

    def step(self, d: Any) -> list[str]:
        """The events of one delta of the first choice."""
        out: list[str] = []
        if d.reasoning:
            if self.open is None or self.open[0] != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
            self.thinking.append(d.reasoning)
        if d.text:
            if self.open is None or self.open[0] != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d.text}))
        for tc in d.tool_calls:
            i = tc.get("index", 0)
            if tc.get("id"):
                out += self._start("tool_use", self._tool_use(tc, {}), i)
            args = (tc.get("function") or {}).get("arguments") or ""
            if args and self.open == ("tool_use", i):
                out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return out

    async def events(self, run: AsyncIterator[ChoiceEvent]) -> AsyncIterator[str]:
        prompt_tokens = sum(len(ps.prompt.token_ids) for ps in self.gen.prompts)
        start_usage = {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                       "output_tokens": 0}
        yield sse("message_start", {"type": "message_start", "message": self._shell(
            [], {"stop_reason": None, "stop_sequence": None}, start_usage)})
        yield sse("ping", {"type": "ping"})
        stop = {"stop_reason": "end_turn", "stop_sequence": None}
        async for pi, ci, d in run:
            if pi or ci:
                continue
            for event in self.step(d):
                yield event
            if d.done:
                stop = self._stop(d.finish_reason, d.stop_reason, d.calls)
        if not self.kinds & {"text", "tool_use"}:    # as message(): an answer has a text block, if empty
            for event in self._start("text", {"type": "text", "text": ""}):
                yield event
        for event in self._close():
            yield event
        yield sse("message_delta", {"type": "message_delta", "delta": stop, "usage": self.usage()})
        yield sse("message_stop", {"type": "message_stop"})
