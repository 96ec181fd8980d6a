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

A step is three stages, each a method with typed inputs and outputs:

    prepare_inputs(SchedulerOutput) -> StepInputs     the packed batch, the rows that need logits,
                                                      the LoRA rows, the grammar masks started
    forward(StepInputs) -> hidden [T, H]              the decoder stack (and the hidden sink)
    sample(StepInputs, hidden) -> ModelRunnerOutput   lm_head on the logit rows, prompt logprobs,
                                                      sampling, draft verification, logprob trimming

Collaborators come to the constructor: the structured-output backend (`grammar`, None without a
tokenizer) and a proposer's `HiddenSink` (spec_decode/proposer.py: an EAGLE head reads the
step's hidden rows and those of its inner layers, which the forward is asked for by argument).
The step's LoRA rows reach the model as the forward's `lora=` argument.

The runner reads request state (tokens, sampling params, the seeded generator, the grammar
matcher) and never writes it: what it produced goes back to the scheduler as a ModelRunnerOutput.

With a disk tier (`offload`, engine/kv_offload.py), the blocks it noted are copied out at the top
of `execute`, before the forward may overwrite them; `read_blocks` and `write_blocks` move whole
blocks of every layer between the KV tensors and the CPU.

A model with sliding layers beside full ones (engine/kv_hybrid.py) gets `num_local_blocks`: its
sliding layers' caches are a pool of that many blocks, read through each request's second block
table (the step's `meta.local`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvserve.engine.lora import LoRAManager
from kvserve.engine.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler, SamplingRequest, compute_logprobs
from kvserve.engine.spec_decode.proposer import HiddenSink
from kvserve.engine.spec_decode.rejection import SpecRow, verify
from kvserve.model.attention import AttentionMetadata
from kvserve.model.decoder import DecoderLM
from kvserve.model.kv_quant import bytes_per_token, cache_shape
from kvserve.model.loader import release_freed_heap
from kvserve.model.lora import LoRABatch
from kvserve.structured.backend import GrammarBackend


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


# A step of this many tokens (a prefill chunk) gives the C heap's freed pages back after it, when
# the heap holds TRIM_MIN_FREE bytes free: glibc raises its mmap threshold (up to 32 MB) each time a
# mapped block is freed, so after the first long prefill the activations come from the heap and
# stay there once freed, 65 MB after a 512-token prefill of a 1B Q4_K_M (288 -> 223 MB anonymous;
# the trim 6-9 ms, the step seconds). A small model's steps free little: no trim, no refaults.
TRIM_AFTER_TOKENS = 256
TRIM_MIN_FREE = 32 << 20


@dataclass(slots=True)
class StepInputs:
    """One step's batch as the model and the sampler read it (`ModelRunner.prepare_inputs`)."""

    sched: SchedulerOutput
    input_ids: torch.Tensor                    # [T] the new tokens of every scheduled request
    positions: torch.Tensor                    # [T]
    meta: AttentionMetadata
    query_lens: list[int]                      # rows per scheduled request
    lora: LoRABatch | None = None              # adapters and their rows (None: the base everywhere)
    logit_rows: list[int] = field(default_factory=list)     # rows that go through the lm_head
    sampled: list[Request] = field(default_factory=list)    # requests that sample one token
    sample_rows: list[int] = field(default_factory=list)    # ... their row in logit_rows
    grammar_rows: list[int] = field(default_factory=list)   # index in `sampled` of each grammar row
    matchers: list = field(default_factory=list)            # ... and its matcher
    masks: Future | None = None                             # their bitmasks, started before the forward
    prompt_lp: list[tuple[Request, int, int, int]] = field(default_factory=list)
    # ^ (request, offset in logit_rows, first position, count): prompt logprobs asked for
    spec: list[tuple[Request, list[int], int]] = field(default_factory=list)
    # ^ (request, drafts, first row in logit_rows): speculating requests' rows to verify


class ModelRunner:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 eos_token_ids: list[int], device: str | torch.device = "cpu", clock: PhaseClock | None = None,
                 num_local_blocks: int | None = None, grammar: GrammarBackend | None = None,
                 hidden_sink: HiddenSink | None = None):
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
        self.grammar = grammar
        # every step's final hidden states (and its `layers`' rows) go to hidden_sink.observe; None: not kept
        self.hidden_sink = hidden_sink
        self.offload = None                 # the disk tier (engine/kv_offload.py): saves before each forward

    @property
    def kv_dtype_name(self) -> str:
        return str(self.kv_caches[0].dtype).removeprefix("torch.")

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks of every layer, on the CPU: [n, layers, 2, block_size, heads, width]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([c.index_select(1, idx) for c in self.kv_caches], dim=1).transpose(0, 2).cpu().contiguous()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Overwrite these blocks of every layer with `data` (as `read_blocks` returns it)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, c in enumerate(self.kv_caches):
            c.index_copy_(1, idx, data[:, layer].transpose(0, 1).to(c.device))

    @staticmethod
    def bytes_per_block(model: DecoderLM, block_size: int, kv_dtype: torch.dtype) -> int:
        return ModelRunner.bytes_per_layer_block(model, block_size, kv_dtype) * model.config.num_hidden_layers

    @staticmethod
    def bytes_per_layer_block(model: DecoderLM, block_size: int, kv_dtype: torch.dtype) -> int:
        cfg = model.config
        return block_size * bytes_per_token(1, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        clock = self.clock
        if self.offload is not None:
            self.offload.save()
        inputs = self.prepare_inputs(sched)
        clock.lap("prepare")
        hidden = self.forward(inputs)
        clock.lap("forward")
        out = self.sample(inputs, hidden)      # laps logits and sample
        if len(inputs.input_ids) >= TRIM_AFTER_TOKENS:
            del hidden
            release_freed_heap(TRIM_MIN_FREE)
        return out

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled requests' new tokens into one batch (module docstring) and note
        which rows need logits and why; start the grammar rows' bitmasks."""
        ids: list[int] = []
        pos: list[int] = []
        query_lens, seq_lens, tables, local_tables = [], [], [], []
        logit_rows: list[int] = []
        sampled: list[Request] = []
        sample_rows: list[int] = []
        grammar_rows: list[int] = []
        prompt_lp = []
        spec = []
        lora_rows = []                        # (adapter, first row, count) per request under one
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
            if req.lora is not None:
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
        matchers = [sampled[i].grammar for i in grammar_rows]
        return StepInputs(
            sched, torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(pos, dtype=torch.long, device=self.device), meta, query_lens,
            LoRAManager.batch(lora_rows, len(ids), self.device) if lora_rows else None,
            logit_rows, sampled, sample_rows, grammar_rows, matchers,
            self.grammar.start_bitmask(matchers) if matchers else None, prompt_lp, spec)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The decoder stack over the batch: final hidden states [T, H]. The hidden sink, if any,
        gets them (and its layers' rows) here."""
        sink = self.hidden_sink
        if sink is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, lora=inputs.lora)
        hidden, captured = self.model.forward_features(inputs.input_ids, inputs.positions, inputs.meta,
                                                       self.kv_caches, lora=inputs.lora, capture_layers=sink.layers)
        sink.observe(inputs.sched.scheduled, hidden, captured)
        return hidden

    def sample(self, inputs: StepInputs, hidden: torch.Tensor) -> ModelRunnerOutput:
        """The step's results: MoE counts, the lm_head on the logit rows, prompt logprobs (clock
        phase `logits`), then the sampled tokens and the verified drafts (`sample`)."""
        out = ModelRunnerOutput()
        if self.model.config.num_experts:
            counts = self.model.last_expert_counts(inputs.query_lens)
            out.expert_tokens = {s.request.request_id: c for s, c in zip(inputs.sched.scheduled, counts or [])}
        if not inputs.logit_rows:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(inputs.logit_rows, device=self.device)])
        for req, off, first, cnt in inputs.prompt_lp:
            targets = req.prompt_token_ids[first + 1:first + 1 + cnt]
            k = req.params.prompt_logprobs or 0
            res = compute_logprobs(logits[off:off + cnt], torch.tensor(targets, device=self.device), k)
            out.prompt_logprobs[req.request_id] = (first, _entries(targets, *res, k))
        self.clock.lap("logits")
        if inputs.sampled:
            self._sample_rows(inputs, logits, out)
        if inputs.spec:
            self._verify(logits, inputs.spec, out)
        self.clock.lap("sample")
        return out

    def _sample_rows(self, inputs: StepInputs, logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        """One token for each request that caught up, with its logprobs (each trimmed to the number
        of alternatives it asked for)."""
        sampled, sample_rows = inputs.sampled, inputs.sample_rows
        rows = logits if len(sample_rows) == len(inputs.logit_rows) else logits[torch.tensor(sample_rows,
                                                                                              device=self.device)]
        reqs = [SamplingRequest(r.params, r.prompt_token_ids, r.output_token_ids, r.generator,
                                r.reasoning is not None and not r.reasoning.done) for r in sampled]
        grammar = ((inputs.grammar_rows, self.grammar.bitmask(inputs.masks, inputs.matchers))
                   if inputs.masks is not None else None)
        so = self.sampler(rows, reqs, grammar)
        token_ids = so.token_ids.tolist()
        out.req_ids = [r.request_id for r in sampled]
        out.sampled_token_ids = [[t] for t in token_ids]
        k = max((r.params.logprobs or 0 for r in sampled), default=0)
        entries = _entries(token_ids, so.logprobs, so.ranks, so.top_token_ids, so.top_logprobs, k)
        out.logprobs = [[e] for e in entries]
        if k:
            for r, (e,) in zip(sampled, out.logprobs):
                kr = r.params.logprobs or 0
                if kr < k:
                    e.top_token_ids, e.top_logprobs = e.top_token_ids[:kr], e.top_logprobs[:kr]

    def _verify(self, logits: torch.Tensor, spec: list[tuple[Request, list[int], int]],
                out: ModelRunnerOutput) -> None:
        """Speculating requests: accepted drafts plus one token each (spec_decode/rejection.py)."""
        rows = [SpecRow(SamplingRequest(r.params, r.prompt_token_ids, r.output_token_ids, r.generator), d, first,
                        min_logprob=r.draft_min_logprob if r.supplied_draft is not None else None)
                for r, d, first in spec]     # (a request with its own draft pending has no proposer's: own_draft.py)
        grammar = {i: self.grammar.draft_bitmask(r.grammar, d) for i, (r, d, _) in enumerate(spec)
                   if r.grammar_active}
        tokens, lps = verify(self.sampler, logits, rows, [r.params.logprobs or 0 for r, _, _ in spec], grammar)
        out.req_ids += [r.request_id for r, _, _ in spec]
        out.sampled_token_ids += tokens
        out.logprobs += lps
