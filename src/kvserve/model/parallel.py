"""Tensor parallelism: each decoder layer's attention heads and MLP columns split over processes.

    rank r holds KV heads [k0, k1) and their query heads, and MLP columns [i0, i1):
      qkv_proj, gate_up_proj   column-parallel: the rows of W for its heads / columns
      o_proj, down_proj        row-parallel: the columns of W for its heads / columns, then an
                               all-reduce (sum) of the partial outputs over the group
    the embedding, the norms and RoPE are replicated; the lm_head lives on rank 0 only.

Megatron's split, in plain PyTorch: a layer's output is the sum of every rank's partial product,
so the result equals the unsplit layer up to float32 summation order. Heads split by KV-head
groups, as evenly as they go (SmolLM2's 3 KV heads over 2 ranks: 2 + 1), so GQA stays intact.

Rank 0 is the engine's process: its model (`TPModel`, a DecoderLM whose layers are
`ParallelLayer`s) broadcasts each step's inputs (token ids, positions, attention metadata, the KV
pool's size) to the other ranks before running its own shard; ranks 1.. (`python -m
kvserve.model.parallel SPEC`, started by `launch`) loop on those broadcasts with their shard and
their own KV cache. torch.distributed with gloo on CPU, NCCL when CUDA is there. The weights are
the model's dequantized to float32 (the PyTorch ops path), so TP=2 equals TP=1 on the same fp32
model within float32 tolerance.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import torch
from torch import nn

from kvserve.errors import InvalidRequest
from kvserve.model.attention import AttentionMetadata
from kvserve.model.decoder import DecoderLM
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.linear import DenseLinear
from kvserve.model.loader import load_model


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each part of range(n), as even as possible (the first parts larger)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        out.append((start, end))
        start = end
    return out


def check_supported(cfg, world: int) -> None:
    if cfg.num_key_value_heads < world:
        raise InvalidRequest(f"tensor_parallel_size {world} is more than this model's {cfg.num_key_value_heads} "
                             "KV heads: use at most that many", param="tensor_parallel_size")
    if cfg.num_experts or cfg.gemma_norms or cfg.qk_norm == "full":
        raise InvalidRequest("tensor parallelism supports the Llama-shaped families (Llama, Mistral, Qwen2/3, "
                             "SmolLM2), not MoE, Gemma or OLMoE", param="tensor_parallel_size")


class ParallelLayer(nn.Module):
    """One decoder layer's shard; the attributes TorchOps.attention reads describe the shard."""

    def __init__(self, layer, rank: int, world: int, group=None):
        super().__init__()
        d, g = layer.head_dim, layer.num_heads // layer.num_kv_heads
        k0, k1 = split(layer.num_kv_heads, world)[rank]
        i0, i1 = split(layer.intermediate_size, world)[rank]
        self.group = group
        self.mlp = self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None   # dense Llama shape
        self.head_dim, self.num_kv_heads, self.num_heads = d, k1 - k0, (k1 - k0) * g
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        for name in ("scale", "sliding_window", "local_rope", "softcap", "qk_norm", "act", "q_norm", "k_norm",
                     "input_layernorm", "post_attention_layernorm"):
            setattr(self, name, getattr(layer, name))
        q_rows = slice(k0 * g * d, k1 * g * d)
        k_rows = slice(layer.q_size + k0 * d, layer.q_size + k1 * d)
        v_rows = slice(layer.q_size + layer.kv_size + k0 * d, layer.q_size + layer.kv_size + k1 * d)

        def rows(t):
            return None if t is None else torch.cat([t[q_rows], t[k_rows], t[v_rows]]).clone()

        w, b = layer.qkv_proj.weight.float(), layer.qkv_proj.bias
        self.qkv_proj = DenseLinear(rows(w), rows(b))
        self.o_proj = DenseLinear(layer.o_proj.weight.float()[:, q_rows].clone())
        inter = layer.intermediate_size
        gu = layer.gate_up_proj.weight.float()
        self.gate_up_proj = DenseLinear(torch.cat([gu[i0:i1], gu[inter + i0:inter + i1]]).clone())
        self.down_proj = DenseLinear(layer.down_proj.weight.float()[:, i0:i1].clone())

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(t, group=self.group)
        return t

    def forward(self, x: torch.Tensor, step, kv_cache: torch.Tensor | None, ops) -> torch.Tensor:
        lead, hidden = x.shape[:-1], x.shape[-1]
        h = ops.rms_norm(x, self.input_layernorm).reshape(-1, hidden)
        o = ops.attention(self.qkv_proj(h).view(*lead, -1), self, step, kv_cache)
        x = x + self._reduce(self.o_proj(o.reshape(-1, self.q_size))).view(*lead, -1)
        h = ops.rms_norm(x, self.post_attention_layernorm).reshape(-1, hidden)
        gu = self.gate_up_proj(h)
        m = ops.silu_mul(gu) if self.act == "silu" else ops.gelu_mul(gu)
        return x + self._reduce(self.down_proj(m)).view(*lead, -1)


def shard_model(full: DecoderLM, rank: int, world: int) -> TPModel:
    """This rank's model: ParallelLayers, the replicated embedding and norm, the lm_head."""
    cfg = full.config
    check_supported(cfg, world)
    layers = [ParallelLayer(layer, rank, world) for layer in full.layers]
    k0, k1 = split(cfg.num_key_value_heads, world)[rank]
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    local = dataclasses.replace(cfg, num_key_value_heads=k1 - k0, num_attention_heads=(k1 - k0) * g,
                                head_dim=cfg.head_dim)
    embed = full.embed_tokens.data if full.embed_tokens is not None else full.embed(
        torch.arange(cfg.vocab_size, device=full.norm.weight.device)).float()
    model = TPModel(local, embed, layers, full.norm, full.lm_head, full.backend)
    model.rank, model.world = rank, world
    return model


class TPModel(DecoderLM):
    """A rank's shard of the model. On rank 0 a forward first broadcasts the step to the others."""

    rank = 0
    world = 1
    workers: tuple[subprocess.Popen, ...] = ()

    def forward_features(self, input_ids, positions=None, attn_metadata=None, kv_caches=None, inputs_embeds=None,
                         attn_mask=None, *, lora=None, capture_layers: tuple[int, ...] = ()):
        if attn_metadata is None and self.world > 1:
            raise InvalidRequest("a tensor-parallel model runs paged engine steps only", param="tensor_parallel_size")
        if lora is not None:
            raise InvalidRequest("a tensor-parallel model does not serve LoRA adapters", param="tensor_parallel_size")
        if self.rank == 0 and self.world > 1:
            _broadcast_step(input_ids, positions, attn_metadata, kv_caches[0].shape[1], kv_caches[0].dtype)
        return super().forward_features(input_ids, positions, attn_metadata, kv_caches, inputs_embeds, attn_mask,
                                        capture_layers=capture_layers)

    def close(self) -> None:
        """Rank 0: stop the other ranks and leave the group."""
        if self.rank != 0 or not self.workers:
            return
        workers, self.workers = self.workers, ()
        try:
            torch.distributed.broadcast(torch.zeros(6, dtype=torch.long, device=self.norm.weight.device), 0)
        except Exception:   # noqa: BLE001, S110 - a worker already gone: it is killed below
            pass
        for p in workers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        torch.distributed.destroy_process_group()


_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _broadcast_step(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, num_blocks: int,
                    kv_dtype: torch.dtype) -> None:
    t, b = ids.numel(), meta.num_seqs
    width = meta.block_tables.shape[1]
    dev = ids.device            # NCCL broadcasts device tensors, gloo CPU ones: the model's device
    head = torch.tensor([1, t, b, width, num_blocks, _DTYPES.index(kv_dtype)], dtype=torch.long, device=dev)
    torch.distributed.broadcast(head, 0)
    flat = torch.cat([ids.long(), pos.long(), torch.tensor(meta.query_start_loc, device=dev),
                      torch.tensor(meta.seq_lens, device=dev), meta.slot_mapping.to(dev),
                      meta.block_tables.to(dev).reshape(-1)])
    torch.distributed.broadcast(flat, 0)


def _worker_loop(model: TPModel, block_size: int, device: str = "cpu") -> None:
    """Ranks 1..: run every step rank 0 broadcasts, until it broadcasts op 0."""
    caches: list[torch.Tensor] = []
    cfg = model.config
    with torch.inference_mode():
        while True:
            head = torch.empty(6, dtype=torch.long, device=device)
            torch.distributed.broadcast(head, 0)
            op, t, b, width, num_blocks, dt = head.tolist()
            if op == 0:
                return
            flat = torch.empty(3 * t + 2 * b + 1 + b * width, dtype=torch.long, device=device)
            torch.distributed.broadcast(flat, 0)
            ids, pos, qsl, lens, slots, tables = flat.split([t, t, b + 1, b, t, b * width])
            if not caches or caches[0].shape[1] != num_blocks:
                shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
                caches = [torch.empty(shape, dtype=_DTYPES[dt], device=device) for _ in range(cfg.num_hidden_layers)]
            meta = AttentionMetadata(qsl.tolist(), lens.tolist(), slots, tables.view(b, width), block_size)
            model(ids, pos, meta, caches)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(rank: int) -> str:
    return f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"


def _load_full(model: str | None, device: str = "cpu"):
    return load_model(model, weight_format="fp32", backend=KernelBackend.pytorch(device))


def launch(model: str | None, world: int, *, block_size: int = 16, num_threads: int | None = None,
           timeout: float = 600):
    """Rank 0 in this process, ranks 1.. as child processes; returns (LoadedModel of the full
    model, rank 0's TPModel). Blocking."""
    loaded = _load_full(model, _device(0))
    check_supported(loaded.config, world)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    port = _free_port()
    spec = {"model": model, "world": world, "port": port, "parent_pid": os.getpid(), "block_size": block_size,
            "num_threads": num_threads, "backend": backend}
    workers = [subprocess.Popen([sys.executable, "-m", "kvserve.model.parallel", json.dumps({**spec, "rank": r})],
                                stdin=subprocess.DEVNULL) for r in range(1, world)]
    try:
        torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                             world_size=world, timeout=timedelta(seconds=timeout))
    except BaseException:
        for p in workers:
            p.kill()
            p.wait()
        raise
    tp = shard_model(loaded.model, 0, world)
    tp.workers = tuple(workers)
    atexit.register(tp.close)
    return loaded, tp


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(0)
        threading.Event().wait(1.0)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    threading.Thread(target=_watch_parent, args=(spec["parent_pid"],), daemon=True).start()
    if spec.get("num_threads"):
        torch.set_num_threads(spec["num_threads"])
    torch.distributed.init_process_group(spec["backend"], init_method=f"tcp://127.0.0.1:{spec['port']}",
                                         rank=spec["rank"], world_size=spec["world"], timeout=timedelta(hours=24))
    device = _device(spec["rank"])
    if device != "cpu":
        torch.cuda.set_device(device)
    loaded = _load_full(spec["model"], device)
    model = shard_model(loaded.model, spec["rank"], spec["world"])
    del loaded
    _worker_loop(model, spec["block_size"], device)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
