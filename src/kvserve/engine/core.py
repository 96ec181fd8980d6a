"""EngineCore: the one loop that runs the model. Every driver (LLM.generate, the CLI, the server's
in-process thread and the separate engine process) calls `step()` here and nothing else.

    step():  SchedulerOutput   = scheduler.schedule()
             ModelRunnerOutput = runner.execute(scheduler_output)
             EngineCoreOutputs = scheduler.update_from_output(scheduler_output, runner_output)

The core speaks token ids only: requests come in as EngineCoreRequests (already tokenized and
validated by the client's input processing) and leave as EngineCoreOutputs (new token ids,
logprob numbers, finish reasons). Text, stop strings, n/best_of and the output objects users see
are the client's (kvserve.engine.processing). `run_busy_loop` is the server's driver, shared by
the in-process thread and the engine process.

Where a step's time goes is always measured, on one PhaseClock (model_runner.py) that the core and
the runner lap in turn: schedule | prepare, forward, logits, sample (the runner) | update, and in
the busy loop `messages` (client messages in, outputs and the stats snapshot out). `stats()`
reports the cumulative seconds per phase with the step count and the batched tokens and
requests, so `kvserve bench serve --profile` and /metrics can divide them.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import time
import weakref
from collections.abc import Callable

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.kv_hybrid import HybridKVCacheManager, local_pool_blocks
from kvserve.engine.kv_offload import attach_offload
from kvserve.engine.lora import LoRAManager, parse_lora_modules
from kvserve.engine.messages import (
    AbortRequests,
    CoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Shutdown,
)
from kvserve.engine.model_runner import ModelRunner, PhaseClock
from kvserve.engine.reasoning_budget import ReasoningState
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.spec_decode.decoder import make_spec_decoder
from kvserve.errors import InvalidRequest
from kvserve.model.decoder import DecoderLM
from kvserve.structured.backend import GrammarBackend
from kvserve.structured.grammar import compiler_for

logger = logging.getLogger("kvserve.engine")


class EngineCore:
    def __init__(self, model: DecoderLM, config: EngineConfig, eos_token_ids: list[int], tokenizer=None):
        self.config = config
        if config.num_threads:   # torch's ops and the C kernels alike (the kernels read torch's count once, at load)
            torch.set_num_threads(config.num_threads)
            if model.backend.lib is not None:
                model.backend.lib.kvs_set_num_threads(config.num_threads)
        self._backend = model.backend   # its kernels' team (fewer threads while a core is taken) sets torch's
        cfg = model.config
        self.model_config = cfg
        self.max_model_len = min(config.max_model_len or cfg.max_model_len, cfg.max_model_len)
        per_block = ModelRunner.bytes_per_block(model, config.block_size, config.torch_kv_dtype)
        num_blocks = config.kv_cache_bytes() // per_block
        num_local = self._split_pools(model, config, num_blocks) if cfg.local_window else None
        if num_local is not None:   # the sliding layers' pool is bounded: the rest goes to the full layers
            num_blocks, num_local = num_local
        if num_blocks < 2:
            raise InvalidRequest(f"kv_cache_memory ({config.kv_cache_bytes()} bytes) holds fewer than 2 KV "
                                 f"blocks of {per_block} bytes: give it more memory", param="kv_cache_memory")
        # A sequence can never be longer than the pool: cap the context to what fits.
        self.context_limited_by_kv = num_blocks * config.block_size < self.max_model_len
        self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
        self.block_size = config.block_size
        if num_local is not None:
            self.kv = HybridKVCacheManager(num_blocks, num_local, config.block_size, config.enable_prefix_caching,
                                           cfg.local_window)
        else:
            self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, cfg.kv_window)
        spec = make_spec_decoder(config.spec_config, model, tokenizer) if config.spec_config is not None else None
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, eos_token_ids, config.long_prefill_token_threshold,
                                   config.max_num_partial_prefills, config.max_step_ms,
                                   config.max_decode_slowdown,
                                   decode=tokenizer.decode if tokenizer is not None else None, spec=spec)
        # structured output (kvserve.structured): cheap to build, its threads start at the first grammar
        self.grammar = (GrammarBackend(compiler_for(tokenizer, cfg.vocab_size)) if tokenizer is not None
                        else None)
        self.clock = PhaseClock()
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.torch_kv_dtype, eos_token_ids,
                                  device=config.device, clock=self.clock, num_local_blocks=num_local,
                                  grammar=self.grammar,
                                  hidden_sink=spec.proposer.hidden_sink if spec is not None else None)
        self.offload = attach_offload(config, model, self.kv, self.runner)    # the disk tier, if configured
        if self.offload is not None:        # LLM(...) has no close: the tier is flushed at exit too
            ref = weakref.ref(self)
            atexit.register(lambda: (core := ref()) is not None and core.close())
        self.kv_bytes_per_token = per_block // config.block_size
        logger.info("KV cache: %s, %d bytes per token, %d tokens fit (%d blocks of %d)", self.kv_dtype_name,
                    self.kv_bytes_per_token, num_blocks * config.block_size, num_blocks, config.block_size)
        self.lora = LoRAManager(model, config.max_loras)
        for name, path in parse_lora_modules(config.lora_modules).items():
            self.lora.add(name, path)
        self.tokenizer = tokenizer
        self._arrival = itertools.count()
        self.num_steps = 0
        self.num_batched_tokens = 0       # summed over steps: tokens in the forward pass ...
        self.num_batched_requests = 0     # ... and requests in the batch
        self._expert_tokens: dict[str, list[int]] = {}   # MoE counts not yet handed to an output

    @staticmethod
    def _split_pools(model: DecoderLM, config: EngineConfig, num_blocks: int) -> tuple[int, int]:
        """(full-layer blocks, sliding-layer blocks) in the same memory as num_blocks of every layer:
        the sliding layers get what their windows need (kv_hybrid.local_pool_blocks), at most as many."""
        cfg = model.config
        n_local_layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.window_of(i))
        n_full_layers = cfg.num_hidden_layers - n_local_layers
        layer_block = ModelRunner.bytes_per_layer_block(model, config.block_size, config.torch_kv_dtype)
        local = min(num_blocks, local_pool_blocks(cfg.local_window, config.block_size, config.max_num_seqs,
                                                  config.max_num_batched_tokens))
        full = (config.kv_cache_bytes() - local * n_local_layers * layer_block) // (n_full_layers * layer_block)
        return full, local

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a validated request (kvserve.engine.processing checked ids, vocabulary, window)."""
        if req.request_id in self.scheduler.requests:
            raise InvalidRequest(f"request id {req.request_id!r} is already in use", param="request_id")
        r = Request.from_core_request(req, next(self._arrival), self.max_model_len, self.runner.device)
        if req.lora_name:
            r.lora = self.lora.acquire(req.lora_name)
        if req.sampling_params.reasoning_budget is not None and req.reasoning_end_ids:
            r.reasoning = ReasoningState(req.sampling_params.reasoning_budget, list(req.reasoning_end_ids))
        if req.structured_output is not None:
            r.grammar_future = self.grammar_backend().submit(req.structured_output["grammar"])
        self.scheduler.add(r)

    def grammar_backend(self) -> GrammarBackend:
        """The structured-output backend (compile thread, mask thread)."""
        if self.grammar is None:
            raise InvalidRequest("this engine was built without a tokenizer: structured output needs one",
                                 param="structured_outputs")
        return self.grammar

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Stop these requests wherever they are and free their blocks; unknown ids are ignored."""
        outs = []
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self.scheduler.finish(req, "abort")
                outs.append(self.scheduler.make_output(req, []))
                outs[-1].finish_reason = "abort"
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        clock = self.clock
        clock.start()
        if self.offload is not None:
            self.offload.begin_step()
        sched = self.scheduler.schedule()
        clock.lap("schedule")
        if not sched:
            failed, self.scheduler.failed = self.scheduler.failed, []
            return EngineCoreOutputs(time.monotonic(), failed)
        self.num_steps += 1
        self.num_batched_tokens += sched.total_num_scheduled_tokens
        self.num_batched_requests += len(sched.scheduled)
        t0 = time.perf_counter()
        result = self.runner.execute(sched)        # laps prepare, forward, logits, sample
        self._backend.sync_torch_threads()
        self.scheduler.observe_step(sched, time.perf_counter() - t0)
        outputs = self.scheduler.update_from_output(sched, result)
        if result.expert_tokens:
            self._attach_expert_tokens(result.expert_tokens, outputs)
        clock.lap("update")
        return EngineCoreOutputs(time.monotonic(), outputs)

    def _attach_expert_tokens(self, counts: dict[str, list[int]], outputs: list[EngineCoreOutput]) -> None:
        """MoE: add this step's per-expert counts to each request's, handed over with its next output
        (a prompt chunk that samples nothing produces none)."""
        acc = self._expert_tokens
        for rid, c in counts.items():
            prev = acc.get(rid)
            acc[rid] = c if prev is None else [a + b for a, b in zip(prev, c)]
        for o in outputs:
            o.expert_tokens = acc.pop(o.request_id, None)
        for rid in [r for r in acc if r not in self.scheduler.requests]:   # aborted meanwhile
            del acc[rid]

    def fail_all(self, message: str) -> EngineCoreOutputs:
        """A step raised: end every request with an error (the server stays up)."""
        outs = self.abort_requests(list(self.scheduler.requests))
        for o in outs:
            o.finish_reason, o.error = "error", message
        return EngineCoreOutputs(time.monotonic(), outs, self.stats())

    # ---- the server's driver ------------------------------------------------------------------
    def handle(self, msg: CoreInput) -> list[EngineCoreOutput]:
        """Apply one client message; errors become an "error" output for that request."""
        if isinstance(msg, EngineCoreRequest):
            try:
                self.add_request(msg)
            except Exception as e:  # noqa: BLE001 - reported to the request's caller
                return [EngineCoreOutput(msg.request_id, [], finish_reason="error", error=str(e))]
            return []
        if isinstance(msg, AbortRequests):
            return self.abort_requests(msg.request_ids)
        return []

    def run_busy_loop(self, poll: Callable[[float], list[CoreInput]],
                      emit: Callable[[EngineCoreOutputs], None], with_stats: bool = True) -> None:
        """poll(timeout) -> pending client messages (waits up to timeout when idle); emit(outputs)
        hands each step's outputs back, with a stats snapshot when `with_stats` (a client in
        another process cannot read the core). Returns on a Shutdown message. Its own work (not
        the waits of an idle poll) is the clock's `messages` phase."""
        clock = self.clock
        while True:
            busy = self.has_unfinished_requests()
            if busy:
                clock.start()
            msgs = poll(0.0 if busy else 0.5)
            if not busy:
                clock.start()
            immediate: list[EngineCoreOutput] = []
            for msg in msgs:
                if isinstance(msg, Shutdown):
                    self.close()
                    return
                immediate += self.handle(msg)
            if immediate or (msgs and not self.has_unfinished_requests()):
                emit(EngineCoreOutputs(time.monotonic(), immediate, self.stats() if with_stats else None))
            clock.lap("messages")
            if not self.has_unfinished_requests():
                continue
            try:
                out = self.step()
            except Exception as e:
                logger.exception("engine step failed")
                emit(self.fail_all(f"the engine failed while running this request: {e!r}"))
                continue
            clock.start()
            if with_stats:
                out.stats = self.stats()
            emit(out)
            clock.lap("messages")

    # ---- introspection ----------------------------------------------------------------------
    @property
    def kv_dtype_name(self) -> str:
        return str(self.config.torch_kv_dtype).removeprefix("torch.")

    def close(self) -> None:
        """Flush the disk tier (its store's close saves the blocks the last step noted, then drains
        the writer's queue) and detach it. Idempotent."""
        offload, self.offload = self.offload, None
        if offload is not None:
            self.kv.offload = self.runner.offload = None     # a closed tier is never read or written again
            offload.store.close()

    def stats(self) -> dict:
        kv, s = self.kv, self.scheduler
        return {
            "num_requests_running": len(s.running),
            "num_requests_waiting": len(s.waiting),
            "kv_blocks_used": kv.num_used_blocks,
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_cache_usage_perc": kv.usage(),
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": s.num_preemptions,
            "prompt_tokens": s.prompt_tokens_total,
            "generation_tokens": s.generation_tokens_total,
            "num_steps": self.num_steps,
            "num_batched_tokens": self.num_batched_tokens,
            "num_batched_requests": self.num_batched_requests,
            "phase_seconds": self.clock.seconds(),
            "block_size": self.block_size,
            "kv_cache_dtype": self.kv_dtype_name,
            "kv_cache_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_capacity_tokens": kv.num_blocks * self.block_size,
            "moe_expert_tokens": self.runner.model.expert_token_counts(),   # [layer][expert]; [] if dense
            **(s.spec.stats() if s.spec is not None else {}),
            **self.lora.stats(),
            **(self.offload.stats() if self.offload is not None else {}),
        }
