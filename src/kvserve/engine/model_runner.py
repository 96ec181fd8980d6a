"""ModelRunner: owns the model and the KV cache tensors; turns a SchedulerOutput into one
forward pass over the flattened batch, then samples for the requests that caught up.

Packing, for requests A (prefill chunk of 3 from position 0) and B (decode at position 7):
    input_ids  = [a0 a1 a2 | b7]        positions = [0 1 2 | 7]
    query_start_loc = [0, 3, 4]         seq_lens = [3, 8]
    slot_mapping = slot of each new token through its block table
Only the rows whose logits are needed (the last token of each request that will sample, and
every prompt position of a request that asked for prompt_logprobs) go through the lm_head.

The runner's part of a step is timed on the core's PhaseClock: `prepare` (packing the batch and
the attention metadata), `forward` (the decoder stack, attention included), `logits` (the lm_head
on the rows that need it, prompt logprobs) and `sample` (the sampler and its results as lists).

Rows that sample under a grammar (`grammar_bitmask_slot`) get their next-token bitmask from the
structured-output backend, computed on its mask thread while the forward runs (the C kernels and
llguidance both drop the GIL), and applied by the sampler in one op.

The runner reads request state (tokens, sampling params, the seeded generator, the grammar
matcher) and never writes it: what it produced goes back to the scheduler as a ModelRunnerOutput.

A model with sliding layers beside full ones (engine/kv_hybrid.py) gets `num_local_blocks`: its
sliding layers' caches are a pool of that many blocks, read through each request's second block
table (the step's `meta.local`).
"""

from __future__ import annotations

import time

import torch

from kvserve.engine.lora import LoRAManager
from kvserve.engine.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from kvserve.engine.sampler import Sampler, SamplingRequest, compute_logprobs
from kvserve.model.attention import AttentionMetadata
from kvserve.model.kv_quant import bytes_per_token, cache_shape
from kvserve.model.llama import LlamaForCausalLM


class PhaseClock:
    """Cumulative wall time of a step's phases, in ns, always on: `start()` at the top of a step,
    then `lap(phase)` after each phase charges it the time since the previous mark. The core
    owns it and the runner laps its own phases on it, so a step's phases add up to the step and
    no time is counted twice. Two perf_counter_ns reads per phase (well under a microsecond)."""

    PHASES = ("schedule", "prepare", "forward", "logits", "sample", "update", "messages")

    def __init__(self):
        self.ns = dict.fromkeys(self.PHASES, 0)
        self._mark = 0

    def start(self) -> None:
        self._mark = time.perf_counter_ns()

    def lap(self, phase: str) -> None:
        now = time.perf_counter_ns()
        self.ns[phase] += now - self._mark
        self._mark = now

    def seconds(self) -> dict[str, float]:
        return {k: v / 1e9 for k, v in self.ns.items()}


def _entries(token_ids: list[int], lps: torch.Tensor, ranks: torch.Tensor, top_ids: torch.Tensor | None,
             top_lps: torch.Tensor | None, k: int) -> list[TokenLogprob]:
    lps, ranks = lps.tolist(), ranks.tolist()
    if not k or top_ids is None:
        return [TokenLogprob(t, lp, r) for t, lp, r in zip(token_ids, lps, ranks)]
    ti, tl = top_ids[:, :k].tolist(), top_lps[:, :k].tolist()
    return [TokenLogprob(*row) for row in zip(token_ids, lps, ranks, ti, tl)]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 eos_token_ids: list[int], device: str | torch.device = "cpu", clock: PhaseClock | None = None,
                 num_local_blocks: int | None = None):
        cfg = model.config
        self.clock = clock or PhaseClock()
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        # torch.empty: pages become resident only when a block is first written.
        self.kv_caches = [torch.empty(cache_shape(num_local_blocks if num_local_blocks and cfg.window_of(i) else num_blocks,
                                                  block_size, cfg.num_key_value_heads, cfg.head_dim, kv_dtype),
                                      dtype=kv_dtype, device=self.device)
                          for i in range(cfg.num_hidden_layers)]
        self.sampler = Sampler(eos_token_ids)
        self.grammar = None     # kvserve.structured.backend.GrammarBackend, set by the core when needed
        # (scheduled, hidden, captured) -> None: every step's final hidden states [T, H], rows in the
        # order of `scheduled`, and the model's `captured` inner layers [T, n, H] or None (an EAGLE
        # draft reads the target's features from them); None: not kept
        self.hidden_sink = None

    @staticmethod
    def bytes_per_block(model: LlamaForCausalLM, block_size: int, kv_dtype: torch.dtype) -> int:
        return ModelRunner.bytes_per_layer_block(model, block_size, kv_dtype) * model.config.num_hidden_layers

    @staticmethod
    def bytes_per_layer_block(model: LlamaForCausalLM, block_size: int, kv_dtype: torch.dtype) -> int:
        cfg = model.config
        return block_size * bytes_per_token(1, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        clock = self.clock
        ids: list[int] = []
        pos: list[int] = []
        query_lens, seq_lens, tables, local_tables = [], [], [], []
        logit_rows: list[int] = []
        sampled = []                          # requests that sample this step
        sample_rows: list[int] = []
        grammar_rows: list[int] = []          # index in `sampled` of each grammar bitmask slot
        prompt_lp = []                        # (request, row offset in logit_rows, first position, count)
        spec = []                             # (request, drafts, first row in logit_rows): speculating
        lora_rows = []                        # (adapter or None, first row, count) per request
        for s in sched.scheduled:
            req, start, n = s.request, s.num_computed_tokens, s.num_new_tokens
            row0 = len(ids)
            k = len(s.spec_token_ids)
            ids += req.token_ids_slice(start, start + n - k) + s.spec_token_ids if k else \
                req.token_ids_slice(start, start + n)
            pos += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(s.block_ids)
            local_tables.append(s.local_block_ids)
            lora_rows.append((req.lora, row0, n))
            p = req.num_prompt_tokens
            if req.want_prompt_logprobs and start < p - 1:
                cnt = min(start + n, p - 1) - start     # positions whose next token is a prompt token
                prompt_lp.append((req, len(logit_rows), start, cnt))
                logit_rows += range(row0, row0 + cnt)
            if k:                             # verify the drafts: the k + 1 rows from the last real token
                spec.append((req, s.spec_token_ids, len(logit_rows)))
                logit_rows += range(row0 + n - k - 1, row0 + n)
            elif start + n == req.num_tokens:
                if s.grammar_bitmask_slot is not None:
                    grammar_rows.append(len(sampled))
                sampled.append(req)
                sample_rows.append(len(logit_rows))
                logit_rows.append(row0 + n - 1)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        if local_tables and local_tables[0] is not None:
            meta.local = AttentionMetadata.build(query_lens, seq_lens, local_tables, self.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        matchers = [sampled[i].grammar for i in grammar_rows]
        masks = self.grammar.start_bitmask(matchers) if matchers else None
        lora = LoRAManager.batch(lora_rows, len(ids), self.device) if getattr(self.model, "lora", None) is not None else None
        clock.lap("prepare")
        if lora is not None:
            self.model.lora.batch = lora
            try:
                hidden = self.model(input_ids, positions, meta, self.kv_caches)
            finally:
                self.model.lora.batch = None
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        if self.hidden_sink is not None:
            self.hidden_sink(sched.scheduled, hidden, getattr(self.model, "captured", None))
        clock.lap("forward")
        out = ModelRunnerOutput()
        if self.model.config.num_experts:
            counts = self.model.last_expert_counts(query_lens)
            out.expert_tokens = {s.request.request_id: c for s, c in zip(sched.scheduled, counts or [])}
        if not logit_rows:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=self.device)])
        for req, off, first, cnt in prompt_lp:
            targets = req.prompt_token_ids[first + 1:first + 1 + cnt]
            k = req.params.prompt_logprobs or 0
            res = compute_logprobs(logits[off:off + cnt], torch.tensor(targets, device=self.device), k)
            out.prompt_logprobs[req.request_id] = (first, _entries(targets, *res, k))
        clock.lap("logits")
        if sampled:
            rows = logits if len(sample_rows) == len(logit_rows) else logits[torch.tensor(sample_rows,
                                                                                           device=self.device)]
            reqs = [SamplingRequest(r.params, r.prompt_token_ids, r.output_token_ids, r.generator,
                                    r.reasoning is not None and not r.reasoning.done) for r in sampled]
            grammar = (grammar_rows, self.grammar.bitmask(masks, matchers)) if masks is not None else None
            so = self.sampler(rows, reqs, grammar)
            token_ids = so.token_ids.tolist()
            out.req_ids = [r.request_id for r in sampled]
            out.sampled_token_ids = [[t] for t in token_ids]
            k = max((r.params.logprobs or 0 for r in sampled), default=0)
            entries = _entries(token_ids, so.logprobs, so.ranks, so.top_token_ids, so.top_logprobs, k)
            out.logprobs = [[e] for e in entries]
            if k:   # trim each request's alternatives to the number it asked for
                for r, (e,) in zip(sampled, out.logprobs):
                    kr = r.params.logprobs or 0
                    if kr < k:
                        e.top_token_ids, e.top_logprobs = e.top_token_ids[:kr], e.top_logprobs[:kr]
        if spec:
            self._verify(logits, spec, out)
        clock.lap("sample")
        return out

    def _verify(self, logits: torch.Tensor, spec: list, out: ModelRunnerOutput) -> None:
        """Speculating requests: accepted drafts plus one token each (spec_decode/rejection.py)."""
        from kvserve.engine.spec_decode.rejection import SpecRow, verify
        rows = [SpecRow(SamplingRequest(r.params, r.prompt_token_ids, r.output_token_ids, r.generator), d, first)
                for r, d, first in spec]
        grammar = {i: self.grammar.draft_bitmask(r.grammar, d) for i, (r, d, _) in enumerate(spec)
                   if r.grammar_active}
        tokens, lps = verify(self.sampler, logits, rows, [r.params.logprobs or 0 for r, _, _ in spec], grammar)
        out.req_ids += [r.request_id for r, _, _ in spec]
        out.sampled_token_ids += tokens
        out.logprobs += lps
