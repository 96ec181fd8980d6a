"""`kvserve_trace`: what the server measured for one request (see docs/api.md), the same object in
every API's answer: the gateway's timings, the prompt's tokens (cached or not), each output
token with its probability and whether it was drafted, the KV blocks used, the router's decision,
moderation checks and the context fitting. A cached answer's trace says which entry answered; a
verified candidate's also what the model kept of it and what checking it cost."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from kvserve.outputs import PositionLogprobs, RequestMetrics
from kvserve.server.generation.plan import Timings
from kvserve.server.stages.output_moderation import trace_entries

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvserve.server.generation.state import Generation


def finite_logprob(x: float) -> float:
    """A logprob JSON can hold (JSON has no -inf)."""
    return max(x, -9999.0) if math.isfinite(x) or x < 0 else 0.0


def ranked(pos: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
    """A position's `k` best alternatives, by rank then logprob."""
    items = sorted(pos.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 10**9,
                                                -kv[1].logprob))
    return items[:k]


class TokenTexts:
    """Each token's own text, decoded once per request (logprobs and traces ask repeatedly)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.token_text(token_id)
        return text


def build_trace(*, request_id: str, prompt_text: str | None, prompt_ids: list[int], num_cached: int,
                prompt_token_texts: list[str], timings: Timings, metrics: RequestMetrics | None,
                output_ids: list[int], output_positions: list[PositionLogprobs] | None, decode,
                kv_blocks: int, block_size: int, output_drafted: list[bool] | None = None) -> dict:
    """The `kvserve_trace` object (see docs/api.md) for one request, from what the server measured.

    `timings` holds the gateway's own marks (plan.Timings)."""
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
        d = output_drafted[i] if output_drafted and i < len(output_drafted) else False
        entry: dict[str, Any] = {"id": tok, "text": decode(tok), "drafted": bool(d)}
        if d and isinstance(d, str):
            entry["draft_source"] = d     # "prompt", "request", "other" (another request's answer), "model", ...
        pos = output_positions[i] if output_positions and i < len(output_positions) else None
        if pos:
            chosen = pos.get(tok)
            if chosen is not None:
                entry["logprob"] = finite_logprob(chosen.logprob)
                entry["prob"] = math.exp(chosen.logprob) if math.isfinite(chosen.logprob) else 0.0
            entry["top"] = [{"id": alt_id, "text": alt.decoded_token if alt.decoded_token is not None
                             else decode(alt_id),
                             "prob": math.exp(alt.logprob) if math.isfinite(alt.logprob) else 0.0}
                            for alt_id, alt in ranked(pos, 5)]
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


def request_trace(gen: Generation, decode: Callable[[int], str]) -> dict:
    """The trace of a request's first prompt and choice (a cached answer's: its entry)."""
    plan = gen.plan
    if plan.cached is not None:
        out: dict[str, Any] = {"semantic_cache": plan.cached.trace_fields(time.time()),
                               "completion_token_count": plan.cached.entry.completion_tokens}
        if plan.route is not None:
            out["router"] = plan.route
        return out
    ps = gen.prompts[0]
    m = ps.metrics
    ch = ps.choices[0]
    out = build_trace(
        request_id=gen.id, prompt_text=ps.prompt.text, prompt_ids=ps.prompt.token_ids, num_cached=ps.num_cached,
        prompt_token_texts=plan.prompt_token_texts, timings=plan.timings, metrics=m, output_ids=ch.token_ids,
        output_positions=ch.logprobs, decode=decode, kv_blocks=m.num_kv_blocks if m else 0,
        block_size=plan.model.block_size, output_drafted=ch.drafted)
    out["reasoning_token_count"] = ch.reasoning_tokens    # of completion_token_count, inside <think>
    if plan.route:
        out["router"] = plan.route                        # the router's decision, when it chose the model
    out["moderation"] = trace_entries(plan.input_checks, ch.stages)   # each check: time and verdict
    out["context"] = {"dropped_messages": ps.prompt.dropped_messages,   # oldest turns cut to fit (context.py)
                      "prompt_tokens": len(ps.prompt.token_ids)}
    if plan.candidate is not None:
        out["semantic_cache"] = candidate_trace(plan.candidate, ch.token_ids, ch.finish_reason, out)
    return out


def candidate_trace(hit, token_ids: list[int], finish_reason: str | None, trace: dict) -> dict:
    """A verified candidate: what matched, what the model kept of it, and the cost (the engine's
    time and the tokens it computed: the prompt's uncached part and the draft it checked)."""
    ms = trace["timings_ms"]
    v = hit.verification(token_ids, finish_reason)
    return hit.trace_fields(time.time()) | {"verification": v, "cost": {
        "prompt_tokens_computed": trace["prompt_token_count"] - trace["cached_prompt_tokens"],
        "draft_tokens_checked": v["draft_tokens"], "decoded_tokens": max(0, len(token_ids) - v["accepted_tokens"]),
        "prefill_ms": ms.get("prefill"), "decode_ms": ms.get("decode")}}
