"""Scheduler: which requests run in the next step, with how many new tokens each, and what the
step's results do to them.

There is no "prefill phase" and no "decode phase". Every request has `num_computed_tokens`
catching up with `num_tokens` (prompt + generated). Each step hands out a token budget
(`max_num_batched_tokens`): running requests first (a decoding one needs 1 token, a prefilling
one takes what is left, so long prompts are prefilled in chunks that share steps with other
requests' decodes), then waiting ones in (priority, arrival) order, whose prompt may be partly
found in the prefix cache. When the block pool runs dry, the running request that comes last in
that order is preempted: its blocks are freed and it goes back to waiting to be recomputed later
(its computed blocks are usually still in the prefix cache).

The scheduler is the only writer of request state: `update_from_output` advances the computed
counts, appends sampled tokens, applies the token-level stops (EOS, stop tokens, length, the
repetition guard), advances each request's grammar matcher with its accepted tokens (a complete
grammar ends the request with "stop") and frees finished requests. A request with a grammar
waits in the queue until its grammar is compiled (kvserve.structured.backend), without holding
up anyone behind it; each step the rows that sample under a grammar get a `grammar_bitmask_slot`.
Stop strings are the client's (only text knows
where they begin): the client aborts a request whose text hit one.
"""

from __future__ import annotations

import time

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.messages import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprob,
)
from kvserve.engine.request import Request, Status
from kvserve.engine.stop import check_stop


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_token_ids: list[int] | tuple[int, ...] = ()):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.failed: list[EngineCoreOutput] = []    # requests ended outside a step's results
        self.decode = None                            # token ids -> text (thinking requests)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        self.running.sort(key=lambda r: r.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()            # last in priority/arrival order
                self._preempt(victim)
                preempted = True
                out.num_preempted += 1
                if victim is req:
                    break
            else:
                out.scheduled.append(self._entry(req, n, out))
                budget -= n
                i += 1
        if not preempted:
            self._admit_waiting(out, budget)
        return out

    def _entry(self, req: Request, n: int, out: SchedulerOutput) -> ScheduledRequest:
        entry = ScheduledRequest(req, req.num_computed_tokens, n, self.kv.block_ids(req.request_id))
        if req.grammar_active and req.num_computed_tokens + n == req.num_tokens:
            entry.grammar_bitmask_slot = out.num_grammar_rows
            out.num_grammar_rows += 1
        return entry

    def _grammar_ready(self, req: Request) -> bool:
        """False while the request's grammar compiles; its matcher is made once it has."""
        fut = req.grammar_future
        if fut is None or req.grammar is not None:
            return True
        if not fut.done():
            return False
        try:
            from kvserve.structured.backend import GrammarBackend
            req.grammar = GrammarBackend.new_matcher(fut)
        except Exception as e:  # noqa: BLE001 - reported to the request's caller
            self.finish(req, "error")
            o = self.make_output(req, [])
            o.finish_reason, o.error = "error", str(e)
            self.failed.append(o)
            return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self.waiting.sort(key=lambda r: r.sort_key)
        admitted = []
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) + len(admitted) >= self.max_num_seqs:
                break
            if req.wait_for is not None:
                parent = self.requests.get(req.wait_for)
                if parent is not None and parent.num_computed_tokens < parent.num_prompt_tokens:
                    continue
                req.wait_for = None
            if not self._grammar_ready(req):
                continue
            computed = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
            n = min(req.num_tokens - req.num_computed_tokens - len(computed) * self.kv.block_size, budget)
            if not self.kv.allocate_slots(req, n, computed):
                break                                   # strict order: no overtaking when full
            req.num_computed_tokens += len(computed) * self.kv.block_size
            if req.num_cached_tokens < 0:               # first admission: count the cache lookup
                req.num_cached_tokens = len(computed) * self.kv.block_size
                self.kv.record_query(req.num_prompt_tokens, req.num_cached_tokens)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = Status.RUNNING
            admitted.append(req)
            out.scheduled.append(self._entry(req, n, out))
            budget -= n
        for req in admitted:
            self.waiting.remove(req)
            self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id, forget_hashes=False)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)

    # ---- results ----------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance every scheduled request by its computed tokens, then append what was sampled."""
        outputs: dict[str, EngineCoreOutput] = {}
        for o in self.failed:
            outputs[o.request_id] = o
        self.failed = []
        for s in sched.scheduled:
            req = s.request
            if req.is_finished:
                continue
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.prompt_tokens_total += min(s.num_new_tokens, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += s.num_new_tokens
            req.num_kv_blocks = max(req.num_kv_blocks, len(self.kv.block_ids(req.request_id)))
            self.kv.cache_full_blocks(req)
        for rid, (start, entries) in result.prompt_logprobs.items():
            outputs[rid] = self.make_output(self.requests[rid], [], prompt_logprobs=(start, entries))
        for row, rid in enumerate(result.req_ids):
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            new_ids: list[int] = []
            lps = list(result.logprobs[row]) if result.logprobs else None
            for j, tok in enumerate(result.sampled_token_ids[row]):
                forced = self._append(req, tok, new_ids, lps[j] if lps else None)
                if req.finish_reason is None and forced:
                    for f in forced:    # the end of a reasoning block whose budget is spent
                        self._append(req, f, new_ids, TokenLogprob(f, 0.0, 1) if lps is not None else None,
                                     forced=True)
                        if req.finish_reason is not None:
                            break
                if req.finish_reason is not None:
                    break
            o = outputs.get(rid)
            lps = req.step_logprobs if req.params.logprobs is not None else None
            if o is None:
                outputs[rid] = self.make_output(req, new_ids, lps)
            else:
                o.new_token_ids, o.new_logprobs, o.cumulative_logprob = new_ids, lps, req.cumulative_logprob
            if req.finish_reason is not None:
                self.finish(req, req.finish_reason, req.stop_reason)
                outputs[rid].finish_reason, outputs[rid].stop_reason = req.finish_reason, req.stop_reason
        return list(outputs.values())

    def _append(self, req: Request, tok: int, new_ids: list[int], lp, forced: bool = False) -> list[int]:
        """Append one token (sampled, or forced to close a reasoning block): stops, reasoning,
        grammar. Returns the tokens to force next (a spent reasoning budget)."""
        if not new_ids:
            req.step_logprobs = []
        req.output_token_ids.append(tok)
        new_ids.append(tok)
        if lp is not None:
            req.step_logprobs.append(lp)
            req.cumulative_logprob += lp.logprob
        self.generation_tokens_total += 1
        stop = check_stop(req.params, req.output_token_ids, self.eos_token_ids, req.max_tokens)
        to_force: list[int] = []
        rs = req.reasoning
        if rs is not None and not rs.done and not forced:
            to_force = rs.feed(tok, self.decode)
        elif req.grammar is not None and stop is None and not forced:
            stop = self._advance_grammar(req, tok)
        if stop is not None:
            req.finish_reason, req.stop_reason = stop
        return to_force

    @staticmethod
    def _advance_grammar(req: Request, tok: int) -> tuple[str, int | str | None] | None:
        """Feed an accepted token to the request's matcher: ("stop", None) once the grammar is
        complete (only EOS could follow); a token it refuses (the mask allowed it, so only a bug)
        ends the request with an error rather than an invalid output."""
        m = req.grammar
        if not m.consume_token(tok):
            return ("error", f"grammar refused token {tok}: {m.get_error()}")
        return ("stop", None) if m.is_stopped() else None

    def make_output(self, req: Request, new_ids: list[int], logprobs=None, prompt_logprobs=None) -> EngineCoreOutput:
        o = EngineCoreOutput(req.request_id, new_ids, req.cumulative_logprob, logprobs,
                             num_cached_tokens=max(req.num_cached_tokens, 0), num_kv_blocks=req.num_kv_blocks,
                             num_preemptions=req.num_preemptions, first_scheduled_time=req.first_scheduled_time)
        if prompt_logprobs is not None:
            o.prompt_logprobs_start, o.new_prompt_logprobs = prompt_logprobs
        return o

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Remove a request wherever it is and free its blocks (finish or abort)."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        req.status = Status.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.requests.pop(req.request_id, None)
