"""From engine sequences to vLLM-shaped RequestOutputs, with the deltas a stream needs."""

from __future__ import annotations

from kvserve.engine.request import Sequence
from kvserve.engine.sampler import SamplerOutput
from kvserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


def position_logprobs(token: int, logprob: float, rank: int, top_ids: list[int] | None,
                      top_lps: list[float] | None, tokenizer) -> PositionLogprobs:
    """{token_id: Logprob} for the chosen token plus the top alternatives (ranks 1..k)."""
    d: PositionLogprobs = {token: Logprob(logprob, rank, tokenizer.token_text(token))}
    for r, (tid, lp) in enumerate(zip(top_ids or [], top_lps or []), start=1):
        if tid not in d:
            d[tid] = Logprob(lp, r, tokenizer.token_text(tid))
    return d


def record_sample(seq: Sequence, row: int, out: SamplerOutput, tokenizer, now: float) -> None:
    """Book-keeping for a sampled token: logprobs, cumulative logprob, timestamps."""
    tok = seq.output_token_ids[-1]
    lp = float(out.logprobs[row])
    seq.cumulative_logprob += lp
    k = seq.params.logprobs
    if k is not None:
        top_ids = out.top_token_ids[row, :k].tolist() if k and out.top_token_ids is not None else None
        top_lps = out.top_logprobs[row, :k].tolist() if k and out.top_logprobs is not None else None
        seq.logprobs.append(position_logprobs(tok, lp, int(out.ranks[row]), top_ids, top_lps, tokenizer))
    m = seq.metrics
    if m.first_token_time is None:
        m.first_token_time = now
    m.last_token_time = now
    m.token_times.append(now)
    m.num_output_tokens = len(seq.output_token_ids)


def _completion(seq: Sequence, index: int) -> CompletionOutput:
    text_delta = seq.text[seq.sent_text_len:]
    tok_delta = seq.output_token_ids[seq.sent_tokens:]
    lp_delta = None if seq.logprobs is None else seq.logprobs[seq.sent_logprobs:]
    seq.sent_text_len, seq.sent_tokens = len(seq.text), len(seq.output_token_ids)
    seq.sent_logprobs = 0 if seq.logprobs is None else len(seq.logprobs)
    return CompletionOutput(
        index=index, text=seq.text, token_ids=list(seq.output_token_ids),
        cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
        text_delta=text_delta, token_ids_delta=tok_delta, logprobs_delta=lp_delta)


def build_output(state, tokenizer) -> RequestOutput:
    seqs = state.seqs
    n = state.params.n
    finished = state.finished
    if len(seqs) > n:           # best_of: only the n most likely sequences, once all are done
        if not finished:
            chosen = []
        else:
            chosen = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n]
    else:
        chosen = seqs
    outputs = [_completion(s, i) for i, s in enumerate(chosen)]
    first = seqs[0]
    metrics = first.metrics
    metrics.num_cached_tokens = max(first.num_cached_tokens, 0)
    metrics.num_output_tokens = sum(len(s.output_token_ids) for s in seqs)
    if finished and metrics.finished_time is None:
        metrics.finished_time = max((s.metrics.finished_time or 0.0) for s in seqs)
    return RequestOutput(
        request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
        outputs=outputs, finished=finished, num_cached_tokens=max(first.num_cached_tokens, 0),
        prompt_logprobs=first.prompt_logprobs, metrics=metrics)
