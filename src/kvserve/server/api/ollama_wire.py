"""Ollama's wire format, written here and nowhere else: `/api/chat` and `/api/generate` answers
(NDJSON lines while streaming, one object otherwise), from a Generation's events and state.

A stream is one JSON object per line: a line per piece of text (`message.content` for chat,
`response` for generate; `thinking` beside it while the model reasons), a line with the
assistant's `tool_calls` (whole calls: Ollama does not stream arguments), and a last line with
`done: true`, `done_reason` and the counts and durations (nanoseconds). An error after the stream
started is a line `{"error": "..."}`, which the ollama client raises. With `logprobs`, each line
carries the `logprobs` of the tokens it adds (a token with no text of its own, held back or cut,
rides on the next line).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from kvserve.outputs import PositionLogprobs
from kvserve.server.api.anthropic_wire import tool_input
from kvserve.server.api.openai_wire import Decode, chat_logprobs
from kvserve.server.generation import ChoiceEvent, Generation
from kvserve.server.generation.state import ended_with_calls
from kvserve.server.generation.trace import TokenTexts


def now() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def ollama_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top: int, decode: Decode
                    ) -> list[dict[str, Any]]:
    """Ollama's `logprobs`: [{token, logprob, top_logprobs (when asked for)}] per generated token."""
    out = []
    for entry in chat_logprobs(token_ids, positions, top, decode)["content"]:
        del entry["bytes"]
        alts = [{"token": a["token"], "logprob": a["logprob"]} for a in entry.pop("top_logprobs")]
        out.append(entry | ({"top_logprobs": alts} if top else {}))
    return out


class OllamaRenderer:
    """One /api/chat (`chat`) or /api/generate answer from the first choice."""

    def __init__(self, gen: Generation, chat: bool, model: str):
        self.gen = gen
        self.chat = chat
        self.model = model    # the name the client asked for (e.g. with ":latest")
        self.top = gen.plan.top_logprobs     # None: no logprobs asked for
        self.decode = TokenTexts(gen.plan.model.tokenizer)
        self.pending: list[dict[str, Any]] = []   # streamed tokens' logprobs not yet on a line

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

    def _with_logprobs(self, piece: dict[str, Any], logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return piece | {"logprobs": logprobs} if self.top is not None else piece

    def whole(self) -> dict[str, Any]:
        ch = self.gen.prompts[0].choices[0]
        piece = self._piece(ch.content, ch.reasoning, self._calls())
        if self.top is not None:
            piece = self._with_logprobs(piece, ollama_logprobs(ch.token_ids, ch.logprobs, self.top, self.decode))
        return self._final(piece)

    def _take(self) -> list[dict[str, Any]]:
        out, self.pending = self.pending, []
        return out

    @staticmethod
    def failed(status: int, message: str) -> list[str]:
        return [line({"error": message})]

    async def lines(self, run: AsyncIterator[ChoiceEvent]) -> AsyncIterator[str]:
        async for pi, ci, d in run:
            if pi or ci:
                continue
            if self.top is not None and d.logprobs:
                self.pending += ollama_logprobs(d.token_ids, d.logprobs, self.top, self.decode)
            if d.text or d.reasoning:
                yield line(self._with_logprobs(self._piece(d.text, d.reasoning), self._take()))
            if d.done and d.calls and self.chat:
                yield line(self._with_logprobs(self._piece("", calls=self._calls()), self._take()))
        last = self._piece("")
        yield line(self._final(self._with_logprobs(last, self._take()) if self.pending else last))
