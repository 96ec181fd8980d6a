"""Verification: which draft tokens the target keeps, and the one token of its own that follows.

For a request with drafts d_1..d_k the runner computes the target's logits at k + 1 positions:
row j is the distribution of the token after d_1..d_j (row 0: after the request's last real
token). Every row goes through the same logits processors as a normal step (grammar aside,
penalties and min_tokens see the drafts before it as output), so:

- greedy: d_j is kept while it is the argmax of row j-1; the first mismatch is replaced by the
  argmax, and after k kept drafts the argmax of row k is the bonus token. The result is exactly
  the tokens greedy decoding produces one step at a time (a row's logits do not depend on the
  batch or on how many tokens share its step: the kernels are batch invariant).
- sampled: the standard speculative rejection rule (Leviathan et al., Chen et al.) with target
  distribution p_j (after temperature, top_k, top_p, min_p) and draft distribution q_j. The
  n-gram proposer's q_j is a point mass on d_j, so d_j is accepted with probability p_j(d_j), and
  on rejection the replacement is drawn from (p_j - q_j)+ normalised, i.e. p_j without d_j. Each
  emitted token is then distributed exactly as p_j. A draft model's q passes through `draft_probs`.
- sampled, with a likelihood threshold (`SpecRow.min_logprob`: only a request's own draft, the
  semantic cache's `sampled_min_logprob`): d_j is kept while the model's raw log-probability of it
  (the logprob reported to clients, before temperature) is >= the threshold *and* the request's
  own sampling could draw it (p_j(d_j) > 0: inside top_k/top_p/min_p, allowed by a grammar); the
  first token that fails is replaced by a plain draw from p_j and decoding goes on. Deterministic
  given the logits: a stored answer whose every token the model finds likely is served whole. The
  answer is then a likely one, not one distributed exactly as a miss's (the exact rule above is
  what `min_logprob` None keeps).

Logprobs are always the target's raw ones (log_softmax of the unprocessed row), as without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.messages import TokenLogprob
from kvserve.engine.sampler import Sampler, SamplingRequest, compute_logprobs, greedy_ids


@dataclass
class SpecRow:
    """One speculating request in the step: its sampling state and drafts, and where its k + 1
    rows of logits start."""

    sreq: SamplingRequest
    drafts: list[int]
    first_row: int
    draft_probs: torch.Tensor | None = None     # [k, V] a draft model's q (None: point masses)
    min_logprob: float | None = None            # sampled: keep drafts by likelihood, not by chance (docstring)


def _draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from one (unnormalised) probability row with the uniform u."""
    cdf = probs.cumsum(0)
    total = cdf[-1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(cdf, target.view(1), right=True).clamp_(max=probs.shape[0] - 1))


def _accept(drafts: list[int], best: list[int]) -> list[int]:
    """Greedy: drafts while they are the argmax, then the argmax."""
    for j, d in enumerate(drafts):
        if best[j] != d:
            return drafts[:j] + [best[j]]
    return drafts + [best[len(drafts)]]


def _likely(probs: torch.Tensor, drafts: list[int], draft_lps: list[float], min_logprob: float,
            u: list[list[float]]) -> list[int]:
    """Sampled, threshold mode: drafts while their raw logprob clears `min_logprob` and the request's
    sampling could draw them, then a plain draw from that row (the bonus draw after them all)."""
    for j, d in enumerate(drafts):
        if draft_lps[j] < min_logprob or float(probs[j][d]) <= 0.0:
            return drafts[:j] + [_draw(probs[j], u[j][1])]
    return drafts + [_draw(probs[len(drafts)], u[len(drafts)][1])]


def _reject_sample(probs: torch.Tensor, row: SpecRow, u: list[list[float]],
                   draft_lps: list[float] | None = None) -> list[int]:
    """Sampled: p_j(d)/q_j(d) acceptance, the residual draw on the first rejection, else the bonus draw.
    `u`: two uniforms per row (acceptance, draw). With `row.min_logprob` (and `draft_lps`, the raw
    logprob of each draft) the threshold rule instead (`_likely`)."""
    if row.min_logprob is not None and draft_lps is not None:
        return _likely(probs, row.drafts, draft_lps, row.min_logprob, u)
    out: list[int] = []
    for j, d in enumerate(row.drafts):
        pj = probs[j]
        if row.draft_probs is None:                    # q_j: a point mass on d
            if u[j][0] < float(pj[d]):
                out.append(d)
                continue
            residual = pj.clone()
            residual[d] = 0.0
        else:
            qj = row.draft_probs[j]
            if u[j][0] * float(qj[d]) < float(pj[d]):
                out.append(d)
                continue
            residual = (pj - qj).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:               # p was the point mass itself (cannot reject)
            residual = pj
        return out + [_draw(residual, u[j][1])]
    return out + [_draw(probs[len(row.drafts)], u[len(row.drafts)][1])]


def _uniforms(rows: list[SpecRow], dev: torch.device) -> list[list[list[float]]]:
    """Two uniforms per verified row: one batched draw from the global stream, a seeded request's
    own from its generator."""
    n = sum(len(r.drafts) + 1 for r in rows)
    shared = torch.rand(n, 2, device=dev).tolist()
    out, i = [], 0
    for r in rows:
        m = len(r.drafts) + 1
        g = r.sreq.generator
        out.append(shared[i:i + m] if g is None else torch.rand(m, 2, generator=g, device=g.device).tolist())
        i += m
    return out


def _draft_logprobs(raw: torch.Tensor, start: int, row: SpecRow) -> list[float] | None:
    """The model's raw log-probability of each draft (rows start.. of `raw`), for the threshold rule."""
    if row.min_logprob is None or not row.drafts:
        return None
    k = len(row.drafts)
    ids = torch.tensor(row.drafts, device=raw.device).view(k, 1)
    return torch.log_softmax(raw[start:start + k], dim=-1).gather(1, ids).view(k).tolist()


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[SpecRow], num_top: list[int],
           grammar: dict[int, torch.Tensor] | None = None) -> tuple[list[list[int]], list[list[TokenLogprob]]]:
    """Tokens and their target logprobs for each speculating request (`num_top`: each one's k).
    The logits processors and truncation run once over every verified row of the step.
    `grammar`: index in `rows` -> that request's k + 1 grammar bitmasks (GrammarBackend.draft_bitmask)."""
    ext: list[SamplingRequest] = []
    index: list[int] = []
    for r in rows:
        b = r.sreq
        ext += [SamplingRequest(b.params, b.prompt_token_ids, b.output_token_ids + r.drafts[:j], b.generator,
                                b.in_reasoning) for j in range(len(r.drafts) + 1)]
        index += range(r.first_row, r.first_row + len(r.drafts) + 1)
    dev = logits.device
    if index == list(range(index[0], index[0] + len(index))):   # the usual case: a view, not a copy of
        raw = logits[index[0]:index[0] + len(index)].float()     # rows of the whole vocabulary
    else:
        raw = logits[torch.tensor(index, device=dev)].float()
    greedy = [e.params.greedy for e in ext]
    masks = None
    if grammar:
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + len(r.drafts) + 1)
        mrows = [starts[i] + j for i in sorted(grammar) for j in range(len(rows[i].drafts) + 1)]
        masks = (mrows, torch.cat([grammar[i] for i in sorted(grammar)]))
    plain = masks is None and all(greedy) and not any(sampler._needs_processing(e) for e in ext)
    processed = raw if plain else sampler.process_logits(raw, ext, masks)
    best = greedy_ids(processed).tolist() if any(greedy) else []
    probs = sampler.truncate(processed.clone(), ext, greedy).softmax(dim=-1) if not all(greedy) else None
    u = _uniforms([r for r in rows if not r.sreq.params.greedy], dev) if probs is not None else []
    tokens: list[list[int]] = []
    lps: list[list[TokenLogprob]] = []
    start, iu = 0, 0
    for row, k in zip(rows, num_top):
        m = len(row.drafts) + 1
        if row.sreq.params.greedy:
            toks = _accept(row.drafts, best[start:start + m])
        else:
            toks = _reject_sample(probs[start:start + m], row, u[iu], _draft_logprobs(raw, start, row))
            iu += 1
        tokens.append(toks)
        want = row.sreq.params.logprobs is not None
        lp, rk, ti, tl = compute_logprobs(raw[start:start + len(toks)], torch.tensor(toks, device=dev), k, want)
        lp, rk = lp.tolist(), rk.tolist()
        if k and ti is not None:
            ti, tl = ti.tolist(), tl.tolist()
            lps.append([TokenLogprob(t, a, b, c, d) for t, a, b, c, d in zip(toks, lp, rk, ti, tl)])
        else:
            lps.append([TokenLogprob(t, a, b) for t, a, b in zip(toks, lp, rk)])
        start += m
    return tokens, lps
