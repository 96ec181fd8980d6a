"""Scheduler: which requests run in the next step, with how many new tokens each, and what the
step's results do to them.

There is no "prefill phase" and no "decode phase". Every request has `num_computed_tokens`
catching up with `num_tokens` (prompt + generated). Each step hands out a token budget
(`max_num_batched_tokens`) in an order that bounds everyone's latency:

1. running decodes (a request whose prompt is computed needs one token), in (priority, arrival)
   order: a stream gets a token in every step, whatever else is going on;
2. short prompts (at most `long_prefill_token_threshold` tokens to compute), running or waiting, in
   order: a new short request starts in the next step even while a long prompt is prefilling;
3. long prompts in chunks of at most `long_prefill_token_threshold` tokens (the whole budget when
   one is alone in the engine), at most `max_num_partial_prefills` of them at a time (the others wait, in order, and nothing else
   overtakes them), each chunk also cut so that the step's predicted time stays under a limit
   (engine/step_cost.py learns the cost of a token at a given context length from the steps
   already run). While decodes run, the streams' inter-token latency is what bounds the chunks:
   each step with decodes lends the long prompts `max_decode_slowdown - 1` times its decodes'
   predicted time (a new short prompt in the step earns nothing: its first token does not wait for
   a long chunk), and each step pays back what it really took beyond its prediction without the
   long chunks, so steps with streams average at most `max_decode_slowdown` times their time. A long prompt deep in its context
   then prefills a few tokens a step, or one token every second or third step when one token costs
   more than a step lends (the loan grows until it fits, so the prompt always advances). A step
   without decodes may take `max_step_ms`, or twice its time without the long chunks where that is
   more (four times for a prompt alone in the engine, so a fixed cost per step as large as a loaded
   machine's is at most a quarter of its steps; a new request waits at most about one such step),
   and the first long prompt in line then gets at least a block. A long prompt's chunk at most
   doubles from one step to the next (or is one block), so a prediction far outside the sizes just
   measured cannot make a huge step.

Waiting requests may find part of their prompt in the prefix cache. When the block pool runs dry,
the running request that comes last in (priority, arrival) order is preempted: its blocks are
freed and it goes back to waiting to be recomputed later (its computed blocks are usually still in
the prefix cache). Admission keeps strict order when the pool is short: no overtaking then.

The scheduler is the only writer of request state: `update_from_output` advances the computed
counts, appends sampled tokens, applies the token-level stops (EOS, stop tokens, length, the
repetition guard), advances each request's grammar matcher with its accepted tokens (a complete
grammar ends the request with "stop") and frees finished requests. A request with a grammar
waits in the queue until its grammar is compiled (kvserve.structured.backend), without holding
up anyone behind it; each step the rows that sample under a grammar get a `grammar_bitmask_slot`.
Stop strings are the client's (only text knows where they begin): the client aborts a request
whose text hit one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvserve.engine import own_draft
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.long_prefill import LongPrefillPacer, StepBudget
from kvserve.engine.messages import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprob,
)
from kvserve.engine.request import Request, Status
from kvserve.engine.spec_decode.decoder import SpecDecoder
from kvserve.engine.step_cost import StepCostModel
from kvserve.engine.stop import check_stop
from kvserve.structured.backend import GrammarBackend


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_token_ids: list[int] | tuple[int, ...] = (), long_prefill_token_threshold: int | None = None,
                 max_num_partial_prefills: int = 2, max_step_ms: float | None = None,
                 max_decode_slowdown: float = 0.0, *, decode: Callable[[list[int]], str] | None = None,
                 spec: SpecDecoder | None = None):
        """decode: token ids -> text (a thinking request's end of <think> is read as text);
        spec: the speculative decoder (None: no request speculates)."""
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # default: a long prompt takes at most half of a step's tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold or max(1, max_num_batched_tokens // 2)
        self.max_num_partial_prefills = max_num_partial_prefills
        self.max_step_s = max_step_ms / 1000 if max_step_ms else None
        self.max_decode_slowdown = max_decode_slowdown
        self.cost = StepCostModel()
        self.pacer = LongPrefillPacer(self.cost, kv.block_size, self.long_prefill_token_threshold, self.max_step_s,
                                      max_decode_slowdown)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.failed: list[EngineCoreOutput] = []    # requests ended outside a step's results
        self.decode = decode
        self.spec = spec

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = StepBudget(self.max_num_batched_tokens)
        self.running.sort(key=lambda r: r.sort_key)
        self.waiting.sort(key=lambda r: r.sort_key)
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        decodes = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        drafts = own_draft.propose(self.spec, decodes, self.cost)
        for i, req in enumerate(decodes):
            self._schedule_running(out, budget, req, req.num_tokens - req.num_computed_tokens,
                                   drafts[i] if drafts else ())
        for req in prefilling:                                     # short prompts already running
            if req.status == Status.RUNNING and not self._is_long(req):
                self._schedule_running(out, budget, req, req.num_tokens - req.num_computed_tokens)
        if not budget.preempted:
            self._admit_waiting(out, budget, long=False)
        # Long prompts' chunks: the time the streams lend them, else the target or 2x (alone: 4x)
        self.pacer.open_step(budget, out.scheduled, decodes, self._alone(out))
        first_long, wanted = True, False
        for req in prefilling:                                     # long prompts already running
            if req.status == Status.RUNNING and self._is_long(req):
                n = self._long_chunk(out, budget, req, first_long, req.num_computed_tokens)
                first_long, wanted = False, True
                if n:
                    self._schedule_running(out, budget, req, n)
        if not (budget.preempted or budget.pool_short):
            wanted |= self._admit_waiting(out, budget, long=True)
        self.pacer.close_step(budget, wanted)
        return out

    def _is_long(self, req: Request) -> bool:
        """More prompt tokens to compute than the threshold when admitted (long until its prompt is done)."""
        return req.num_prompt_tokens - max(req.num_cached_tokens, 0) > self.long_prefill_token_threshold

    def _alone(self, out: SchedulerOutput) -> bool:
        """Nothing else scheduled this step and nothing else in the engine."""
        return not out.scheduled and len(self.running) + len(self.waiting) == 1

    def _long_chunk(self, out: SchedulerOutput, budget: StepBudget, req: Request, first: bool, start: int) -> int:
        return self.pacer.chunk(budget, out.scheduled, req, first, start, self._alone(out))

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget, req: Request, n: int,
                          drafts: Sequence[int] = ()) -> None:
        """n tokens of req (plus its draft tokens, speculative decoding, as far as the budget goes;
        the request's own draft_token_ids take the proposer's place: own_draft.py)."""
        n = min(n, budget.tokens)
        if n <= 0 or req.status != Status.RUNNING:     # (preempted earlier in this step)
            return
        drafts, supplied = own_draft.place(req, req.num_computed_tokens, n, drafts, budget.tokens - n)
        while not self.kv.allocate_slots(req, n + len(drafts)):
            if drafts:                                  # drafts never preempt anyone
                drafts = []
                continue
            victim = self.running[-1]                   # last in priority/arrival order
            self._preempt(victim, out, budget)
            if victim is req:
                return
        entry = self._entry(req, n + len(drafts), out, drafts)
        entry.supplied_draft = supplied and bool(drafts)
        out.scheduled.append(entry)
        budget.tokens -= n + len(drafts)

    def _entry(self, req: Request, n: int, out: SchedulerOutput, drafts: list[int] | None = None) -> ScheduledRequest:
        entry = ScheduledRequest(req, req.num_computed_tokens, n, self.kv.block_ids(req.request_id), drafts or [],
                                 local_block_ids=self.kv.local_block_ids(req.request_id))
        if req.grammar_active and not entry.spec_token_ids and req.num_computed_tokens + n == req.num_tokens:
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
            req.grammar = GrammarBackend.new_matcher(fut)
        except Exception as e:  # noqa: BLE001 - reported to the request's caller
            self.finish(req, "error")
            o = self.make_output(req, [])
            o.finish_reason, o.error = "error", str(e)
            self.failed.append(o)
            return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: StepBudget, long: bool) -> bool:
        """Admit waiting requests in order: the short prompts (long=False), then the long ones.
        True if a long prompt was offered a chunk (admitted or not)."""
        wanted = False
        threshold = self.long_prefill_token_threshold
        partial = sum(1 for r in self.running if r.num_computed_tokens < r.num_prompt_tokens and self._is_long(r))
        first_long = not any(self._is_long(s.request) and s.num_computed_tokens < s.request.num_prompt_tokens
                             for s in out.scheduled)
        admitted = []
        for req in list(self.waiting):                 # (a grammar that failed to compile leaves it)
            if budget.tokens <= 0 or len(self.running) + len(admitted) >= self.max_num_seqs:
                break
            if req.wait_for is not None:
                parent = self.requests.get(req.wait_for)
                if parent is not None and parent.num_computed_tokens < parent.num_prompt_tokens:
                    continue
                req.wait_for = None
            if not self._grammar_ready(req):
                continue
            computed = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
            if getattr(computed, "loading", False):
                continue                                # its prefix is landing from disk (kv_offload.py)
            cached = len(computed) * self.kv.block_size
            left = req.num_tokens - req.num_computed_tokens - cached
            if (left > threshold) != long:
                continue                                # the other pass's
            if long:
                if partial >= self.max_num_partial_prefills:
                    break                               # it waits, and no long one behind it overtakes
                n = self._long_chunk(out, budget, req, first_long, req.num_computed_tokens + cached)
                wanted = True
                if n <= 0:
                    break
            else:
                n = min(left, budget.tokens)
            drafts, _ = own_draft.place(req, req.num_computed_tokens + cached, n, (), budget.tokens - n)
            if drafts and not self.kv.allocate_slots(req, n + len(drafts), computed):
                drafts = []                             # drafts never take the pool's last blocks
            if not drafts and not self.kv.allocate_slots(req, n, computed):
                budget.pool_short = True
                break                                   # strict order: no overtaking when full
            req.num_computed_tokens += cached
            if req.num_cached_tokens < 0:               # first admission: count the cache lookup
                req.num_cached_tokens = cached
                self.kv.record_query(req.num_prompt_tokens, req.num_cached_tokens)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.status = Status.RUNNING
            admitted.append(req)
            entry = self._entry(req, n + len(drafts), out, drafts)
            entry.supplied_draft = bool(drafts)
            out.scheduled.append(entry)
            budget.tokens -= n + len(drafts)
            if long:
                partial += 1
                first_long = False
        for req in admitted:
            self.waiting.remove(req)
            self.running.append(req)
        return wanted

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The step `out` took `seconds` in the model: teach the step-time model (and pay back the
        streams' loan to long prompts: the time beyond the step's predicted time without them)."""
        self.cost.observe([(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled], seconds)
        self.pacer.observe(seconds)

    def _preempt(self, req: Request, out: SchedulerOutput, budget: StepBudget) -> None:
        self.running.remove(req)
        budget.preempted = True
        out.num_preempted += 1
        for i, s in enumerate(out.scheduled):         # already given tokens this step: take them back
            if s.request is req:
                budget.tokens += s.num_new_tokens
                del out.scheduled[i]
                break
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
            req.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)   # drafts: once verified
            req.num_kv_blocks = max(req.num_kv_blocks, self.kv.num_held_blocks(req.request_id))
            if not s.spec_token_ids:
                self.kv.cache_full_blocks(req)
        spec_rows = {s.request.request_id: (len(s.spec_token_ids), s.supplied_draft)
                     for s in sched.scheduled if s.spec_token_ids}
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
                o = outputs[rid] = self.make_output(req, new_ids, lps)
            else:
                o.new_token_ids, o.new_logprobs, o.cumulative_logprob = new_ids, lps, req.cumulative_logprob
            drafts, supplied = spec_rows.get(rid, (0, False))
            if drafts:
                accepted = len(result.sampled_token_ids[row]) - 1
                o.num_drafted = min(accepted, len(new_ids))
                o.draft_source = "supplied" if supplied else self.spec.draft_source(rid) if self.spec else ""
                if not supplied and self.spec is not None:   # a supplied draft says nothing of the proposer
                    self.spec.observe(rid, drafts, accepted)
                # (also when it finished: a prompt whose last chunk carried drafts is hashed here)
                self._settle_drafts(req, o.num_drafted)
            if req.finish_reason is not None:
                self.finish(req, req.finish_reason, req.stop_reason)
                outputs[rid].finish_reason, outputs[rid].stop_reason = req.finish_reason, req.stop_reason
        return list(outputs.values())

    def _settle_drafts(self, req: Request, accepted: int) -> None:
        """After verification: the accepted drafts' KV is now the request's (their tokens were
        appended); the rejected ones' slots are overwritten by the next step and the blocks wholly
        past the sequence go back to the pool. Only now are the newly full blocks hashed."""
        req.num_computed_tokens += accepted
        self.kv.trim(req, req.num_tokens)
        self.kv.cache_full_blocks(req)

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
        if self.spec is not None:
            self.spec.forget(req.request_id, req)
        req.status = Status.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.requests.pop(req.request_id, None)
        self.pacer.forget(req.request_id)
