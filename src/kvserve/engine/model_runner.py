"""ModelRunner: owns the model and the KV cache tensors; turns a SchedulerOutput into one
forward pass over the flattened batch, then samples for the sequences that caught up.

Packing, for sequences A (prefill chunk of 3 from position 0) and B (decode at position 7):
    input_ids  = [a0 a1 a2 | b7]        positions = [0 1 2 | 7]
    query_start_loc = [0, 3, 4]         seq_lens = [3, 8]
    slot_mapping = slot of each new token through its block table
Only the rows whose logits are needed (the last token of each sequence that will sample, and
every prompt position of a request that asked for prompt_logprobs) go through the lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.request import Sequence
from kvserve.engine.sampler import Sampler, SamplerOutput, SamplingRequest, compute_logprobs
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.model.attention import AttentionMetadata
from kvserve.model.llama import LlamaForCausalLM


@dataclass
class StepResult:
    sampled_seqs: list[Sequence]
    sampler_output: SamplerOutput | None
    # per sequence with prompt_logprobs in this step: (seq, first prompt position, logprobs, ranks, top ids, top lps)
    prompt_logprobs: list[tuple]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 eos_token_ids: list[int], device: str = "cpu"):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # torch.empty: pages become resident only when a block is first written.
        self.kv_caches = [torch.empty(shape, dtype=kv_dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.sampler = Sampler(eos_token_ids)

    @staticmethod
    def bytes_per_block(model: LlamaForCausalLM, block_size: int, kv_dtype: torch.dtype) -> int:
        cfg = model.config
        itemsize = torch.empty(0, dtype=kv_dtype).element_size()
        return 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize * cfg.num_hidden_layers

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        ids: list[int] = []
        pos: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        sample_rows: list[int] = []
        prompt_lp: list[tuple[Sequence, int, int, int]] = []   # seq, row offset, first pos, count
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            start = seq.num_computed_tokens
            row0 = len(ids)
            ids += seq.token_ids_slice(start, start + n)
            pos += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
            p = seq.num_prompt_tokens
            if seq.params.prompt_logprobs is not None and start < p - 1 and seq.prompt_logprobs is not None:
                cnt = min(start + n, p - 1) - start     # positions whose next token is a prompt token
                prompt_lp.append((seq, len(logit_rows), start, cnt))
                logit_rows += range(row0, row0 + cnt)
            if start + n == seq.num_tokens:
                sampled.append(seq)
                sample_rows.append(len(logit_rows))
                logit_rows.append(row0 + n - 1)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        if not logit_rows:
            return StepResult([], None, [])
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=self.device)])
        prompt_results = []
        for seq, off, first, cnt in prompt_lp:
            targets = torch.tensor(seq.prompt_token_ids[first + 1:first + 1 + cnt], device=self.device)
            prompt_results.append((seq, first, *compute_logprobs(logits[off:off + cnt], targets,
                                                                 seq.params.prompt_logprobs)))
        out = None
        if sampled:
            rows = logits if len(sample_rows) == len(logit_rows) else logits[torch.tensor(sample_rows)]
            reqs = [SamplingRequest(s.params, s.prompt_token_ids, s.output_token_ids, s.generator) for s in sampled]
            out = self.sampler(rows, reqs)
        return StepResult(sampled, out, prompt_results)
