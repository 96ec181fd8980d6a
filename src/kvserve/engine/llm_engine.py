"""LLMEngine: add_request / step / abort over the scheduler, the KV cache and the model.

    step():  Scheduler.schedule()  ->  ModelRunner.execute()  ->  update sequences
             (advance computed tokens, register full blocks in the prefix cache, append the
             sampled token, detokenize, check stops, free finished sequences) -> RequestOutputs

A request with n > 1 (or best_of) becomes that many sibling Sequences sharing a request id.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.model_runner import ModelRunner, StepResult
from kvserve.engine.output import build_output, record_sample
from kvserve.engine.request import Sequence
from kvserve.engine.sampler import make_generator
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.stop import check_stop
from kvserve.errors import ContextLengthExceeded, InvalidRequest
from kvserve.model.llama import LlamaForCausalLM
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 model_name: str = ""):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_name = model_name or model.config.name
        self.tokenizer = tokenizer
        self.model_config = model.config
        self.max_model_len = min(config.max_model_len or model.config.max_model_len, model.config.max_model_len)
        per_block = ModelRunner.bytes_per_block(model, config.block_size, config.torch_kv_dtype)
        num_blocks = config.kv_cache_bytes() // per_block
        if num_blocks < 2:
            raise InvalidRequest(f"kv_cache_memory ({config.kv_cache_bytes()} bytes) holds fewer than 2 KV "
                                 f"blocks of {per_block} bytes: give it more memory", param="kv_cache_memory")
        # A sequence can never be longer than the pool: cap the context to what fits.
        self.context_limited_by_kv = num_blocks * config.block_size < self.max_model_len
        self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
        self.block_size = config.block_size
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.torch_kv_dtype,
                                  tokenizer.eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self._arrival = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    *, priority: int = 0, cache_salt: str | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty: give at least one token", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary "
                                 f"(0..{self.model_config.vocab_size - 1})", param="prompt")
        room = self.max_model_len - len(ids)
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            limit = (f"the KV cache (kv_cache_memory) holds at most {self.max_model_len} tokens per sequence"
                     if self.context_limited_by_kv else
                     f"this model's maximum context length is {self.max_model_len} tokens")
            raise ContextLengthExceeded(
                f"{limit}; the prompt has {len(ids)} tokens and max_tokens asks for {params.max_tokens} more: "
                "shorten the prompt or lower max_tokens", param="max_tokens" if room >= 1 else "prompt")
        seqs: list[Sequence] = []
        arrival = next(self._arrival)
        for i in range(params.num_sequences):
            seed = None if params.seed is None else params.seed + i
            seq = Sequence(request_id, i, ids, params, arrival, priority=priority, cache_salt=cache_salt,
                           generator=make_generator(seed), wait_for=seqs[0] if i and self.kv.enable_prefix_caching
                           else None)
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop_strings, include_stop_str_in_output=params.include_stop_str_in_output)
            seq.metrics.num_prompt_tokens = len(ids)
            if params.logprobs is not None:
                seq.logprobs = []
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            if i:
                seq.metrics.arrival_time = seqs[0].metrics.arrival_time
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = RequestState(request_id, text, ids, params, seqs)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise InvalidRequest("a prompt is a string, a list of token ids or {'prompt_token_ids': [...]}",
                             param="prompt")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free all its blocks at once."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
                seq.metrics.finished_time = time.monotonic()
        return build_output(state, self.tokenizer)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched:
            return []
        self.num_steps += 1
        result: StepResult = self.runner.execute(sched)
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.prompt_tokens_total += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
            seq.metrics.num_kv_blocks = max(seq.metrics.num_kv_blocks, len(seq.block_table))
            self.kv.cache_full_blocks(seq)
        for seq, first, lps, ranks, top_ids, top_lps in result.prompt_logprobs:
            record_prompt_logprobs(seq, first, lps, ranks, top_ids, top_lps, self.tokenizer)
        if result.sampler_output is not None:
            out = result.sampler_output
            token_ids = out.token_ids.tolist()
            for row, seq in enumerate(result.sampled_seqs):
                tok = token_ids[row]
                seq.output_token_ids.append(tok)
                self.generation_tokens_total += 1
                record_sample(seq, row, out, self.tokenizer, now)
                max_tokens = self.max_model_len - seq.num_prompt_tokens
                if seq.params.max_tokens is not None:
                    max_tokens = min(max_tokens, seq.params.max_tokens)
                stop = check_stop(seq.params, seq.output_token_ids, self.tokenizer.eos_token_ids, max_tokens)
                # An EOS or stop token that ends the request adds no text (vLLM's behaviour).
                stop_token = stop is not None and stop[0] == "stop"
                seq.text += seq.detokenizer.add_tokens([tok], stop_terminated=stop_token)
                if seq.detokenizer.stop_reason is not None:
                    stop = ("stop", seq.detokenizer.stop_reason)
                if stop is not None:
                    seq.finish_reason, seq.stop_reason = stop
                    seq.text += seq.detokenizer.flush()
                    seq.metrics.finished_time = now
                    self.scheduler.finish(seq)
                touched[seq.request_id] = self.requests[seq.request_id]
        outputs = []
        for rid, state in touched.items():
            outputs.append(build_output(state, self.tokenizer))
            if state.finished:
                del self.requests[rid]
        return outputs

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> dict:
        kv = self.kv
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": kv.num_used_blocks,
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_cache_usage_perc": kv.usage(),
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.prompt_tokens_total,
            "generation_tokens": self.generation_tokens_total,
            "num_steps": self.num_steps,
            "block_size": self.block_size,
        }


def record_prompt_logprobs(seq: Sequence, first: int, lps, ranks, top_ids, top_lps, tokenizer) -> None:
    from kvserve.engine.output import position_logprobs

    targets = seq.prompt_token_ids[first + 1:first + 1 + len(lps)]
    for j, tok in enumerate(targets):
        if len(seq.prompt_logprobs) > first + 1 + j:
            continue   # already recorded before a preemption
        seq.prompt_logprobs.append(position_logprobs(
            tok, float(lps[j]), int(ranks[j]),
            None if top_ids is None else top_ids[j].tolist(), None if top_lps is None else top_lps[j].tolist(),
            tokenizer))
