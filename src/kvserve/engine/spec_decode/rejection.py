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

Logprobs are always the target's raw ones (log_softmax of the unprocessed row), as without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.messages import TokenLogprob
from kvserve.engine.sampler import Sampler, SamplingRequest, compute_logprobs


@dataclass
class SpecRow:
    """One speculating request in the step: its sampling state and drafts, and where its k + 1
    rows of logits start."""

    sreq: SamplingRequest
    drafts: list[int]
    first_row: int
    draft_probs: torch.Tensor | None = None     # [k, V] a draft model's q (None: point masses)


def _uniform(gen: torch.Generator | None, dev: torch.device) -> float:
    return float(torch.rand(1, generator=gen, device=gen.device if gen is not None else dev))


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """Inverse-CDF draw from one (unnormalised) probability row."""
    cdf = probs.cumsum(0)
    total = cdf[-1]
    u = _uniform(gen, probs.device)
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(cdf, target.view(1), right=True).clamp_(max=probs.shape[0] - 1))


def verify_one(sampler: Sampler, rows: torch.Tensor, row: SpecRow) -> list[int]:
    """The tokens the request emits this step: accepted drafts then one of the target's own."""
    base, drafts = row.sreq, row.drafts
    k = len(drafts)
    p = base.params
    ext = [SamplingRequest(p, base.prompt_token_ids, base.output_token_ids + drafts[:j], base.generator,
                           base.in_reasoning) for j in range(k + 1)]
    plain = p.greedy and not any(sampler._needs_processing(r) for r in ext)
    logits = rows.float() if plain else sampler.process_logits(rows, ext)
    if p.greedy:
        best = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for j in range(k):
            if best[j] != drafts[j]:
                return out + [best[j]]
            out.append(drafts[j])
        return out + [best[k]]
    probs = sampler.truncate(logits, ext, [False] * (k + 1)).softmax(dim=-1)
    gen = base.generator
    out = []
    for j, d in enumerate(drafts):
        pj = probs[j]
        if row.draft_probs is None:                    # q_j: a point mass on d
            if _uniform(gen, pj.device) < float(pj[d]):
                out.append(d)
                continue
            residual = pj.clone()
            residual[d] = 0.0
        else:
            qj = row.draft_probs[j]
            if _uniform(gen, pj.device) * float(qj[d]) < float(pj[d]):
                out.append(d)
                continue
            residual = (pj - qj).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:               # p was the point mass itself (cannot reject)
            residual = pj
        return out + [_draw(residual, gen)]
    return out + [_draw(probs[k], gen)]


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[SpecRow], num_top: list[int]
           ) -> tuple[list[list[int]], list[list[TokenLogprob]]]:
    """Tokens and their target logprobs for each speculating request (`num_top`: each one's k)."""
    tokens, lps = [], []
    for row, k in zip(rows, num_top):
        r = logits[row.first_row:row.first_row + len(row.drafts) + 1]
        toks = verify_one(sampler, r, row)
        tokens.append(toks)
        want = row.sreq.params.logprobs is not None
        lp, rk, ti, tl = compute_logprobs(r[:len(toks)], torch.tensor(toks, device=r.device), k, want)
        lp, rk = lp.tolist(), rk.tolist()
        if k and ti is not None:
            ti, tl = ti.tolist(), tl.tolist()
            lps.append([TokenLogprob(t, a, b, c, d) for t, a, b, c, d in zip(toks, lp, rk, ti, tl)])
        else:
            lps.append([TokenLogprob(t, a, b) for t, a, b in zip(toks, lp, rk)])
    return tokens, lps
