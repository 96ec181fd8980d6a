"""Scheduler: which sequences run in the next step, and with how many new tokens each.

There is no "prefill phase" and no "decode phase". Every sequence has `num_computed_tokens`
catching up with `num_tokens` (prompt + generated). Each step hands out a token budget
(`max_num_batched_tokens`): running sequences first (a decoding one needs 1 token, a
prefilling one takes what is left, so long prompts are prefilled in chunks that share steps
with other sequences' decodes), then waiting ones in (priority, arrival) order, whose prompt
may be partly found in the prefix cache. When the block pool runs dry, the running sequence
that comes last in that order is preempted: its blocks are freed and it goes back to waiting
to be recomputed later (its computed blocks are usually still in the prefix cache).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Sequence, Status


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        self.running.sort(key=lambda s: s.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, n):
                victim = self.running.pop()            # last in priority/arrival order
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
        if not preempted:
            self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self.waiting.sort(key=lambda s: s.sort_key)
        admitted = []
        for seq in self.waiting:
            if budget <= 0 or len(self.running) + len(admitted) >= self.max_num_seqs:
                break
            if seq.wait_for is not None:
                parent = seq.wait_for
                if parent.status != Status.FINISHED and parent.num_computed_tokens < parent.num_prompt_tokens:
                    continue
                seq.wait_for = None
            computed = self.kv.get_computed_blocks(seq) if seq.num_computed_tokens == 0 else []
            n = min(seq.num_tokens - seq.num_computed_tokens - len(computed) * self.kv.block_size, budget)
            if not self.kv.allocate_slots(seq, n, computed):
                break                                   # strict order: no overtaking when full
            if seq.num_cached_tokens < 0:               # first admission: count the cache lookup
                seq.num_cached_tokens = len(computed) * self.kv.block_size
                self.kv.record_query(seq.num_prompt_tokens, seq.num_cached_tokens)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.monotonic()
            seq.status = Status.RUNNING
            admitted.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        for seq in admitted:
            self.waiting.remove(seq)
            self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = Status.FINISHED
