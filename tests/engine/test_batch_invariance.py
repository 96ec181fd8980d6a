"""Batch-invariant inference (issue 15) on the default model in the default weight format: a
request's numbers are bitwise the same whatever else shares its steps, however its prompt is
chunked and whether it hits the prefix cache.

- 12 varied prompts, greedy: batched == one at a time, token for token and logprob for logprob;
- seeded sampling (temperature 0.8) alone == the same request among 15 others;
- prefix-cached == cold: tokens and returned logprobs exactly equal, and the hit is verified;
- chunked prefill with max_num_batched_tokens 16, 64 and 512: tokens, logprobs and prompt
  logprobs exactly equal (float ==, no tolerance).
The model alone (logits under every chunking, forced AVX2 == native) is tests/model/test_same_bits.py.

Only where the backend is batch-invariant (the default with the C kernels; skipped with the reason
elsewhere, e.g. on a CPU without AVX2 or with KVSERVE_BATCH_INVARIANT=0). The last test runs the
same machinery on a backend with KVSERVE_BATCH_INVARIANT=0's switch points (fp32 GEMM from 32
tokens, SDPA above 16 query tokens) and asserts no equality there: those numbers depend on the step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.loader import LoadedModel, load_model
from kvserve.outputs import PositionLogprobs, RequestOutput
from kvserve.train.data import load_corpus

QUESTIONS = [
    "Name the capital city of France.",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity to a child in one sentence.",
    "What is 17 times 3?",
    "Translate 'good morning' into Spanish.",
    "Give me a short tip for learning to cook.",
    "Why is the sky blue? Answer in two sentences.",
    "Write a Python function that reverses a string.",
]



@pytest.fixture(scope="module")
def corpus_ids(loaded) -> list[int]:
    return loaded.tokenizer.encode(load_corpus(max_chars=20_000))


@pytest.fixture(scope="module")
def prompts(loaded, corpus_ids) -> list[list[int]]:
    """12 prompts: 9 chat questions (~20-40 tokens) and 3 raw corpus windows of 60, 150 and 300
    tokens, so the batched steps mix decodes with long prompt chunks."""
    tok = loaded.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for q in QUESTIONS]
    raw = [corpus_ids[100:160], corpus_ids[600:750], corpus_ids[1200:1500]]
    out = chats + raw
    assert len(out) == 12
    return out


@pytest.fixture(scope="module")
def llm(loaded) -> LLM:
    """The shared engine: default settings (fp16 KV cache, 512-token steps, prefix caching on)."""
    return LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory="256MiB")


def make_llm(loaded: LoadedModel, **kw) -> LLM:
    return LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory=kw.pop("kv_cache_memory", "128MiB"), **kw)


def gen(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def lp_key(pos: PositionLogprobs | None):
    """One position's logprobs as exact values: (token id, logprob float, rank) sorted by id."""
    return None if pos is None else sorted((t, lp.logprob, lp.rank) for t, lp in pos.items())


def signature(out: RequestOutput) -> dict:
    """Everything numeric a request returns, for exact comparison."""
    c = out.outputs[0]
    return {"tokens": c.token_ids, "text": c.text, "cumulative": c.cumulative_logprob,
            "logprobs": [lp_key(p) for p in c.logprobs] if c.logprobs is not None else None,
            "prompt_logprobs": ([lp_key(p) for p in out.prompt_logprobs] if out.prompt_logprobs is not None
                                else None)}


def first_difference(a: dict, b: dict) -> str:
    for key, x in a.items():
        y = b[key]
        if x != y:
            if isinstance(x, list) and isinstance(y, list):
                j = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                return f"{key} differ first at index {j}: {x[j:j + 1]} vs {y[j:j + 1]}"
            return f"{key} differ: {x!r} vs {y!r}"
    return "equal"


# ---- the engine --------------------------------------------------------------------------------


def test_greedy_batched_equals_one_at_a_time(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    batched = gen(llm, prompts, params)
    for i, p in enumerate(prompts):
        alone = gen(llm, [p], params)[0]
        a, b = signature(batched[i]), signature(alone)
        assert a == b, f"prompt {i} ({len(p)} tokens): batched vs alone: {first_difference(a, b)}"


def test_seeded_sampling_alone_equals_in_a_batch_of_16(llm, prompts):
    target = prompts[1]
    params = SamplingParams(temperature=0.8, seed=1234, max_tokens=24, ignore_eos=True, logprobs=2)
    alone = gen(llm, [target], params)[0]
    others = [p for i, p in enumerate(prompts) if i != 1] + [prompts[0][:-3], prompts[2][:-5], prompts[9][:40],
                                                              prompts[11][:200]]
    assert len(others) == 15
    other_params = [SamplingParams(temperature=0 if i % 3 == 0 else 1.0, seed=i if i % 2 else None,
                                   top_p=0.9 if i % 4 == 1 else 1.0, max_tokens=8 + i, ignore_eos=True)
                    for i in range(15)]
    mixed = others[:7] + [target] + others[7:]
    outs = gen(llm, mixed, other_params[:7] + [params] + other_params[7:])
    a, b = signature(alone), signature(outs[7])
    assert a == b, f"seeded sample alone vs among 15 others: {first_difference(a, b)}"


def test_prefix_cached_equals_cold(loaded, corpus_ids):
    # ~100 tokens: the second run takes 6 full blocks from the cache and computes the rest.
    prompt = corpus_ids[2000:2100]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    warm_llm = make_llm(loaded)
    cold = gen(warm_llm, [prompt], params)[0]
    assert cold.num_cached_tokens == 0
    before = warm_llm.stats()
    warm = gen(warm_llm, [prompt], params)[0]
    after = warm_llm.stats()
    block = warm_llm.engine.block_size
    assert warm.num_cached_tokens >= 4 * block, warm.num_cached_tokens
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == warm.num_cached_tokens
    no_cache = gen(make_llm(loaded, enable_prefix_caching=False), [prompt], params)[0]
    a, b, c = signature(warm), signature(cold), signature(no_cache)
    assert a == b, f"prefix-cached vs cold: {first_difference(a, b)}"
    assert b == c, f"cold run vs an engine without prefix caching: {first_difference(b, c)}"


def test_chunked_prefill_16_64_512_bitwise_equal(loaded, prompts, corpus_ids):
    long = corpus_ids[2500:2730]             # 230 tokens: 15 chunks of 16, 4 of 64, 1 of 512
    batch = [long, prompts[3], prompts[9]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    runs = {}
    for budget in (16, 64, 512):
        outs = gen(make_llm(loaded, max_num_batched_tokens=budget), batch, params)
        runs[budget] = [signature(o) for o in outs]
        for o, p in zip(outs, batch):
            assert o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(p)
            assert len(o.outputs[0].token_ids) == 16
    for budget in (16, 64):
        for i, (a, b) in enumerate(zip(runs[budget], runs[512])):
            assert a == b, f"prompt {i}: steps of {budget} vs 512 tokens: {first_difference(a, b)}"


# ---- invariance off --------------------------------------------------------------------------------


def test_machinery_runs_with_invariance_off():
    """KVSERVE_BATCH_INVARIANT=0's switch points (fp32 GEMM from 32 tokens, SDPA for chunks above
    16 query tokens): the engine serves the same requests under both step budgets; their numbers
    may differ (logits by ~0.7 between chunkings), so the differences are only reported.
    Runs with or without KVSERVE_BATCH_INVARIANT in the environment."""
    detected = KernelBackend.detect()
    if detected.lib is None:
        pytest.skip(f"no C kernels here: {detected.describe()}")
    backend = replace(detected, bf16_min_tokens=None, f32_min_tokens=32, attn_c_max_query=16)
    assert not backend.batch_invariant
    lm = load_model(None, backend=backend)
    corpus_ids = lm.tokenizer.encode(load_corpus(max_chars=20_000))
    chat = lm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], tokenize=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    sigs = {}
    for budget in (16, 512):
        outs = gen(make_llm(lm, max_num_batched_tokens=budget), [corpus_ids[2500:2600], chat], params)
        assert all(len(o.outputs[0].token_ids) == 8 and len(o.prompt_logprobs) == len(p)
                   for o, p in zip(outs, [corpus_ids[2500:2600], chat]))
        sigs[budget] = [signature(o) for o in outs]
    same = [a == b for a, b in zip(sigs[16], sigs[512])]
    print(f"\ninvariance off: engine chunks 16 vs 512 equal: {same}")
