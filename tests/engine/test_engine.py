"""The engine against the model run alone, with the real default model in fp32.

Reference: the model's dense forward `model(ids[None])` (plain causal attention, no KV cache,
no batching), teacher-forced on the prompt plus the tokens the engine generated. At every
generated position the engine's reported log-probabilities (chosen token and top-5) must be
within 1e-4 of the reference, and its greedy token must be the reference argmax, unless the
top-2 logit gap there is below 1e-3 (a tie that float rounding may break either way; such
divergences are printed, and later positions are then no longer "the same run").
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.model_runner import ModelRunner, PhaseClock
from kvserve.model.loader import LoadedModel, load_model
from kvserve.outputs import CompletionOutput
from kvserve.train.data import load_corpus

LOGPROB_TOL = 1e-4
TIE_GAP = 1e-3


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(None, weight_format="fp32")


@pytest.fixture(scope="module")
def corpus_ids(loaded) -> list[int]:
    return loaded.tokenizer.encode(load_corpus(max_chars=60_000))


def make_llm(loaded: LoadedModel, **kw) -> LLM:
    kw.setdefault("kv_cache_dtype", "fp32")   # exact checks against the cache-free model (16-bit K/V: ~1e-2)
    return LLM(loaded.model, tokenizer=loaded.tokenizer, **kw)


def mixed_prompts(corpus_ids: list[int], n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n windows of the corpus with lengths in [lo, hi], always including both ends."""
    rng = random.Random(seed)
    lens = [lo, hi] + [rng.randint(lo, hi) for _ in range(n - 2)]
    rng.shuffle(lens)
    out = []
    for n_tok in lens:
        start = rng.randrange(0, len(corpus_ids) - n_tok)
        out.append(corpus_ids[start:start + n_tok])
    return out


@torch.inference_mode()
def check_against_dense(model, prompt: list[int], comp: CompletionOutput) -> str | None:
    """Assert the criterion above for one completion; return a note on a tie-broken divergence."""
    ids = prompt + comp.token_ids[:-1]
    hidden = model(torch.tensor(ids)[None])[0, len(prompt) - 1:]
    logits = model.compute_logits(hidden)
    ref_lp = torch.log_softmax(logits, dim=-1)
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids)
    note = None
    for j, (tok, pos) in enumerate(zip(comp.token_ids, comp.logprobs)):
        for tid, lp in pos.items():
            err = abs(lp.logprob - ref_lp[j, tid].item())
            assert err < LOGPROB_TOL, f"position {j}, token {tid}: logprob off by {err:.2e}"
        top = logits[j].topk(2)
        if note is None and tok != top.indices[0].item():
            gap = (top.values[0] - logits[j, tok]).item()
            assert gap < TIE_GAP, f"greedy diverged at output position {j} with a logit gap of {gap:.2e}"
            note = f"prompt of {len(prompt)} tokens: tie at output position {j} (gap {gap:.1e})"
    return note


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5, ignore_eos=True)


def assert_pool_idle(llm: LLM) -> None:
    s = llm.stats()
    assert s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert all(c == 0 for c in llm.engine.core.kv.ref_cnt)
    assert llm.engine.outputs.requests == {} and llm.engine.core.scheduler.requests == {}


@pytest.mark.parametrize("n, lo, hi, budget", [
    (12, 10, 300, 128),
    pytest.param(64, 10, 1500, 512, marks=pytest.mark.slow),
])
def test_batch_matches_each_prompt_alone(loaded, corpus_ids, n, lo, hi, budget):
    prompts = mixed_prompts(corpus_ids, n, lo, hi, seed=n)
    llm = make_llm(loaded, kv_cache_memory="1GiB", max_num_seqs=64, max_num_batched_tokens=budget)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)
    # Prompts longer than the budget were prefilled in chunks, alongside other requests' decodes.
    assert llm.stats()["num_steps"] > sum(len(p) for p in prompts) // budget
    notes = []
    for p, out in zip(prompts, outs):
        assert out.prompt_token_ids == p and len(out.outputs[0].token_ids) == 8
        note = check_against_dense(loaded.model, p, out.outputs[0])
        if note:
            notes.append(note)
    print(f"\n{len(notes)} of {n} greedy outputs diverged at a near-tie: {notes}")
    assert_pool_idle(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_keeps_outputs_exact(loaded, corpus_ids, prefix_caching):
    prompts = mixed_prompts(corpus_ids, 6, 60, 120, seed=7)
    per_block = ModelRunner.bytes_per_block(loaded.model, 16, torch.float32)
    # 20 blocks (320 tokens) for 6 requests that each grow to ~8 blocks: preemption is certain.
    llm = make_llm(loaded, kv_cache_memory=20 * per_block, block_size=16, max_num_batched_tokens=256,
                   enable_prefix_caching=prefix_caching)
    assert llm.stats()["kv_blocks_total"] == 20
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24), use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for p, out in zip(prompts, outs):
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 24
        check_against_dense(loaded.model, p, out.outputs[0])
    assert_pool_idle(llm)


@pytest.mark.parametrize("long_len, budget", [
    (1000, 128),
    pytest.param(4000, 512, marks=pytest.mark.slow),
])
def test_chunked_prefill_does_not_stall_decodes(loaded, corpus_ids, long_len, budget):
    llm = make_llm(loaded, kv_cache_memory="1GiB", max_num_batched_tokens=budget)
    eng = llm.engine
    decode = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    short = mixed_prompts(corpus_ids, 8, 10, 40, seed=3)
    for i, p in enumerate(short):
        eng.add_request(f"d{i}", p, decode)
    seqs = [eng.core.scheduler.requests[f"d{i}"] for i in range(8)]
    while not all(s.output_token_ids for s in seqs):
        eng.step()
    eng.add_request("long", corpus_ids[:long_len], SamplingParams(temperature=0, max_tokens=1))
    long_seq = eng.core.scheduler.requests["long"]
    steps = 0
    while long_seq.num_computed_tokens < long_len:
        before = [len(s.output_token_ids) for s in seqs]
        eng.step()
        steps += 1
        after = [len(s.output_token_ids) for s in seqs]
        assert after == [b + 1 for b in before], f"a decode stalled in step {steps} of the long prefill"
    assert steps >= -(-long_len // budget)          # it really was prefilled in chunks
    assert long_seq.is_finished and len(long_seq.output_token_ids) == 1
    for i in range(8):
        eng.abort(f"d{i}")
    assert_pool_idle(llm)


def test_random_aborts_leave_the_pool_free(loaded, corpus_ids):
    rng = random.Random(11)
    prompts = mixed_prompts(corpus_ids, 20, 5, 150, seed=11)
    # A small pool and budget so aborts hit waiting, prefilling, decoding and preempted requests.
    per_block = ModelRunner.bytes_per_block(loaded.model, 16, torch.float32)
    llm = make_llm(loaded, kv_cache_memory=40 * per_block, max_num_batched_tokens=64, max_num_seqs=8)
    eng = llm.engine
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(1, 20), n=1 + (i % 3 == 0))
        eng.add_request(str(i), p, params)
    live = [str(i) for i in range(len(prompts))]
    eng.abort(live.pop(rng.randrange(len(live))))       # one aborted before it ever ran
    finished, aborted = set(), 1
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished.add(out.request_id)
        live = [r for r in live if r not in finished]
        if live and rng.random() < 0.5:
            out = eng.abort(live.pop(rng.randrange(len(live))))
            assert out is not None and out.finished
            assert all(c.finish_reason in ("abort", "length", "stop") for c in out.outputs)
            aborted += 1
        assert eng.core.kv.num_used_blocks <= eng.core.kv.num_blocks
    assert aborted > 3 and finished
    assert eng.abort("no-such-request") is None
    assert_pool_idle(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "bf16"])
def test_unwritten_kv_slots_do_not_reach_the_output(loaded, corpus_ids, kv_cache_dtype):
    """The pool is torch.empty: slots never written (the tail of a sequence's last block, the
    padding of a batch's block tables) may hold anything, NaN included (CUDA's caching allocator
    hands back used memory). Attention must not let them through, even multiplied by zero.
    fp32 runs the C decode kernel on CPU, bf16 the SDPA path every other device uses."""
    prompts = mixed_prompts(corpus_ids, 4, 5, 60, seed=5)
    runs = []
    for fill in (0.0, float("nan")):
        llm = make_llm(loaded, kv_cache_memory="32MiB", kv_cache_dtype=kv_cache_dtype)
        for cache in llm.engine.core.runner.kv_caches:
            cache.fill_(fill)
        runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(4), use_tqdm=False))
        assert_pool_idle(llm)
    for p, clean, dirty in zip(prompts, *runs):
        assert dirty.outputs[0].token_ids == clean.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in pos.items()} for pos in dirty.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in pos.items()} for pos in clean.outputs[0].logprobs]
        if kv_cache_dtype == "fp32":
            check_against_dense(loaded.model, p, dirty.outputs[0])


def test_step_profile_counts_every_phase(loaded, corpus_ids):
    """stats() carries the cumulative time of each step phase (schedule | prepare, forward, logits,
    sample | update; `messages` is the server's busy loop), the steps and the batched tokens and
    requests; the phases never overlap, so they add up to less than the wall time."""
    prompts = mixed_prompts(corpus_ids, 3, 20, 40, seed=5)
    llm = make_llm(loaded, enable_prefix_caching=False)
    s0 = llm.stats()
    assert set(s0["phase_seconds"]) == set(PhaseClock.PHASES)
    for _ in range(2):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(4), use_tqdm=False)
        wall = time.perf_counter() - t0
        s1 = llm.stats()
        spent = {k: s1["phase_seconds"][k] - s0["phase_seconds"][k] for k in PhaseClock.PHASES}
        for phase in ("schedule", "prepare", "forward", "logits", "sample", "update"):
            assert spent[phase] > 0, phase
        assert spent["messages"] == 0                    # LLM drives step() itself
        assert sum(spent.values()) < wall
        steps = s1["num_steps"] - s0["num_steps"]
        # every prompt token once, then one token per decode step per request (the last sampled is not fed)
        assert s1["num_batched_tokens"] - s0["num_batched_tokens"] == sum(map(len, prompts)) + 3 * 3
        assert steps <= s1["num_batched_requests"] - s0["num_batched_requests"] <= 3 * steps
        s0 = s1
