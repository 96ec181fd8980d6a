"""Scheduler on synthetic sequences (no model): token budget, chunked prefill mixed with
decodes, max_num_seqs, priority/FCFS admission, prefix-cache hits at admission, preemption
by recompute, and finish/abort freeing blocks."""

from __future__ import annotations

import itertools

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Sequence, Status
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.sampling_params import SamplingParams

BS = 4
_arrival = itertools.count()


def make_seq(n_prompt: int, rid: str, max_tokens: int = 4, priority: int = 0, base: int = 0) -> Sequence:
    return Sequence(rid, 0, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens),
                    next(_arrival), priority=priority)


def make_sched(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS), max_num_seqs, budget, max_model_len=num_blocks * BS)


def run_step(s: Scheduler) -> SchedulerOutput:
    """One engine step without a model: advance computed tokens, 'sample' token 7 for every
    sequence that caught up, finish those that reached max_tokens."""
    out = s.schedule()
    for seq, n in zip(out.seqs, out.num_new_tokens):
        seq.num_computed_tokens += n
        s.kv.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                s.finish(seq)
    return out


def new_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {seq.request_id: n for seq, n in zip(out.seqs, out.num_new_tokens)}


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
    assert chunks == [12, 12, 12, 4]
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
        for q in run_step(s).seqs:
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
            assert victim.num_computed_tokens == 0 and victim.block_table == []
            preempted_seen = True
        assert steps < 200
    assert preempted_seen and s.num_preemptions > 0
    assert all(q.is_finished and len(q.output_token_ids) == 8 for q in seqs)
    # The victim is always the last in (priority, arrival) order: r0 is never preempted.
    assert seqs[0].metrics.num_preemptions == 0
    assert s.kv.num_free_blocks == 6


def test_finish_frees_a_waiting_or_running_sequence():
    s = make_sched(num_blocks=8, max_num_seqs=1, budget=64)
    a, b = make_seq(9, "a"), make_seq(9, "b", base=50)
    s.add(a)
    s.add(b)
    run_step(s)
    assert a.status == Status.RUNNING and b.status == Status.WAITING and s.kv.num_used_blocks == 3
    s.finish(b)
    s.finish(a)
    assert not s.has_work() and s.kv.num_free_blocks == 8
    assert a.is_finished and b.is_finished


def test_sibling_waits_for_the_prompt_then_hits_the_cache():
    s = make_sched(budget=8)
    parent = make_seq(20, "r", max_tokens=5)
    sib = Sequence("r", 1, parent.prompt_token_ids, parent.params, parent.arrival_seq, wait_for=parent)
    s.add(parent)
    s.add(sib)
    out = run_step(s)
    assert out.seqs == [parent]                           # the sibling waits for the prompt
    while parent.num_computed_tokens < parent.num_prompt_tokens:
        assert sib not in run_step(s).seqs
    out = run_step(s)
    assert out.seqs == [parent, sib]
    assert sib.num_cached_tokens == 16                      # 4 full blocks of the 20-token prompt
    assert out.num_new_tokens == [1, 4]                     # parent decodes, sibling computes the rest
    assert sib.block_table[:4] == parent.block_table[:4]
