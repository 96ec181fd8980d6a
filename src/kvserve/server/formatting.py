"""OpenAI-shaped pieces built from engine outputs: logprobs (chat and legacy), usage, the trace."""

from __future__ import annotations

import math
import time
from typing import Any

from kvserve.outputs import PositionLogprobs, RequestMetrics

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
                prompt_token_texts: list[str], timings: dict[str, float], metrics: RequestMetrics | None,
                output_ids: list[int], output_positions: list[PositionLogprobs] | None, decode,
                kv_blocks: int, block_size: int) -> dict:
    """The `kvserve_trace` object (see docs/api.md) for one request, from what the server measured.

    `timings` holds the gateway's own marks in time.monotonic() seconds: t0 (request arrived),
    auth (auth done), parsed (body validated), tokenized (template + tokenize done) and
    gateway_wait_s (time spent in the admission queue)."""
    now = time.monotonic()
    t0 = timings["t0"]
    ms = {"validation_auth": (timings["parsed"] - t0) * 1000,
          "template_tokenize": (timings["tokenized"] - timings["parsed"]) * 1000}
    m = metrics
    decode_s = 0.0
    if m is not None:
        sched = m.first_scheduled_time or m.arrival_time
        first = m.first_token_time or now
        end = m.finished_time or m.last_token_time or now
        ms["queue"] = (timings.get("gateway_wait_s", 0.0) + max(0.0, sched - m.arrival_time)) * 1000
        ms["prefill"] = max(0.0, first - sched) * 1000
        ms["ttft"] = max(0.0, first - t0) * 1000
        decode_s = max(0.0, end - first)
        ms["decode"] = decode_s * 1000
    ms["total"] = (now - t0) * 1000
    n_out = len(output_ids)
    tps = n_out / decode_s if decode_s > 0 else None  # output tokens / decode time
    out_tokens = []
    for i, tok in enumerate(output_ids):
        entry: dict[str, Any] = {"id": tok, "text": decode(tok)}
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
    }
