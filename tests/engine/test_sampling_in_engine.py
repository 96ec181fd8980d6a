"""Sampling controls through the real engine: seeds are batch-independent, n > 1 shares the
prompt's KV blocks, stop strings and min_tokens behave end to end."""

import pytest

from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(weight_format="fp32", kv_cache_memory="512MiB")


def _chat(llm, text):
    return {"prompt_token_ids": llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}],
                                                                         tokenize=True)}


def test_seeded_request_same_alone_and_in_batch_of_32(llm):
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    alone = llm.generate(_chat(llm, "Tell me a story."), target, use_tqdm=False)[0].outputs[0].text
    others = [(_chat(llm, f"Question number {i}: say something."),
               SamplingParams(temperature=0.9, max_tokens=4 + i % 7, seed=None if i % 2 else i)) for i in range(31)]
    prompts = [p for p, _ in others]
    params = [s for _, s in others]
    prompts.insert(17, _chat(llm, "Tell me a story."))
    params.insert(17, target)
    batch = llm.generate(prompts, params, use_tqdm=False)
    assert batch[17].outputs[0].text == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=16)
    assert llm.generate(_chat(llm, "Tell me a story."), other_seed, use_tqdm=False)[0].outputs[0].text != alone


def _peak_blocks(llm, prompts, params) -> int:
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"peak-{id(prompts)}-{i}", p, sp)
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, eng.core.kv.num_used_blocks)
    return peak


def test_n4_shares_prompt_blocks(llm):
    prompt = _chat(llm, "Write a detailed paragraph about the history of bread. " * 8)
    llm.engine.core.kv.reset_prefix_cache()
    sp = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)
    shared = _peak_blocks(llm, [prompt], [sp])
    llm.engine.core.kv.reset_prefix_cache()
    single = [SamplingParams(temperature=1.0, seed=i, max_tokens=8, ignore_eos=True) for i in range(4)]
    separate = _peak_blocks(llm, [prompt] * 4, single)
    assert shared < separate
    outs = llm.generate(prompt, sp, use_tqdm=False)[0].outputs
    assert len(outs) == 4 and len({o.text for o in outs}) > 1


def test_best_of_returns_most_likely(llm):
    out = llm.generate(_chat(llm, "Name a fruit."), SamplingParams(n=2, best_of=4, temperature=1.0, seed=3,
                                                                   max_tokens=6), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_stop_string_and_min_tokens(llm):
    # "List ..." rather than "Count from 1 to 10, ...": the same answer, but every greedy token up to
    # the "5" leads its runner-up by 1.6 nats or more (the "Count" wording has a 0.19-nat step).
    p = _chat(llm, "List the numbers from 1 to 10, separated by commas.")
    full = llm.generate(p, SamplingParams(temperature=0, max_tokens=40, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert "5" in full.text
    upto = next(j for j in range(len(full.token_ids)) if "5" in llm.get_tokenizer().decode(full.token_ids[:j + 1]))
    for j in range(upto + 1):
        best, second = sorted((lp.logprob for lp in full.logprobs[j].values()), reverse=True)[:2]
        assert best - second > 0.5, f"greedy token {j} leads by only {best - second:.3f} nats"
    cut = llm.generate(p, SamplingParams(temperature=0, max_tokens=40, stop=["5"]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "5"
    assert cut.text == full.text[:full.text.index("5")]
    kept = llm.generate(p, SamplingParams(temperature=0, max_tokens=40, stop=["5"], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index("5") + 1]
    longer = llm.generate(p, SamplingParams(temperature=0, max_tokens=60, min_tokens=len(full.token_ids) + 5),
                          use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= len(full.token_ids) + 5


def test_logprobs_are_raw_distribution(llm):
    out = llm.generate(_chat(llm, "Hi"), SamplingParams(temperature=0.5, max_tokens=3, logprobs=5, seed=1),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert tok in pos
        ranks = sorted(lp.rank for t, lp in pos.items() if t != tok or lp.rank <= 5)
        assert ranks[:5] == [1, 2, 3, 4, 5]
        top = max(pos.values(), key=lambda lp: lp.logprob)
        assert top.rank == 1
