"""The likelihood-threshold rule for a request's own draft (`SpecRow.min_logprob`,
`EngineCoreRequest.draft_min_logprob`; the semantic cache's `sampled_min_logprob`), on synthetic
logits where every probability is known:

- a sampled row keeps its drafts while the model's *raw* logprob of each clears the threshold,
  whatever the uniforms (deterministic), where the exact rule keeps them only by chance;
- the first draft under the threshold is replaced by a draw from the request's own distribution;
- a draft the request's sampling could never draw (outside top_k / top_p) is never kept, however
  likely under the raw distribution; temperature does not move the threshold (raw logprobs);
- greedy rows ignore the threshold (a greedy hit stays exactly the greedy answer);
- without a threshold the exact rejection rule is unchanged.
"""

from __future__ import annotations

import math

import torch

from kvserve import SamplingParams
from kvserve.engine.sampler import Sampler, SamplingRequest
from kvserve.engine.spec_decode.rejection import SpecRow, verify

V = 8


def logits_for(rows: list[list[float]]) -> torch.Tensor:
    """One row of logits per probability row (the log of each probability)."""
    return torch.tensor(rows).clamp_min(1e-12).log()


# row j: the distribution after drafts d_1..d_j. Drafts 2, 3, 5 with raw p 0.6, 0.3, 0.05.
PROBS = [[0.05, 0.05, 0.6, 0.1, 0.05, 0.05, 0.05, 0.05],
         [0.1, 0.1, 0.1, 0.3, 0.1, 0.1, 0.1, 0.1],
         [0.25, 0.2, 0.15, 0.05, 0.1, 0.05, 0.1, 0.1],
         [0.125] * V]
DRAFTS = [2, 3, 5]


def run(params: SamplingParams, min_logprob: float | None, seed: int, drafts=DRAFTS, probs=PROBS) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    row = SpecRow(SamplingRequest(params, [1], [], g), list(drafts), 0, min_logprob=min_logprob)
    tokens, lps = verify(Sampler([]), logits_for(probs), [row], [0])
    assert [t.token_id for t in lps[0]] == tokens[0]
    return tokens[0]


def test_drafts_above_the_threshold_are_kept_whatever_the_draw():
    sampled = SamplingParams(temperature=1.0)
    outs = [run(sampled, math.log(0.04), seed) for seed in range(40)]
    assert all(o[:3] == DRAFTS and len(o) == 4 for o in outs)
    exact = [run(sampled, None, seed) for seed in range(40)]     # the exact rule keeps all three by chance
    assert sum(o[:3] == DRAFTS for o in exact) < 20 and all(len(o) <= 4 for o in exact)


def test_first_draft_under_the_threshold_is_redrawn_from_the_row():
    sampled = SamplingParams(temperature=1.0)
    seen = set()
    for seed in range(60):
        o = run(sampled, math.log(0.1), seed)      # 0.6, 0.3 clear it; 0.05 does not
        assert o[:2] == [2, 3] and len(o) == 3
        seen.add(o[2])
    assert len(seen) >= 4                          # a draw from row 2, not a fixed replacement
    assert all(len(run(sampled, math.log(0.7), s)) == 1 for s in range(10))   # nothing kept


def test_outside_the_requests_support_never_kept_and_temperature_does_not_move_it():
    # top_k 1: only each row's argmax can be drawn; draft 4 has raw p 0.1 in row 1, whose argmax is 3
    probs = [PROBS[0], PROBS[1], PROBS[3]]
    for seed in range(10):
        assert run(SamplingParams(temperature=1.0, top_k=1), math.log(0.01), seed, drafts=[2, 4], probs=probs) \
            == [2, 3]                              # 4 is out of row 1's support: replaced by its argmax
    cold = SamplingParams(temperature=0.2)         # sharpened: p(3 | row 1) is tiny after temperature ...
    assert all(run(cold, math.log(0.25), s, drafts=[2, 3], probs=probs)[:2] == [2, 3] for s in range(10))
    # ... but its raw logprob (log 0.3) clears log 0.25: the threshold reads the model, not the sampler


def test_greedy_rows_ignore_the_threshold():
    greedy = SamplingParams(temperature=0)
    assert run(greedy, -1e9, 0) == [2, 3, 0]       # 3 is row 1's argmax; 5 is not: replaced by row 2's (0)
