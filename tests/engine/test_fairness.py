"""Fairness under long prompts (issue 24), on the scheduler with synthetic requests: decodes first,
short prompts admitted in the next step while a long one prefills, long prompts capped per step
and by the step-time model, at most max_num_partial_prefills of them at once, no starvation; then
the same through the real engine."""

from __future__ import annotations

import itertools
import math

import numpy as np

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.messages import ModelRunnerOutput, TokenLogprob
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.step_cost import StepCostModel
from tests.engine.test_scheduler import BS, make_seq, new_tokens, run_step


def make(budget: int = 64, threshold: int | None = None, partial: int = 1, step_ms: float | None = None,
         num_blocks: int = 512, max_num_seqs: int = 16, slowdown: float = 0.0) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs, budget, num_blocks * BS,
                     long_prefill_token_threshold=threshold, max_num_partial_prefills=partial, max_step_ms=step_ms,
                     max_decode_slowdown=slowdown)


def true_cost(chunks) -> float:
    """A machine for the scheduler tests: 2 ms a step, 0.3 ms a token, 0.1 ms a row, 0.5 us per token
    and context position attended."""
    return 2e-3 + sum(3e-4 * n + 1e-4 + 5e-7 * n * (c + n / 2) for c, n in chunks)


def run_timed(s: Scheduler):
    """run_step, teaching the scheduler's cost model the step's true time."""
    out = run_step(s)
    s.observe_step(out, true_cost([(e.num_computed_tokens, e.num_new_tokens) for e in out.scheduled]))
    return out


def test_short_request_starts_in_the_next_step_while_a_long_prompt_prefills():
    s = make(budget=64)                                 # long prompts: more than 32 tokens left
    long = make_seq(600, "long", base=1000)
    s.add(long)
    assert new_tokens(run_step(s)) == {"long": 64}      # alone: the whole budget
    short = make_seq(10, "short", max_tokens=3)
    s.add(short)
    out = new_tokens(run_step(s))
    assert out == {"short": 10, "long": 32}             # admitted at once, beside the long chunk
    out = new_tokens(run_step(s))
    assert out == {"short": 1, "long": 32}              # and decoding in every step after it
    steps = 2
    while not long.is_finished:
        out = new_tokens(run_step(s))
        steps += 1
        if not short.is_finished:
            assert out["short"] == 1
        assert sum(out.values()) <= 64
        assert steps < 100
    assert len(long.output_token_ids) == 4 and len(short.output_token_ids) == 3


def test_one_long_prompt_at_a_time_and_short_ones_pass_the_waiting_long_one():
    s = make(budget=64, partial=1)
    a, b = make_seq(200, "a", base=1000), make_seq(200, "b", base=5000)
    s.add(a)
    s.add(b)
    c = make_seq(8, "c", base=9000)
    s.add(c)                                            # arrived after b, short
    out = new_tokens(run_step(s))
    assert out == {"c": 8, "a": 32}                     # b waits for a's partial-prefill slot
    while a.num_prompt_tokens - a.num_computed_tokens > 32:     # a still long: b waits
        assert "b" not in new_tokens(run_step(s))
    seen_b = False
    for _ in range(40):
        out = new_tokens(run_step(s))
        seen_b |= "b" in out
    assert seen_b and b.num_computed_tokens >= b.num_prompt_tokens   # b is not starved


def test_two_partial_prefills_share_the_steps():
    s = make(budget=64, partial=2)
    a, b = make_seq(200, "a", base=1000), make_seq(200, "b", base=5000)
    s.add(a)
    s.add(b)
    assert new_tokens(run_step(s)) == {"a": 32, "b": 32}


def test_step_time_target_cuts_the_long_chunk_but_never_to_nothing():
    s = make(budget=512, threshold=256, step_ms=50, num_blocks=1100)
    # teach the cost model a machine where attention over a long context is expensive
    for ctx, n in [(0, 256), (1000, 256), (3000, 128), (0, 64), (2000, 32), (500, 1)] * 4:
        s.cost.observe([(ctx, n)], 1e-3 + 1e-4 * n + 2e-7 * n * (ctx + n / 2))
    long = make_seq(4000, "long", base=1000)
    s.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        chunks.append(new_tokens(run_step(s))["long"])
    assert chunks[0] > 256                              # alone: beyond the share, cut by time only
    assert chunks[-2] < 128                             # late: the predicted time is
    assert min(chunks[:-1]) >= BS                       # always at least a block's worth
    for c, ctx in zip(chunks, [sum(chunks[:i]) for i in range(len(chunks))]):
        if c > BS:
            assert s.cost.predict([(ctx, c)]) <= 0.05 + 1e-9


def test_streams_lend_long_prompts_a_bounded_share_of_each_step_and_the_long_one_still_finishes():
    s = make(budget=512, threshold=256, step_ms=100, num_blocks=5000, slowdown=1.2)
    streams = [make_seq(8, f"s{i}", max_tokens=2000, base=100 * i) for i in range(4)]
    for r in streams:
        s.add(r)
    for _ in range(30):                                 # the streams alone: the model learns their steps
        run_timed(s)
    long = make_seq(6000, "long", max_tokens=1, base=50000)
    s.add(long)
    steps = []                                          # (streams live, context, long chunk, step, base)
    while long.num_computed_tokens < long.num_prompt_tokens:
        ctx = long.num_computed_tokens
        out = s.schedule()
        got = new_tokens(out)
        live = [r for r in streams if not r.is_finished]
        assert all(got.get(r.request_id) == 1 for r in live)        # every stream gets its token
        rest = [(e.num_computed_tokens, e.num_new_tokens) for e in out.scheduled if e.request is not long]
        sh = [(e.num_computed_tokens, e.num_new_tokens) for e in out.scheduled]
        steps.append((bool(live), ctx, got.get("long", 0), true_cost(sh), true_cost(rest)))
        sampled = [e.request.request_id for e in out.scheduled
                   if e.num_computed_tokens + e.num_new_tokens == e.request.num_tokens]
        s.update_from_output(out, ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[[7] for _ in sampled],
                                                    logprobs=[[TokenLogprob(7, -0.5, 1)] for _ in sampled]))
        s.observe_step(out, true_cost(sh))
        assert len(steps) < 10000
    with_streams = [x for x in steps if x[0]]
    alone = [x for x in steps if not x[0]]
    assert with_streams and alone                                   # the streams ended during the prefill
    # beside the streams: small chunks, the long prompt moves at least every third step, and the
    # steps take at most ~1.2x their time without it on average (deep in the prompt one token costs
    # more than a step lends: it then runs every other step)
    assert max(x[2] for x in with_streams) < 16
    idle = 0
    for x in with_streams:
        idle = 0 if x[2] else idle + 1
        assert idle < 3
    assert sum(x[3] for x in with_streams) <= 1.25 * sum(x[4] for x in with_streams)
    assert any(x[2] == 0 for x in with_streams)
    # once the streams are gone, big chunks, reached by at most doubling a step
    assert max(x[2] for x in alone) > 32
    for a, b in itertools.pairwise(alone):
        assert b[2] <= max(2 * a[2], BS)
    assert long.is_finished and len(long.output_token_ids) == 1


def test_a_long_prompt_short_of_blocks_is_the_one_preempted():
    s = make(budget=40, threshold=16, num_blocks=12)
    d = [make_seq(4, f"d{i}", max_tokens=20, base=100 * i) for i in range(2)]    # 6 blocks each at the end
    for r in d:
        s.add(r)
    run_step(s)
    long = make_seq(30, "long", max_tokens=10, base=7000)                       # 10 blocks at the end
    s.add(long)
    for _ in range(100):
        if not s.has_work():
            break
        running = {r.request_id for r in d if r.status.value == "running"}
        got = new_tokens(run_step(s))
        assert sum(got.values()) <= 40
        assert running <= set(got)                     # a decoder gets its token in every step
    assert long.num_preemptions >= 1 and all(r.num_preemptions == 0 for r in d)
    assert all(len(r.output_token_ids) == 20 for r in d) and len(long.output_token_ids) == 10
    assert s.kv.num_free_blocks == 12


def test_an_urgent_prefill_preempts_a_decode_already_given_its_token():
    s = make(budget=64, threshold=16, num_blocks=10)
    d = [make_seq(12, f"d{i}", max_tokens=30, base=100 * i) for i in range(2)]   # 3 blocks each
    for r in d:
        s.add(r)
    run_step(s)
    urgent = make_seq(14, "u", max_tokens=2, priority=-1, base=7000)              # 4 blocks, first in order
    s.add(urgent)
    run_step(s)                                        # admitted: 10 blocks in use
    out = s.schedule()                                 # decodes first, then u's last 1 token needs none ...
    ids = [e.request.request_id for e in out.scheduled]
    assert len(ids) == len(set(ids))
    assert sum(e.num_new_tokens for e in out.scheduled) <= 64
    for e in out.scheduled:
        assert e.request.status.value == "running"


def test_cost_model_learns_a_linear_step_time():
    m = StepCostModel()
    truth = (2e-3, 5e-4, 1e-4, 3e-7)
    shapes = [[(0, 512)], [(100, 1)] * 8, [(4000, 64), (10, 1)], [(0, 32)], [(2000, 256)], [(500, 1)] * 32]
    for _ in range(30):
        for sh in shapes:
            x = m.features(sh)
            m.observe(sh, float(x @ truth))
    for sh in shapes:
        x = m.features(sh)
        assert abs(m.predict(sh) - float(x @ truth)) <= 0.05 * float(x @ truth)
    assert m.max_new_tokens([(0, 1)], 0, 1e-6, 512) == 0
    assert 0 < m.max_new_tokens([], 6000, 0.1, 512) < m.max_new_tokens([], 100, 0.1, 512) <= 512


def test_cost_model_with_free_tokens_still_bounds_a_chunk():
    """A fit that prices new tokens and attention at 0 (it happened in a long-prompt run: the engine
    failed with int(inf)) lets a chunk take its cap, not crash."""
    m = StepCostModel()
    m.coef = np.array([1e-3, 0.0, 1e-4, 0.0])
    assert m.max_new_tokens([(100, 1)] * 4, 7000, 0.05, 512) == 512
    assert m.max_new_tokens([(100, 1)] * 4, 7000, 1e-4, 512) == 0
    m.coef = np.array([1e-3, 0.0, 1e-4, 1e-30])
    assert m.max_new_tokens([], 7000, 0.05, 512) == 512


def test_cost_model_keeps_what_it_learned_about_steps_it_no_longer_sees():
    """A thousand steps of one shape (four streams and a long prompt's token at a slowly growing
    context) must not spoil what the model knew about other steps: the four decodes alone, and a big
    chunk deep in a prompt. Forgetting every direction alike let both drift (7.6 ms for 4.0, and
    309 ms for a step of 863), so a step without the streams took a chunk 3x too big."""
    m = StepCostModel()
    decodes = [(200, 1)] * 4
    big = [(6000, 256)]
    shapes = [decodes, [(0, 128)] + decodes, [(0, 512)], [(3000, 256)], [(1000, 64)] + decodes]
    for _ in range(20):
        for sh in shapes:
            m.observe(sh, true_cost(sh))
    for i in range(1000):
        sh = decodes + [(3000 + 4 * i, 1)]
        m.observe(sh, true_cost(sh))
    for sh in (decodes, big):
        assert abs(m.predict(sh) - true_cost(sh)) <= 0.1 * true_cost(sh)
    assert (m.coef >= 0).all()


def test_real_engine_short_request_overtakes_a_long_prefill_with_the_same_answer():
    """The default model: a 1,500-token prompt prefills in capped chunks; a short chat request added
    after its first step is scheduled in the very next step, finishes first, and answers exactly as
    it does alone (batch invariance); the long request finishes too."""
    from kvserve import LLM, SamplingParams
    from kvserve.model.loader import load_model
    from kvserve.train.data import load_corpus

    lm = load_model(None)
    llm = LLM(lm.model, tokenizer=lm.tokenizer, kv_cache_memory="256MiB")
    eng = llm.engine
    long_ids = lm.tokenizer.encode(load_corpus(max_chars=20_000))[:1500]
    short = [{"role": "user", "content": "Name the capital city of France."}]
    short_ids = lm.tokenizer.apply_chat_template(short, add_generation_prompt=True, tokenize=True)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    alone = llm.generate([{"prompt_token_ids": short_ids}], greedy)[0].outputs[0].token_ids

    core = eng.core
    seen = []                                         # every step's SchedulerOutput, as the core ran it
    schedule = core.scheduler.schedule
    core.scheduler.schedule = lambda: seen.append(schedule()) or seen[-1]
    eng.add_request("long", {"prompt_token_ids": long_ids}, SamplingParams(max_tokens=8, temperature=0))
    eng.step()
    assert core.scheduler.requests["long"].num_computed_tokens == 512       # alone: the whole budget
    eng.add_request("short", {"prompt_token_ids": short_ids}, greedy)
    eng.step()
    got = {s.request.request_id: s.num_new_tokens for s in seen[-1].scheduled}
    assert set(got) == {"short", "long"} and got["long"] == 256     # its share, beside the short one
    finished = {}
    for _ in range(200):
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
        if len(finished) == 2:
            break
    assert list(finished) == ["short", "long"]        # the short one first
    assert finished["short"].outputs[0].token_ids == alone


def test_max_decode_slowdown_is_checked_at_startup():
    import pytest

    from kvserve.engine.config import EngineConfig
    from kvserve.errors import InvalidRequest

    for bad in (0.5, -1, True, "2", float("nan"), 1e9):
        with pytest.raises(InvalidRequest, match="max_decode_slowdown"):
            EngineConfig(max_decode_slowdown=bad)
    assert EngineConfig(max_decode_slowdown=0).max_decode_slowdown == 0
    assert EngineConfig().max_decode_slowdown == 1.6


def test_cost_model_folds_steps_in_batches_with_the_same_arithmetic():
    """observe queues steps and folds them _BATCH at a time (numpy right after a forward is slow),
    in order: the fit is then exactly the one step-by-step folding gives."""
    from kvserve.engine.step_cost import _BATCH, _PRIOR

    a, b = StepCostModel(), StepCostModel()
    shapes = [[(100 + i, 1)] * (1 + i % 3) + ([(0, 64)] if i % 4 == 0 else []) for i in range(2 * _BATCH)]
    for sh in shapes[:_BATCH - 1]:
        a.observe(sh, true_cost(sh))
    assert a.num_observed == 0 and (a.coef == _PRIOR).all()        # queued, not yet learnt
    for sh in shapes[_BATCH - 1:]:
        a.observe(sh, true_cost(sh))
    assert a.num_observed == 2 * _BATCH
    for sh in shapes:
        b._fold(b.features(sh), true_cost(sh))
    assert (a.coef == b.coef).all() and not (a.coef == _PRIOR).all()
    a.observe(shapes[0], 0.0)                   # not a step time: ignored
    a.observe(shapes[0], true_cost(shapes[0]))
    a.flush()
    assert a.num_observed == 2 * _BATCH + 1


def test_decode_step_price_in_floats_is_the_fit():
    """decode_step_seconds (the speculative decoder's price of a step of decodes, in plain floats)
    is predict() for one new token per row, before and after the fit learns and when set."""
    m = StepCostModel()
    contexts = [5, 300, 4000]
    for _ in range(2):
        assert math.isclose(m.decode_step_seconds(contexts), m.predict([(c, 1) for c in contexts]), rel_tol=1e-12)
        for i in range(16):
            sh = [(200 + 10 * i, 1)] * (1 + i % 4)
            m.observe(sh, 2 * true_cost(sh))
        m.flush()
    m.coef = np.array([1e-3, 2e-4, 1e-4, 1e-6])
    assert math.isclose(m.decode_step_seconds([100, 100]), 1e-3 + 2 * 3e-4 + 1e-6 * 201, rel_tol=1e-12)
