"""OpenAI's wire format, written here and nowhere else: `chat.completion` and `text_completion`
bodies, their SSE chunks (`data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`), logprobs (chat and
legacy), usage. `OpenAIRenderer` turns a Generation's events and state into them; the arena uses
it with the model's name replaced, a semantic-cache hit with `kvserve_cache: "semantic"`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvserve.outputs import PositionLogprobs
from kvserve.server.generation.state import Generation, PromptState, Usage, ended_with_calls
from kvserve.server.generation.trace import finite_logprob, ranked, request_trace
from kvserve.server.stages.delta import ChoiceDelta

FINISH_REASONS = {"stop": "stop", "length": "length", "repetition": "stop", "abort": "stop"}
INTERNAL_ERROR = {"error": {"message": "Internal error while generating; the response is incomplete.",
                            "type": "server_error", "param": None, "code": "internal_error"}}
Decode = Callable[[int], str]


def finish_reason(reason: str | None, calls: list | tuple = ()) -> str | None:
    """OpenAI's finish_reason for the engine's `reason`, "tool_calls" for an answer of tool calls
    (`ended_with_calls`)."""
    if ended_with_calls(calls, reason):
        return "tool_calls"
    return None if reason is None else FINISH_REASONS.get(reason, reason)


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top: int, decode: Decode) -> dict:
    """`choices[i].logprobs` of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for tok, pos in zip(token_ids, positions):
        chosen = pos.get(tok)
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(tok)
        entry = {"token": text, "logprob": finite_logprob(chosen.logprob) if chosen else -9999.0,
                 "bytes": list(text.encode("utf-8")), "top_logprobs": []}
        for alt_id, alt in ranked(pos, top):
            alt_text = alt.decoded_token if alt.decoded_token is not None else decode(alt_id)
            entry["top_logprobs"].append({"token": alt_text, "logprob": finite_logprob(alt.logprob),
                                          "bytes": list(alt_text.encode("utf-8"))})
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], top: int,
                        decode: Decode, text_offset_start: int = 0) -> dict:
    """Legacy `choices[i].logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset_start
    for tok, pos in zip(token_ids, positions):
        text = decode(tok)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if pos is None:  # first prompt token: nothing to condition on
            token_lps.append(None)
            tops.append(None)
            continue
        chosen = pos.get(tok)
        token_lps.append(finite_logprob(chosen.logprob) if chosen else None)
        alts = {}
        for alt_id, alt in ranked(pos, top):
            alts[alt.decoded_token if alt.decoded_token is not None else decode(alt_id)] = finite_logprob(alt.logprob)
        tops.append(alts)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def usage_dict(u: Usage) -> dict:
    out: dict[str, Any] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                           "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    if u.cost is not None:
        out["kvserve_cost"] = u.cost
    if u.compute_tokens is not None:
        out["kvserve_compute_tokens"] = u.compute_tokens
    return out


def echo_text(tokenizer: Any, ps: PromptState) -> str:
    if ps.prompt.text is not None:
        return ps.prompt.text
    return tokenizer.decode(ps.prompt.token_ids, skip_special_tokens=False)


def sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


class OpenAIRenderer:
    """One answer's chat or completion wire format: SSE events while it streams, or the body.
    `model` replaces the served name (the arena's anonymous sides)."""

    def __init__(self, gen: Generation, decode: Decode, model: str | None = None):
        self.gen = gen
        self.plan = gen.plan
        self.chat = gen.plan.kind == "chat"
        self.decode = decode
        self.model = model or gen.plan.model.name
        self.include_usage = gen.plan.include_usage
        self.echoes = [echo_text(gen.plan.model.tokenizer, ps) for ps in gen.prompts] if gen.plan.echo else None

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.gen.id, "object": obj, "created": self.plan.created, "model": self.model}

    def _tail(self, out: dict[str, Any]) -> dict[str, Any]:
        if self.plan.cached is not None or self.plan.candidate is not None:
            out["kvserve_cache"] = "semantic"
        return out

    def trace(self) -> dict:
        return request_trace(self.gen, self.decode)

    # ---- streamed --------------------------------------------------------------------------
    def _chunk(self, choices: list[dict]) -> dict:
        c = self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": choices}
        if self.include_usage:
            c["usage"] = None
        return self._tail(c)

    def opening(self) -> list[str]:
        """The events before the first delta: every chat choice's role, every completion's echo."""
        n = self.plan.n
        if self.chat:
            return [sse(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None} for i in range(n)]))]
        return [sse(self._chunk([{"index": pi * n + i, "text": text, "logprobs": None, "finish_reason": None}
                                 for i in range(n)])) for pi, text in enumerate(self.echoes or [])]

    def event(self, pi: int, ci: int, d: ChoiceDelta) -> str | None:
        """One choice's step as an event; None when a stage held everything back. The first
        choice's last event carries the trace when it was asked for."""
        tr = self.trace() if d.done and self.plan.trace and pi == ci == 0 else None
        return self.choice(pi * self.plan.n + ci, d, tr)

    def choice(self, index: int, d: ChoiceDelta, trace: dict | None = None) -> str | None:
        top = self.plan.top_logprobs
        lp = None
        if top is not None and d.logprobs:
            lp = (chat_logprobs if self.chat else completion_logprobs)(d.token_ids, d.logprobs, top, self.decode)
        if d.filtered and not d.text and not d.reasoning and not d.tool_calls and lp is None and not d.done:
            return None
        fr = finish_reason(d.finish_reason, d.calls)
        if self.chat:
            delta: dict[str, Any] = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            if d.text or not (d.filtered or d.done or d.reasoning):
                delta["content"] = d.text
            if d.tool_calls:
                delta["tool_calls"] = d.tool_calls
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": fr}
        else:
            choice = {"index": index, "text": d.text, "logprobs": lp, "finish_reason": fr}
        if d.done:
            choice["stop_reason"] = d.stop_reason
        body = self._chunk([choice])
        if trace is not None:
            body["kvserve_trace"] = trace
        return sse(body)

    def usage(self) -> str:
        final = self._chunk([])
        final["usage"] = usage_dict(self.gen.usage())
        return sse(final)

    @staticmethod
    def error(err: dict) -> str:
        return sse(err)

    @staticmethod
    def done() -> str:
        return sse("[DONE]")

    # ---- whole -----------------------------------------------------------------------------
    def body(self) -> dict:
        """The `chat.completion` or `text_completion` of the accumulated choices."""
        choices = self._chat_choices() if self.chat else self._completion_choices()
        body = self._head("chat.completion" if self.chat else "text_completion") | {
            "choices": choices, "usage": usage_dict(self.gen.usage()), "system_fingerprint": None}
        if self.plan.trace:
            body["kvserve_trace"] = self.trace()
        return self._tail(body)

    def _chat_choices(self) -> list[dict]:
        choices = []
        for i, ch in enumerate(self.gen.prompts[0].choices):
            top = self.plan.top_logprobs
            lp = chat_logprobs(ch.token_ids, ch.logprobs, top, self.decode) if top is not None else None
            content = (ch.content or None) if ch.calls else ch.content
            message = {"role": "assistant", "content": content, "refusal": None,
                       "tool_calls": [c.to_dict() for c in ch.calls]}
            if ch.reasoning:
                message["reasoning_content"] = ch.reasoning
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": finish_reason(ch.finish_reason, ch.calls),
                            "stop_reason": ch.stop_reason})
        return choices

    def _completion_choices(self) -> list[dict]:
        choices = []
        n, top, echo = self.plan.n, self.plan.top_logprobs, self.echoes
        for pi, ps in enumerate(self.gen.prompts):
            for ci, ch in enumerate(ps.choices):
                lp = None
                if top is not None:
                    ids, positions = list(ch.token_ids), list(ch.logprobs)
                    if echo is not None:
                        ids = list(ps.prompt.token_ids) + ids
                        positions = list(ps.prompt_logprobs or [None] * len(ps.prompt.token_ids)) + positions
                    lp = completion_logprobs(ids, positions, top, self.decode)
                choices.append({"index": pi * n + ci, "text": (echo[pi] if echo is not None else "") + ch.content,
                                "logprobs": lp, "finish_reason": finish_reason(ch.finish_reason),
                                "stop_reason": ch.stop_reason})
        return choices
