"""The end of the stage list: OpenAI-shaped answers from what the stages let through.

JSON bodies (`chat_body`, `completion_body`), SSE chunks (`ChunkWriter`: `data: {chunk}\\n\\n`
... `data: [DONE]\\n\\n`), and the pieces both use: logprobs (chat and legacy), usage, the trace.
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any

from kvserve.outputs import PositionLogprobs, RequestMetrics

if TYPE_CHECKING:
    from kvserve.server.records import Generation, PromptState, Timings
    from kvserve.server.stages import ChoiceDelta

FINISH_REASONS = {"stop": "stop", "length": "length", "repetition": "stop", "abort": "stop"}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(reason, reason)


def _lp(x: float) -> float:
    return max(x, -9999.0) if math.isfinite(x) or x < 0 else 0.0  # JSON has no -inf


def _ranked(pos: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
    items = sorted(pos.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 10**9,
                                                -kv[1].logprob))
    return items[:k]


def _text(tok_id: int, lp, texts: dict[int, str]) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    return texts.get(tok_id, "")


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top: int,
                  decode) -> dict:
    """`choices[i].logprobs` of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for tok, pos in zip(token_ids, positions):
        chosen = pos.get(tok)
        text = _text(tok, chosen, {tok: decode(tok)}) if chosen else decode(tok)
        entry = {"token": text, "logprob": _lp(chosen.logprob) if chosen else -9999.0,
                 "bytes": list(text.encode("utf-8")), "top_logprobs": []}
        for alt_id, alt in _ranked(pos, top):
            alt_text = alt.decoded_token if alt.decoded_token is not None else decode(alt_id)
            entry["top_logprobs"].append({"token": alt_text, "logprob": _lp(alt.logprob),
                                          "bytes": list(alt_text.encode("utf-8"))})
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], top: int,
                        decode, text_offset_start: int = 0) -> dict:
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
        token_lps.append(_lp(chosen.logprob) if chosen else None)
        alts = {}
        for alt_id, alt in _ranked(pos, top):
            alts[alt.decoded_token if alt.decoded_token is not None else decode(alt_id)] = _lp(alt.logprob)
        tops.append(alts)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def build_trace(*, request_id: str, prompt_text: str | None, prompt_ids: list[int], num_cached: int,
                prompt_token_texts: list[str], timings: Timings, metrics: RequestMetrics | None,
                output_ids: list[int], output_positions: list[PositionLogprobs] | None, decode,
                kv_blocks: int, block_size: int, output_drafted: list[bool] | None = None) -> dict:
    """The `kvserve_trace` object (see docs/api.md) for one request, from what the server measured.

    `timings` holds the gateway's own marks (records.Timings)."""
    now = time.monotonic()
    t0 = timings.t0
    ms = {"validation_auth": (timings.parsed - t0) * 1000,
          "template_tokenize": (timings.tokenized - timings.parsed) * 1000}
    m = metrics
    decode_s = 0.0
    if m is not None:
        sched = m.first_scheduled_time or m.arrival_time
        first = m.first_token_time or now
        end = m.finished_time or m.last_token_time or now
        ms["queue"] = (timings.gateway_wait_s + max(0.0, sched - m.arrival_time)) * 1000
        ms["prefill"] = max(0.0, first - sched) * 1000
        ms["ttft"] = max(0.0, first - t0) * 1000
        decode_s = max(0.0, end - first)
        ms["decode"] = decode_s * 1000
    ms["total"] = (now - t0) * 1000
    n_out = len(output_ids)
    tps = n_out / decode_s if decode_s > 0 else None  # output tokens / decode time
    out_tokens = []
    for i, tok in enumerate(output_ids):
        entry: dict[str, Any] = {"id": tok, "text": decode(tok),
                                 "drafted": bool(output_drafted and i < len(output_drafted) and output_drafted[i])}
        pos = output_positions[i] if output_positions and i < len(output_positions) else None
        if pos:
            chosen = pos.get(tok)
            if chosen is not None:
                entry["logprob"] = _lp(chosen.logprob)
                entry["prob"] = math.exp(chosen.logprob) if math.isfinite(chosen.logprob) else 0.0
            entry["top"] = [{"id": alt_id, "text": alt.decoded_token if alt.decoded_token is not None
                             else decode(alt_id),
                             "prob": math.exp(alt.logprob) if math.isfinite(alt.logprob) else 0.0}
                            for alt_id, alt in _ranked(pos, 5)]
        out_tokens.append(entry)
    return {
        "request_id": request_id,
        "prompt_text": prompt_text,
        "prompt_tokens": [{"id": t, "text": txt, "cached": i < num_cached}
                          for i, (t, txt) in enumerate(zip(prompt_ids, prompt_token_texts))],
        "timings_ms": {k: round(v, 2) for k, v in ms.items()},
        "tokens_per_second": round(tps, 2) if tps is not None else None,
        "kv_blocks_used": kv_blocks,
        "block_size": block_size,
        "cached_prompt_tokens": num_cached,
        "prompt_token_count": len(prompt_ids),
        "completion_token_count": n_out,
        "output_tokens": out_tokens,
        **({"moe_expert_tokens": m.expert_tokens} if m is not None and m.expert_tokens is not None else {}),
    }


# ---- from a request's state ---------------------------------------------------------------------

class TokenTexts:
    """Each token's own text, decoded once per request (logprobs and traces ask repeatedly)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def trace(gen: Generation, ps: PromptState, decode, block_size: int) -> dict:
    m = ps.metrics
    ch = ps.choices[0]
    out = build_trace(
        request_id=gen.id, prompt_text=ps.prompt.text, prompt_ids=ps.prompt.token_ids, num_cached=ps.num_cached,
        prompt_token_texts=gen.prompt_token_texts, timings=gen.timings, metrics=m, output_ids=ch.token_ids,
        output_positions=ch.logprobs, decode=decode, kv_blocks=m.num_kv_blocks if m else 0, block_size=block_size,
        output_drafted=ch.drafted)
    out["reasoning_token_count"] = ch.reasoning_tokens    # of completion_token_count, inside <think>
    out.update(gen.trace_extra)    # the router's decision, when it chose the model
    from kvserve.server.moderation import trace_entries
    out["moderation"] = trace_entries(gen)                 # each check: time and verdict
    out["context"] = {"dropped_messages": ps.prompt.dropped_messages,   # oldest turns cut to fit (context.py)
                      "prompt_tokens": len(ps.prompt.token_ids)}
    return out


def echo_text(tokenizer, ps: PromptState) -> str:
    if ps.prompt.text is not None:
        return ps.prompt.text
    return tokenizer.decode(ps.prompt.token_ids, skip_special_tokens=False)


def _body(gen: Generation, obj: str, choices: list[dict], decode, block_size: int) -> dict:
    body = {"id": gen.id, "object": obj, "created": gen.created, "model": gen.model_name,
            "choices": choices, "usage": usage(*gen.usage_counts()) | gen.usage_extra(), "system_fingerprint": None}
    if gen.trace:
        body["kvserve_trace"] = trace(gen, gen.prompts[0], decode, block_size)
    return body


def chat_body(gen: Generation, decode, block_size: int) -> dict:
    """A `chat.completion` from the accumulated choices."""
    choices = []
    for i, ch in enumerate(gen.prompts[0].choices):
        lp = (chat_logprobs(ch.token_ids, ch.logprobs, gen.top_logprobs, decode)
              if gen.top_logprobs is not None else None)
        content = (ch.content or None) if ch.calls else ch.content
        message = {"role": "assistant", "content": content, "refusal": None,
                   "tool_calls": [c.to_dict() for c in ch.calls]}
        if ch.reasoning:
            message["reasoning_content"] = ch.reasoning
        choices.append({"index": i, "message": message,
                        "logprobs": lp, "finish_reason": "tool_calls" if ch.calls else finish_reason(ch.finish_reason),
                        "stop_reason": ch.stop_reason})
    return _body(gen, "chat.completion", choices, decode, block_size)


def completion_body(gen: Generation, echo: list[str] | None, decode, block_size: int) -> dict:
    """A `text_completion`; `echo` holds each prompt's text when the request echoes it."""
    choices = []
    n, top = gen.params.n, gen.top_logprobs
    for pi, ps in enumerate(gen.prompts):
        for ci, ch in enumerate(ps.choices):
            lp = None
            if top is not None:
                ids, positions = list(ch.token_ids), list(ch.logprobs)
                if echo is not None:
                    ids = list(ps.prompt.token_ids) + ids
                    positions = list(ps.prompt_logprobs or [None] * len(ps.prompt.token_ids)) + positions
                lp = completion_logprobs(ids, positions, top, decode)
            choices.append({"index": pi * n + ci, "text": (echo[pi] if echo is not None else "") + ch.content,
                            "logprobs": lp, "finish_reason": finish_reason(ch.finish_reason),
                            "stop_reason": ch.stop_reason})
    return _body(gen, "text_completion", choices, decode, block_size)


def sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


class ChunkWriter:
    """The SSE events of one streamed answer (`chat.completion.chunk` or `text_completion`)."""

    def __init__(self, gen: Generation, include_usage: bool, decode):
        self.gen = gen
        self.chat = gen.kind == "chat"
        self.include_usage = include_usage
        self.decode = decode

    def _chunk(self, choices: list[dict]) -> dict:
        g = self.gen
        c = {"id": g.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
             "created": g.created, "model": g.model_name, "choices": choices}
        if self.include_usage:
            c["usage"] = None
        return c

    def roles(self, n: int) -> str:
        """The chat stream's first event: every choice's role."""
        return sse(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None} for i in range(n)]))

    def echo(self, first_index: int, n: int, text: str) -> str:
        return sse(self._chunk([{"index": first_index + i, "text": text, "logprobs": None, "finish_reason": None}
                                for i in range(n)]))

    def choice(self, index: int, d: ChoiceDelta, trace: dict | None = None) -> str | None:
        """One choice's step as an event; None when a stage held everything back."""
        top = self.gen.top_logprobs
        lp = None
        if top is not None and d.logprobs:
            lp = (chat_logprobs if self.chat else completion_logprobs)(d.token_ids, d.logprobs, top, self.decode)
        if d.filtered and not d.text and not d.reasoning and not d.tool_calls and lp is None and not d.done:
            return None
        fr = "tool_calls" if d.calls else finish_reason(d.finish_reason)
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
        final["usage"] = usage(*self.gen.usage_counts()) | self.gen.usage_extra()
        return sse(final)

    @staticmethod
    def error(err: dict) -> str:
        return sse(err)

    @staticmethod
    def done() -> str:
        return sse("[DONE]")
