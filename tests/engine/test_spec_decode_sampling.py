"""Speculative decoding keeps the target's sampled distribution (issue 16): the first 3 tokens of
many unseeded samples, with n-gram drafts verified by rejection sampling, against as many samples
without speculation, at temperature 0.7 and 1.0 with top_p 0.9. A two-sample chi-square test of
homogeneity over the 3-token sequences (rare ones pooled) must not reject at the 0.1% level
(temperature 0.7 is marked slow: the two runs cost ~30 s of CPU each). The
prompt repeats a pattern so that drafts are proposed from the first token on and are both
accepted and rejected (checked), so the residual draw is exercised too. The same for suffix
decoding (issue 63: drafts from the other requests' prompts and answers, spec_decode/suffix.py).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency

from kvserve import LLM, SamplingParams
from kvserve.model.loader import load_model

PROMPT = ("red green blue, red green yellow, red green blue, red green blue, red green yellow, red green blue, "
          "red green")
N = 300


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


def samples(llm: LLM, params: SamplingParams) -> Counter:
    outs = llm.generate([PROMPT] * N, params, use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("temperature", [pytest.param(0.7, marks=pytest.mark.slow), 1.0])
def test_first_three_tokens_have_the_target_distribution(loaded, temperature, method):
    kw = {"tokenizer": loaded.tokenizer, "kv_cache_memory": "128MiB", "max_num_seqs": 128}
    base = LLM(loaded.model, **kw)
    spec = LLM(loaded.model, speculative={"method": method, "max_batch_rows": 0}, num_speculative_tokens=3, **kw)
    params = SamplingParams(temperature=temperature, top_p=0.9, max_tokens=3, ignore_eos=True)
    torch.manual_seed(1234)
    a = samples(base, params)
    b = samples(spec, params)
    st = spec.stats()
    drafted, accepted = st["spec_decode_num_draft_tokens"], st["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, (drafted, accepted)
    # categories: sequences seen at least 10 times in total, the rest pooled
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    table = [[a[k] for k in keys] + [N - sum(a[k] for k in keys)],
             [b[k] for k in keys] + [N - sum(b[k] for k in keys)]]
    table = [list(col) for col in zip(*[c for c in zip(*table) if sum(c) > 0])]
    assert len(table[0]) >= 3, f"too few categories to test: {a.most_common(5)}"
    p = chi2_contingency(table).pvalue
    assert p > 1e-3, f"p={p:.2g}: with {a.most_common(6)} vs {b.most_common(6)}"
