"""The layer ops in C (cpu/kvserve_forward.cpp, cpu/kvserve_attention.cpp), for one model.

`CpuOps` implements model/ops.py's interface with the compiled kernels, two ways:

* `forward_stack`: one C call for the whole layer stack (`kvs_forward`), for steps of a few
  tokens (single-stream decode, a handful of sequences). There the per-layer path spends as long
  dispatching its small operations as the matmuls take; the C forward runs every layer inside one
  OpenMP region. It applies when every projection is a GGUFQuantLinear on the int8 kernels and the
  step is below the size where those layers switch to their bf16/fp32 GEMM paths, so the numerics
  are those of the per-layer path over the same weights.
* the per-layer ops for larger steps (batched decode, prompt chunks), any weight format: the
  decoder layer calls its own projections (oneDNN bf16 with AMX, MKL fp32, ...) and these ops in
  between: RMSNorm; RoPE + KV-cache write + paged attention in one call; SwiGLU. Every query
  token attends in C over its own prefix, so its numbers do not depend on how its prompt was
  chunked; with batch invariance off (backend.attn_c_max_query), a sequence with more query
  tokens than that in the step takes PyTorch's SDPA instead (a GEMM per head).

`prepare` returns None for what the C code does not handle (a KV cache other than fp32/bf16/fp16/int8,
non-contiguous caches, positions past the RoPE table, autograd), and the model runs its TorchOps.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvserve.model.attention import AttentionMetadata, attend, gather_kv
from kvserve.model.kernels.build import KvsWeight
from kvserve.model.kernels.gguf_linear import GGUFQuantLinear
from kvserve.model.lora import LoRABatch, c_terms
from kvserve.model.ops import Step, TorchOps

# the kernels' kv_dtype argument; int8: rows of head_dim values + an fp16 scale (model/kv_quant.py)
KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}


class KvsLayerDesc(ctypes.Structure):
    """Mirror of `struct kvs_layer_desc` in cpu/kvserve_forward.cpp."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                ("qkv", ctypes.POINTER(KvsWeight)), ("o", ctypes.POINTER(KvsWeight)),
                ("gate_up", ctypes.POINTER(KvsWeight)), ("down", ctypes.POINTER(KvsWeight)),
                ("kv_cache", ctypes.c_void_p), ("aux_slot", ctypes.c_int32),
                ("attn_out_norm", ctypes.c_void_p), ("ffn_out_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("window", ctypes.c_int32), ("local", ctypes.c_int32)]


class KvsPool(ctypes.Structure):
    """Mirror of `struct kvs_pool`: the sliding layers' own KV pool in a step (engine/kv_hybrid.py)."""

    _fields_ = [("slots", ctypes.c_void_p), ("tables", ctypes.c_void_p), ("max_blocks", ctypes.c_int32),
                ("num_blocks", ctypes.c_int32)]


class KvsModelDesc(ctypes.Structure):
    """Mirror of `struct kvs_model_desc` in cpu/kvserve_forward.cpp."""

    _fields_ = [("n_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("n_heads", ctypes.c_int32),
                ("n_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("inter", ctypes.c_int32),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
                ("layers", ctypes.POINTER(KvsLayerDesc)), ("attn_isa", ctypes.c_int32),
                ("softcap", ctypes.c_float), ("act", ctypes.c_int32), ("local", ctypes.POINTER(KvsPool))]


@dataclass
class CpuStep(Step):
    """A step as the C kernels read it: int64 index tensors and the cache layout."""

    slots: torch.Tensor | None = None
    seq_of: torch.Tensor | None = None        # [T] the sequence of each token
    tables: torch.Tensor | None = None
    kv_dtype: int = 0
    num_blocks: int = 0
    block_size: int = 0
    attend: torch.Tensor | None = None        # [T] uint8: 1 = attention in C, 0 = by SDPA (long chunks)
    long_seqs: tuple[tuple[int, int, int], ...] = ()
    local_slots: torch.Tensor | None = None   # the sliding layers' pool (meta.local), when it has its own
    local_tables: torch.Tensor | None = None
    local_blocks: int = 0
    pool: KvsPool | None = None                # what kvs_forward reads for the sliding layers


def is_int8(lin: torch.nn.Module | None) -> bool:
    """The projection runs the int8 kernels (packed GGUF weights with a C descriptor)."""
    return isinstance(lin, GGUFQuantLinear) and lin.desc is not None


def _projections(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    return layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj


class CpuOps(TorchOps):
    """The C layer ops over one model (its descriptors point into the model's weights)."""

    @staticmethod
    def suits(model: torch.nn.Module) -> bool:
        """The C glue handles this model's shapes (whole GQA groups, even head_dim) and features (the
        config's c_layer_ops: q/k norm per head, Gemma's norms, windows, soft-capping, GeGLU)."""
        return model.config.c_layer_ops and all(
            layer.num_heads % layer.num_kv_heads == 0 and layer.head_dim % 2 == 0 for layer in model.layers)

    def __init__(self, model: torch.nn.Module, backend) -> None:
        super().__init__(model.rotary, backend, model.rotary_local)
        self.lib = backend.lib
        first = model.layers[0]
        # Every projection on the int8 kernels: the one-call forward is available.
        self.packed = all(is_int8(lin) for layer in model.layers for lin in _projections(layer))
        self.max_tokens = backend.max_fused_tokens if self.packed else 0
        self.q_size, self.num_heads, self.head_dim = first.q_size, first.num_heads, first.head_dim
        self.scale = first.scale
        self.eps = model.norm.eps
        self.softcap = first.softcap
        # which layers read the sliding layers' pool when a step has one (meta.local)
        self.windows = [layer.sliding_window for layer in model.layers]
        # Keep every tensor the descriptors point into alive for the model's lifetime.
        self._keep = [model.rotary.cos.contiguous(), model.rotary.sin.contiguous(), model.norm.weight]
        if model.rotary_local is not None:
            self._keep += [model.rotary_local.cos.contiguous(), model.rotary_local.sin.contiguous()]
        self.max_positions = min(t.shape[0] for i, t in enumerate(self._keep) if i in (0, 3))
        self.layers = (KvsLayerDesc * len(model.layers))()
        for d, layer in zip(self.layers, model.layers):
            sandwich = layer.pre_feedforward_layernorm is not None   # Gemma: norms on both sides
            d.attn_norm = layer.input_layernorm.weight.data_ptr()
            d.ffn_norm = (layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm).weight.data_ptr()
            if sandwich:
                d.attn_out_norm = layer.post_attention_layernorm.weight.data_ptr()
                d.ffn_out_norm = layer.post_feedforward_layernorm.weight.data_ptr()
            if layer.qk_norm == "head":
                d.q_norm, d.k_norm = layer.q_norm.weight.data_ptr(), layer.k_norm.weight.data_ptr()
            if layer.local_rope:
                d.cos, d.sin = self._keep[3].data_ptr(), self._keep[4].data_ptr()
            d.window = layer.sliding_window or 0
            d.local = int(layer.sliding_window is not None)
            d.aux_slot = -1
            if self.packed:
                d.qkv, d.o, d.gate_up, d.down = (ctypes.pointer(lin.desc) for lin in _projections(layer))
        self.desc = KvsModelDesc(len(model.layers), model.config.hidden_size, first.num_heads,
                                 first.num_kv_heads, first.head_dim, first.intermediate_size, self.eps,
                                 first.scale, self._keep[0].data_ptr(), self._keep[1].data_ptr(),
                                 self._keep[2].data_ptr(), self.layers, backend.attn_isa, first.softcap or 0.0,
                                 int(first.act != "silu"))
        self._cache_ptrs: tuple[int, ...] = ()
        self._pool_blocks = (0, 0)   # num_blocks of the full layers' caches and of the sliding layers'
        self._capture: tuple[int, ...] = ()

    def prepare(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None,
                kv_caches: list[torch.Tensor] | None) -> CpuStep | None:
        if meta is None or not kv_caches or x.dim() != 2 or x.dtype != torch.float32 or x.requires_grad:
            return None
        T, cache = x.shape[0], kv_caches[0]
        if T == 0 or cache.dtype not in KV_DTYPE_CODES or x.device.type != "cpu":
            return None
        if int(positions.max()) >= self.max_positions:
            return None   # let the PyTorch path raise its own error
        if not self._bind(kv_caches):
            return None
        qsl = meta.query_start_loc
        q_lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
        if meta.is_all_decode:
            seq_of = torch.arange(T, dtype=torch.int64)
        elif T <= 64:   # a few rows (verified drafts, a short chunk): right after a forward, a list
            # took 29-36 us against repeat_interleave's 88-91 us (2 rows, Zen 5)
            seq_of = torch.tensor([i for i, n in enumerate(q_lens) for _ in range(n)], dtype=torch.int64)
        else:
            seq_of = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
        limit = self.backend.attn_c_max_query
        if self.softcap or any(self.windows) or self.desc.layers[0].q_norm:
            limit = None   # the SDPA path below knows none of these: every query attends in C
        long_seqs = () if limit is None else tuple(
            (i, qsl[i], qsl[i + 1]) for i, n in enumerate(q_lens) if n > limit)
        attend_mask = torch.ones(T, dtype=torch.uint8)
        for _, s, e in long_seqs:
            attend_mask[s:e] = 0
        full_blocks, local_blocks = self._pool_blocks
        step = CpuStep(positions.to(torch.int64).contiguous(), meta, slots=meta.slot_mapping.to(torch.int64).contiguous(),
                       seq_of=seq_of, tables=meta.block_tables.to(torch.int64).contiguous(),
                       kv_dtype=KV_DTYPE_CODES[cache.dtype], num_blocks=full_blocks, block_size=cache.shape[2],
                       attend=attend_mask, long_seqs=long_seqs)
        if meta.local is not None:   # the sliding layers' own pool (engine/kv_hybrid.py)
            step.local_slots = meta.local.slot_mapping.to(torch.int64).contiguous()
            step.local_tables = meta.local.block_tables.to(torch.int64).contiguous()
            step.local_blocks = local_blocks
        else:
            if local_blocks != full_blocks:
                return None
            step.local_slots, step.local_tables, step.local_blocks = step.slots, step.tables, full_blocks
        step.pool = KvsPool(step.local_slots.data_ptr(), step.local_tables.data_ptr(), step.local_tables.shape[1],
                            step.local_blocks)
        self.desc.local = ctypes.pointer(step.pool)
        self._pool = step.pool   # alive while the descriptor points at it
        return step

    def _bind(self, kv_caches: list[torch.Tensor]) -> bool:
        """Point the layer descriptors at these caches; False if the C code cannot read them."""
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if ptrs != self._cache_ptrs:
            # every full layer's cache one shape, every sliding layer's another (its own pool's size)
            shapes = {w is not None: c.shape for w, c in zip(self.windows, kv_caches)}
            cache = kv_caches[0]
            if not all(c.is_contiguous() and c.dtype == cache.dtype and c.shape == shapes[w is not None]
                       and c.shape[2:] == cache.shape[2:] for w, c in zip(self.windows, kv_caches)):
                return False
            full = shapes.get(False, shapes.get(True))
            self._pool_blocks = (full[1], shapes.get(True, full)[1])
            for d, p in zip(self.layers, ptrs):
                d.kv_cache = p
            self._cache_ptrs = ptrs
        return True

    def draft_step(self, feats: torch.Tensor, tokens: list[int], embed: GGUFQuantLinear, fc: GGUFQuantLinear,
                   head: GGUFQuantLinear, positions: list[int], slots: list[int], seq_of: list[int],
                   tables: list[int], max_blocks: int, last: list[int], kv_caches: list[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An EAGLE draft step in one C call (`kvs_draft_step`): rows fc([feats ; embed(tokens)]) through
        the layer stack at `positions` (cache `slots`, sequence `seq_of` of the block `tables`, rows of
        `max_blocks` flattened), then for the rows `last`: (argmax over `head`'s rows [n], final-normed
        state [n, H]). The same numbers as the model forward between the packed fc and head; None
        where that path must run (weights not on the int8 kernels, a cache the C code does not read,
        too many rows)."""
        T, n = len(tokens), len(last)
        if (not self.packed or T > self.max_tokens or any(self.windows) or not all(is_int8(w) for w in (embed, fc, head))
                or kv_caches[0].dtype not in KV_DTYPE_CODES or not self._bind(kv_caches)
                or max(positions) >= self.max_positions):
            return None
        H = self.desc.hidden
        feats = feats.contiguous()
        # every index list in one int64 tensor (a tensor each cost ~3 us after the forward), and one
        # float32 scratch: x, out [T, H], logits [n, V]
        idx = torch.tensor(tokens + positions + slots + seq_of + last + tables, dtype=torch.int64)
        ptr = idx.data_ptr()
        tok, pos, slot, seq, lst, tab = (ptr + 8 * o for o in (0, T, 2 * T, 3 * T, 4 * T, 4 * T + n))
        scratch = torch.empty(2 * T * H + n * head.out_features)
        hidden = torch.empty(n, H)
        arg = torch.empty(n, dtype=torch.int64)
        s = scratch.data_ptr()
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        rc = self.lib.kvs_draft_step(
            ctypes.byref(self.desc), KV_DTYPE_CODES[kv_caches[0].dtype], num_blocks, block_size, feats.data_ptr(),
            feats.shape[1], tok, embed._desc_ptr, fc._desc_ptr, head._desc_ptr, T, pos, slot, seq, tab, max_blocks,
            lst, n, s, s + 4 * T * H, hidden.data_ptr(), s + 8 * T * H, arg.data_ptr(),
            self.lib.kvs_get_num_threads())
        if rc == -2:
            raise IndexError(f"token id out of range [0, {embed.out_features})")
        return (arg, hidden) if rc == 0 else None

    def set_capture(self, layers: tuple[int, ...]) -> None:
        """The layers whose residual stream forward_stack copies out, RMS-normalised (aux slots in
        this order)."""
        if layers == self._capture:     # every step asks: the descriptors change only with the layers
            return
        for i, d in enumerate(self.layers):
            d.aux_slot = layers.index(i) if i in layers else -1
        self._capture = layers

    def forward_stack(self, x: torch.Tensor, step: CpuStep, kv_caches: list[torch.Tensor] | None,
                      lora: LoRABatch | None = None, aux: torch.Tensor | None = None) -> torch.Tensor | None:
        """aux: [T, n, H] to receive the residual stream after the set_capture layers, each row
        RMS-normalised without a weight (model.decoder.FeatureNorm), or None."""
        T = x.shape[0]
        if T > self.max_tokens:
            return None
        x = x.contiguous()
        out = torch.empty_like(x)
        args = (ctypes.byref(self.desc), step.kv_dtype, step.num_blocks, step.block_size, x.data_ptr(), T,
                step.positions.data_ptr(), step.slots.data_ptr(), step.seq_of.data_ptr(), step.tables.data_ptr(),
                step.tables.shape[1], out.data_ptr(), self.lib.kvs_get_num_threads())
        if lora is None and aux is None:
            rc = self.lib.kvs_forward(*args)
        else:
            lora_args = (None, 0, None)
            if lora is not None:   # LoRA rows (model/lora.py): the same stack, each adapted row adding its B (A x)
                terms, row_slot = c_terms(lora, T, len(self.layers))
                lora_args = (ctypes.byref(terms), len(lora.groups), row_slot.data_ptr())
            aux_args = (None, 0) if aux is None else (aux.data_ptr(), aux.shape[1])
            rc = self.lib.kvs_forward_lora(*args, *lora_args, *aux_args)
        return out if rc == 0 else None

    def rms_norm(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        self.lib.kvs_rms_norm(x.data_ptr(), norm.weight.data_ptr(), x.shape[0], x.shape[1], norm.eps, y.data_ptr())
        return y

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        gu = gu.contiguous()
        out = torch.empty(gu.shape[0], gu.shape[1] // 2)
        self.lib.kvs_silu_mul(gu.data_ptr(), gu.shape[0], out.shape[1], out.data_ptr(), self.lib.kvs_get_num_threads())
        return out

    def gelu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        gu = gu.contiguous()
        out = torch.empty(gu.shape[0], gu.shape[1] // 2)
        self.lib.kvs_gelu_mul(gu.data_ptr(), gu.shape[0], out.shape[1], out.data_ptr(), self.lib.kvs_get_num_threads())
        return out

    def attention(self, qkv: torch.Tensor, layer: torch.nn.Module, step: CpuStep,
                  kv_cache: torch.Tensor | None) -> torch.Tensor:
        """RoPE on q and k in place, K/V written to the cache, attention of every token whose
        sequence is short in this step; long chunks then attend with SDPA over the cache."""
        T = qkv.shape[0]
        qkv = qkv.contiguous()
        out = torch.empty(T, self.q_size)
        local = layer.sliding_window is not None
        slots, tables = (step.local_slots, step.local_tables) if local else (step.slots, step.tables)
        self.lib.kvs_rope_kv_attention(
            ctypes.byref(self.desc), layer.index, qkv.data_ptr(), T, step.positions.data_ptr(), slots.data_ptr(),
            step.seq_of.data_ptr(), tables.data_ptr(), tables.shape[1], kv_cache.data_ptr(),
            step.kv_dtype, step.local_blocks if local else step.num_blocks, step.block_size, step.attend.data_ptr(),
            out.data_ptr(), self.lib.kvs_get_num_threads())
        for i, s, e in step.long_seqs:   # rotated q of the chunk, K/V (already written) from the cache
            q = qkv[s:e, :self.q_size].view(e - s, self.num_heads, self.head_dim)
            k, v = gather_kv(kv_cache, step.tables[i], step.meta.seq_lens[i])
            out[s:e] = attend(q, k.float(), v.float(), self.scale).reshape(e - s, self.q_size)
        return out


def paged_decode_attention(lib: ctypes.CDLL, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: list[int] | torch.Tensor, scale: float) -> torch.Tensor | None:
    """The C decode attention, reading K/V in place through the block tables (no gather copy, no
    GQA repeat). q [B, Hq, D] float32 (one query per sequence, at position seq_lens[i] - 1),
    kv_cache [2, num_blocks, block_size, Hkv, D] fp32/bf16/fp16 (int8: D + 2), block_tables [B, max_blocks]
    -> [B, Hq, D], or None where it does not apply."""
    if (q.dtype != torch.float32 or kv_cache.dtype not in KV_DTYPE_CODES or q.device.type != "cpu"
            or not kv_cache.is_contiguous() or q.dim() != 3):
        return None
    _, num_blocks, block_size, hkv, _ = kv_cache.shape
    b, hq, d = q.shape
    if hq % hkv or block_tables.shape[0] != b:
        return None
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    positions = torch.as_tensor(seq_lens, dtype=torch.int64) - 1
    seq_of = torch.arange(b, dtype=torch.int64)
    out = torch.empty_like(q)
    lib.kvs_paged_attention(q.data_ptr(), kv_cache.data_ptr(), KV_DTYPE_CODES[kv_cache.dtype], num_blocks,
                            block_size, hq, hkv, d, tables.data_ptr(), tables.shape[1], seq_of.data_ptr(),
                            positions.data_ptr(), b, scale, out.data_ptr(), lib.kvs_get_num_threads())
    return out
