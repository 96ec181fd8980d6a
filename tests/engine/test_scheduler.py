"""Scheduler on synthetic requests (no model): token budget, chunked prefill mixed with
decodes, max_num_seqs, priority/FCFS admission, prefix-cache hits at admission, preemption
by recompute, and finish/abort freeing blocks."""

from __future__ import annotations

import itertools

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from kvserve.engine.request import Request, Status
from kvserve.engine.scheduler import Scheduler
from kvserve.sampling_params import SamplingParams

BS = 4
_arrival = itertools.count()


def make_seq(n_prompt: int, rid: str, max_tokens: int = 4, priority: int = 0, base: int = 0,
             wait_for: str | None = None) -> Request:
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens),
                   next(_arrival), priority=priority, wait_for=wait_for, max_tokens=max_tokens)


def make_sched(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs, budget, max_model_len=num_blocks * BS)


def run_step(s: Scheduler) -> SchedulerOutput:
    """One engine step with a stand-in for the model runner: every request that catches up with
    its tokens 'samples' token 7; the scheduler applies the result (and the max_tokens stop)."""
    out = s.schedule()
    sampled = [e.request.request_id for e in out.scheduled
               if e.num_computed_tokens + e.num_new_tokens == e.request.num_tokens]
    s.update_from_output(out, ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[[7] for _ in sampled],
                                                logprobs=[[TokenLogprob(7, -0.5, 1)] for _ in sampled]))
    return out


def new_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {e.request.request_id: e.num_new_tokens for e in out.scheduled}


def scheduled(out: SchedulerOutput) -> list[Request]:
    return [e.request for e in out.scheduled]


def test_long_prompt_is_chunked_and_decodes_keep_going():
    s = make_sched(budget=16)
    decoders = [make_seq(3, f"d{i}", max_tokens=50, base=100 * i) for i in range(4)]
    for d in decoders:
        s.add(d)
    assert new_tokens(run_step(s)) == {f"d{i}": 3 for i in range(4)}     # 12 of 16 tokens
    long = make_seq(40, "long", base=5000)
    s.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = new_tokens(run_step(s))
        assert all(out[f"d{i}"] == 1 for i in range(4))                 # every decoder, every step
        assert sum(out.values()) <= 16
        chunks.append(out["long"])
    assert chunks == [8, 8, 8, 8, 8]                                   # at most half the budget each
    assert len(long.output_token_ids) == 1


def test_budget_and_max_num_seqs_cap_admission():
    s = make_sched(max_num_seqs=3, budget=10)
    seqs = [make_seq(4, f"r{i}", base=100 * i) for i in range(5)]
    for q in seqs:
        s.add(q)
    out = new_tokens(run_step(s))
    assert out == {"r0": 4, "r1": 4, "r2": 2}                   # budget ran out in r2's prompt
    assert len(s.running) == 3 and len(s.waiting) == 2
    out = new_tokens(run_step(s))
    assert out == {"r0": 1, "r1": 1, "r2": 2}                   # max_num_seqs keeps r3, r4 out


def test_priority_then_arrival_order():
    s = make_sched(max_num_seqs=1, budget=64)
    late_urgent = make_seq(4, "b", priority=-1)
    first = make_seq(4, "a")
    s.add(first)
    s.add(late_urgent)
    s.add(make_seq(4, "c"))
    order = []
    while s.has_work():
        for q in scheduled(run_step(s)):
            if q.request_id not in order:
                order.append(q.request_id)
    assert order == ["b", "a", "c"]


def test_prefix_hit_at_admission_is_counted_and_skipped():
    s = make_sched(budget=64)
    a = make_seq(20, "a", max_tokens=1)
    s.add(a)
    run_step(s)
    assert a.is_finished and a.num_cached_tokens == 0
    b = make_seq(22, "b", max_tokens=1)                  # same first 20 tokens (base 0)
    s.add(b)
    out = new_tokens(run_step(s))
    assert b.num_cached_tokens == 20 and out == {"b": 2}
    assert s.kv.prefix_cache_queries == 42 and s.kv.prefix_cache_hits == 20


def test_preemption_by_recompute_when_blocks_run_out():
    # 6 blocks of 4 tokens; three requests of 6-token prompts that each grow to 14 tokens.
    s = make_sched(num_blocks=6, budget=64)
    seqs = [make_seq(6, f"r{i}", max_tokens=8, base=100 * i) for i in range(3)]
    for q in seqs:
        s.add(q)
    steps = 0
    preempted_seen = False
    while s.has_work():
        run_step(s)
        steps += 1
        assert s.kv.num_used_blocks <= 6
        if any(q.status == Status.WAITING and q.output_token_ids for q in seqs):
            victim = next(q for q in seqs if q.status == Status.WAITING and q.output_token_ids)
            assert victim.num_computed_tokens == 0 and s.kv.block_ids(victim.request_id) == []
            preempted_seen = True
        assert steps < 200
    assert preempted_seen and s.num_preemptions > 0
    assert all(q.is_finished and len(q.output_token_ids) == 8 for q in seqs)
    # The victim is always the last in (priority, arrival) order: r0 is never preempted.
    assert seqs[0].num_preemptions == 0
    assert s.kv.num_free_blocks == 6


def test_finish_frees_a_waiting_or_running_sequence():
    s = make_sched(num_blocks=8, max_num_seqs=1, budget=64)
    a, b = make_seq(9, "a"), make_seq(9, "b", base=50)
    s.add(a)
    s.add(b)
    run_step(s)
    assert a.status == Status.RUNNING and b.status == Status.WAITING and s.kv.num_used_blocks == 3
    s.finish(b, "abort")
    s.finish(a, "abort")
    assert not s.has_work() and s.kv.num_free_blocks == 8
    assert a.is_finished and b.is_finished


def test_sibling_waits_for_the_prompt_then_hits_the_cache():
    s = make_sched(budget=8)
    parent = make_seq(20, "r#0", max_tokens=5)
    sib = make_seq(20, "r#1", max_tokens=5, wait_for="r#0")
    s.add(parent)
    s.add(sib)
    out = run_step(s)
    assert scheduled(out) == [parent]                      # the sibling waits for the prompt
    while parent.num_computed_tokens < parent.num_prompt_tokens:
        assert sib not in scheduled(run_step(s))
    out = run_step(s)
    assert scheduled(out) == [parent, sib]
    assert sib.num_cached_tokens == 16                      # 4 full blocks of the 20-token prompt
    assert [e.num_new_tokens for e in out.scheduled] == [1, 4]   # parent decodes, sibling computes the rest
    assert s.kv.block_ids("r#1")[:4] == s.kv.block_ids("r#0")[:4]


def test_update_from_output_stops_and_reports():
    s = make_sched(budget=64)
    r = make_seq(5, "x", max_tokens=3)
    s.add(r)
    outs = []
    while s.has_work():
        out = s.schedule()
        res = ModelRunnerOutput(req_ids=["x"], sampled_token_ids=[[9]], logprobs=[[TokenLogprob(9, -1.0, 2)]])
        outs += s.update_from_output(out, res)
    assert [o.new_token_ids for o in outs] == [[9], [9], [9]]
    assert outs[-1].finish_reason == "length" and outs[-1].cumulative_logprob == -3.0
    assert outs[0].new_logprobs is None                     # not asked for: only the cumulative sum
    assert r.is_finished and s.kv.num_free_blocks == 64 and "x" not in s.requests
