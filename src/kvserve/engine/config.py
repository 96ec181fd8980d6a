"""Engine options (the keyword arguments of `LLM` and `make_engine_client`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvserve.errors import InvalidRequest
from kvserve.model.kv_quant import KV_DTYPES as _DTYPES


@dataclass
class EngineConfig:
    # KV cache budget: bytes (int), a fraction of RAM (0 < float <= 1), or a string like "2GiB".
    kv_cache_memory: int | float | str = "1GiB"
    block_size: int = 16
    max_num_seqs: int = 64                 # most sequences in one step
    max_num_batched_tokens: int = 512      # token budget per step (chunked prefill size)
    enable_prefix_caching: bool = True
    # Fairness under long prompts (engine/scheduler.py): a prompt with more tokens left than this is
    # "long" and takes at most this many per step (default: half of max_num_batched_tokens); at most
    # max_num_partial_prefills long prompts prefill at once; and a long prompt's chunk is cut so the
    # step's predicted time stays under max_step_ms (0 or None: no time target; `kvserve serve` sets
    # step_cost.DEFAULT_MAX_STEP_MS, offline generation favours throughput). With a time target, steps
    # that carry running decodes take on average at most max_decode_slowdown times their time without
    # the long chunks, so streams keep their pace (0: max_step_ms alone; engine/scheduler.py).
    long_prefill_token_threshold: int | None = None
    max_num_partial_prefills: int = 2
    max_step_ms: float | None = None
    max_decode_slowdown: float = 1.6
    max_model_len: int | None = None       # default: the model's context length
    # fp16 (as llama.cpp; also "auto"), bf16, fp32, or int8 (rows with their own scale, model/kv_quant.py,
    # ~1.9x the tokens per byte): the C attention reads them all
    kv_cache_dtype: str = "fp16"
    weight_format: str = "auto"
    # torch intra-op threads (default: all cores; with tensor parallelism, the cores divided among
    # the ranks, each rank being a process of its own: oversubscribed ranks were 100x slower)
    num_threads: int | None = None
    # Where the KV cache and the step's tensors live: "cpu", "cuda[:N]", or "auto" (cuda when torch
    # sees a GPU). The model must be loaded on the same device.
    device: str = "cpu"
    # Split each layer's heads and MLP over this many processes (model/parallel.py; fp32 PyTorch path).
    tensor_parallel_size: int = 1
    # Speculative decoding (engine/spec_decode): "ngram", "draft:PATH", "ngram+draft:PATH", a dict of SpeculativeConfig
    # fields, or None (off); num_speculative_tokens: the most draft tokens per step (1..16, default 4).
    speculative: object = None
    num_speculative_tokens: int | None = None
    # LoRA adapters (engine/lora.py): {name: PEFT adapter directory} loaded at start, and how many
    # adapters stay in memory at once (least recently used out first; reloaded from disk on demand).
    lora_modules: dict[str, str] | None = None
    max_loras: int = 8
    # A second KV tier on local disk (engine/kv_offload.py): full blocks are written under their chained
    # hash to this directory (None: off), at most kv_offload_size bytes in the directory as a whole, every
    # process and model writing there counted (engine/kv_disk_quota.py; least recently used out first),
    # every full block as it is computed (kv_offload_write_through: a restart starts warm) or only those
    # evicted from the pool; a prompt's blocks missing from RAM are read back instead of computed.
    kv_offload_dir: str | None = None
    kv_offload_size: int | str = "20GiB"
    kv_offload_write_through: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_num_partial_prefills",
                     "tensor_parallel_size", "max_loras"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidRequest(f"{name} must be a positive integer, got {v!r}", param=name)
        t = self.long_prefill_token_threshold
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 1):
            raise InvalidRequest(f"long_prefill_token_threshold must be a positive integer, got {t!r}",
                                 param="long_prefill_token_threshold")
        m = self.max_step_ms
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1e7):
            raise InvalidRequest(f"max_step_ms must be a number of milliseconds >= 0, got {m!r}", param="max_step_ms")
        f = self.max_decode_slowdown
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (f == 0 or 1 <= f < 1e3):
            raise InvalidRequest(f"max_decode_slowdown must be 0 (off) or a factor of at least 1, got {f!r}",
                                 param="max_decode_slowdown")
        if self.num_threads is None and self.tensor_parallel_size > 1:
            self.num_threads = max(1, len(os.sched_getaffinity(0)) // self.tensor_parallel_size)
        from kvserve.engine.spec_decode.config import SpeculativeConfig
        self.spec_config = SpeculativeConfig.parse(self.speculative, self.num_speculative_tokens)
        if self.kv_offload_dir is not None:
            self.kv_offload_dir = os.fspath(self.kv_offload_dir)
            self.kv_offload_bytes()
        if self.kv_cache_dtype not in _DTYPES:
            raise InvalidRequest(f"kv_cache_dtype must be one of auto, fp16, bf16, fp32, int8; got {self.kv_cache_dtype!r}",
                                 param="kv_cache_dtype")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise InvalidRequest(f"device must be cpu, cuda[:N] or auto, got {self.device!r}", param="device") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise InvalidRequest("device cuda was asked for but torch sees no GPU", param="device")

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return _DTYPES[self.kv_cache_dtype]

    def kv_cache_bytes(self) -> int:
        v = self.kv_cache_memory
        if isinstance(v, str):
            return parse_bytes(v)
        if isinstance(v, float) and 0 < v <= 1:
            return int(v * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1:
            return int(v)
        raise InvalidRequest(f"kv_cache_memory must be bytes, a fraction of RAM in (0, 1] or a size like "
                             f"'2GiB', got {v!r}", param="kv_cache_memory")


    def kv_offload_bytes(self) -> int:
        v = self.kv_offload_size
        if isinstance(v, str):
            return parse_bytes(v, param="kv_offload_size")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
        raise InvalidRequest(f"kv_offload_size must be bytes or a size like '20GiB', got {v!r}",
                             param="kv_offload_size")


def parse_bytes(s: str, param: str = "kv_cache_memory") -> int:
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
             "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}
    t = s.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        if t[len(num):] in units and float(num) > 0:
            return int(float(num) * units[t[len(num):]])
    except ValueError:
        pass
    raise InvalidRequest(f"cannot read {s!r} as a size: use e.g. 512MiB or 2GiB", param=param)
