"""Ollama's wire format, written here and nowhere else: `/api/chat` and `/api/generate` answers
(NDJSON lines while streaming, one object otherwise) and the model descriptions of `/api/tags`,
`/api/show` and `/api/ps`, from a Generation's events and state and from `/v1/models`' cards.

A stream is one JSON object per line: a line per piece of text (`message.content` for chat,
`response` for generate; `thinking` beside it while the model reasons), a line with the
assistant's `tool_calls` (whole calls: Ollama does not stream arguments), and a last line with
`done: true`, `done_reason` and the counts and durations (nanoseconds). An error after the stream
started is a line `{"error": "..."}`, which the ollama client raises.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from kvserve.server.api.anthropic_wire import tool_input
from kvserve.server.generation import ChoiceEvent, Generation
from kvserve.server.generation.state import ended_with_calls

NEVER_EXPIRES = "2318-01-01T00:00:00Z"   # /api/ps: a served model stays loaded (keep_alive is not applied)


def now() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def details(card: dict[str, Any]) -> dict[str, Any]:
    """`details` of a model card: the family is the card's kind (embedding, router) or "llama"-like
    "decoder" for a generative model; kvserve does not keep Ollama's size/quantization labels."""
    family = card.get("kvserve_kind") or "decoder"
    return {"parent_model": card.get("parent") or "", "format": "gguf" if family == "decoder" else "",
            "family": family, "families": [family], "parameter_size": "", "quantization_level": ""}


def model_entry(card: dict[str, Any]) -> dict[str, Any]:
    """One model of /api/tags (and, with more, of /api/ps), from its /v1/models card."""
    name = card["id"]
    return {"name": name, "model": name, "modified_at": datetime.fromtimestamp(card["created"], UTC).isoformat(),
            "size": 0, "digest": hashlib.sha256(name.encode()).hexdigest(), "details": details(card)}


class OllamaRenderer:
    """One /api/chat (`chat`) or /api/generate answer from the first choice."""

    def __init__(self, gen: Generation, chat: bool, model: str):
        self.gen = gen
        self.chat = chat
        self.model = model    # the name the client asked for (e.g. with ":latest")

    def _piece(self, text: str, thinking: str = "", calls: list[dict] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.chat:
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            out["message"] = msg
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def _final(self, piece: dict[str, Any]) -> dict[str, Any]:
        ch = self.gen.prompts[0].choices[0]
        u = self.gen.usage()
        reason = "stop" if ended_with_calls(ch.calls, ch.finish_reason) else ch.finish_reason
        piece.update(done=True, done_reason={"repetition": "stop", "abort": "stop"}.get(reason or "", reason or "stop"))
        m = self.gen.prompts[0].metrics
        t0 = self.gen.plan.timings.t0
        first = m.first_token_time if m is not None and m.first_token_time else None
        last = (m.last_token_time or m.finished_time or first) if m is not None else None
        piece.update(total_duration=int((time.monotonic() - t0) * 1e9), load_duration=0,
                     prompt_eval_count=u.prompt_tokens,
                     prompt_eval_duration=int((first - m.arrival_time) * 1e9) if first and m else 0,
                     eval_count=u.completion_tokens,
                     eval_duration=int((last - first) * 1e9) if first and last else 0)
        return piece

    def _calls(self) -> list[dict[str, Any]]:
        return [{"function": {"name": c.name, "arguments": tool_input(c.arguments)}}
                for c in self.gen.prompts[0].choices[0].calls]

    def whole(self) -> dict[str, Any]:
        ch = self.gen.prompts[0].choices[0]
        return self._final(self._piece(ch.content, ch.reasoning, self._calls()))

    @staticmethod
    def failed(status: int, message: str) -> list[str]:
        return [line({"error": message})]

    async def lines(self, run: AsyncIterator[ChoiceEvent]) -> AsyncIterator[str]:
        async for pi, ci, d in run:
            if pi or ci:
                continue
            if d.text or d.reasoning:
                yield line(self._piece(d.text, d.reasoning))
            if d.done and d.calls and self.chat:
                yield line(self._piece("", calls=self._calls()))
        yield line(self._final(self._piece("")))
