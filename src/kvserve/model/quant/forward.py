"""The Llama layer stack with its glue in C (csrc/kvserve_forward.cpp), two ways.

* One call for the whole stack (`kvs_forward`), for steps of a few tokens (single-stream decode, a
  handful of sequences). There the per-layer PyTorch path spends as long dispatching its ~40 small
  operations per layer as the matmuls take; the C forward runs every layer inside one OpenMP region.
  It applies when every projection is a GGUFQuantLinear on the int8 kernels and the step's token
  count is below the size where those layers switch to their bf16/fp32 GEMM paths, so the numerics
  are those of the per-layer path over the same weights.
* A Python loop over layers for larger steps (batched decode, prompt chunks), any weight format:
  the projections are the layers' own (oneDNN bf16 with AMX, MKL fp32, ...), and what lies between
  them is a few C calls: RMSNorm; RoPE + KV-cache write + paged attention in one; SwiGLU. Long
  prompt chunks (more than ATTN_C_MAX_QUERY tokens of one sequence) take PyTorch's SDPA instead,
  which is faster there (a GEMM per head).

Anything unsupported (a KV cache other than fp32/bf16/fp16, no compiled kernels, autograd) returns None and the caller
runs the PyTorch layers, which stay the reference the tests compare against.
"""

from __future__ import annotations

import ctypes
import os

import torch

from kvserve.model.attention import attend as attend_sdpa
from kvserve.model.attention import gather_kv
from kvserve.model.quant.attention import KV_DTYPE_CODES
from kvserve.model.quant.build import KvsWeight, load_kernels
from kvserve.model.quant.gguf_linear import GGUFQuantLinear

# Without a bf16/fp32 switch point (CPUs where the int8 kernel is the only path), steps up to this
# many tokens still go through the C forward.
DEFAULT_MAX_TOKENS = 16
# A sequence contributing more query tokens than this to a step gets its attention from SDPA.
ATTN_C_MAX_QUERY = 16


class KvsLayerDesc(ctypes.Structure):
    """Mirror of `struct kvs_layer_desc` in csrc/kvserve_forward.cpp."""

    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                ("qkv", ctypes.POINTER(KvsWeight)), ("o", ctypes.POINTER(KvsWeight)),
                ("gate_up", ctypes.POINTER(KvsWeight)), ("down", ctypes.POINTER(KvsWeight)),
                ("kv_cache", ctypes.c_void_p)]


class KvsModelDesc(ctypes.Structure):
    """Mirror of `struct kvs_model_desc` in csrc/kvserve_forward.cpp."""

    _fields_ = [("n_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("n_heads", ctypes.c_int32),
                ("n_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("inter", ctypes.c_int32),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
                ("layers", ctypes.POINTER(KvsLayerDesc))]


def _packed(layer: torch.nn.Module) -> bool:
    return isinstance(layer, GGUFQuantLinear) and layer.weight_f32 is None and hasattr(layer, "_desc")


def _switch_point(layer: GGUFQuantLinear) -> int | None:
    """Token count from which this layer leaves the int8 kernel (None: never)."""
    points = [p for p in (layer.bf16_min_tokens, layer.f32_min_tokens) if p is not None]
    return min(points) if points else None


class FusedForward:
    """Callable over one model: (x, positions, meta, kv_caches) -> final hidden [T, H], or None."""

    def __init__(self, model: torch.nn.Module, lib: ctypes.CDLL, packed: bool):
        cfg = model.config
        self.lib = lib
        self.model = model
        self.packed = packed   # every projection on the int8 kernels: the one-call path is available
        if packed:
            linears = [lin for layer in model.layers
                       for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
            points = [p for p in map(_switch_point, linears) if p is not None]
            self.max_tokens = (min(points) - 1) if points else DEFAULT_MAX_TOKENS
        else:
            self.max_tokens = 0
        first = model.layers[0]
        self.num_heads, self.head_dim = first.num_heads, first.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.scale = first.scale
        # Keep every tensor the descriptors point into alive for the model's lifetime.
        self._keep = [model.rotary.cos.contiguous(), model.rotary.sin.contiguous(), model.norm.weight]
        self.norms: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.layers = (KvsLayerDesc * len(model.layers))()
        for i, layer in enumerate(model.layers):
            pair = tuple(n.weight.detach().float().contiguous()
                         for n in (layer.input_layernorm, layer.post_attention_layernorm))
            self.norms.append(pair)
            d = self.layers[i]
            d.attn_norm, d.ffn_norm = pair[0].data_ptr(), pair[1].data_ptr()
            if packed:
                d.qkv = ctypes.pointer(layer.qkv_proj._desc)
                d.o = ctypes.pointer(layer.o_proj._desc)
                d.gate_up = ctypes.pointer(layer.gate_up_proj._desc)
                d.down = ctypes.pointer(layer.down_proj._desc)
        self.desc = KvsModelDesc(len(model.layers), cfg.hidden_size, first.num_heads, first.num_kv_heads,
                                 first.head_dim, first.intermediate_size, model.norm.eps, first.scale,
                                 self._keep[0].data_ptr(), self._keep[1].data_ptr(), self._keep[2].data_ptr(),
                                 self.layers)
        self.eps = model.norm.eps
        self.max_positions = self._keep[0].shape[0]
        self._cache_ptrs: tuple[int, ...] = ()

    @classmethod
    def build(cls, model: torch.nn.Module) -> FusedForward | None:
        """The C-glued forward for `model`, or None (no compiled kernels, odd head shapes)."""
        if os.environ.get("KVSERVE_FUSED_FORWARD", "1") == "0":
            return None
        lib = load_kernels()
        if lib is None or not len(model.layers):
            return None
        packed = True
        for layer in model.layers:
            if layer.num_heads % layer.num_kv_heads or layer.head_dim % 2:
                return None
            packed = packed and all(map(_packed, (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                   layer.down_proj)))
        return cls(model, lib, packed)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta, kv_caches: list[torch.Tensor]
                 ) -> torch.Tensor | None:
        """x [T, H] float32 embeddings (overwritten) -> final-normed hidden [T, H], or None."""
        T = x.shape[0]
        cache = kv_caches[0]
        if T == 0 or x.dim() != 2 or cache.dtype not in KV_DTYPE_CODES or x.requires_grad:
            return None
        if int(positions.max()) >= self.max_positions:
            return None   # let the PyTorch path raise its own error
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if ptrs != self._cache_ptrs:
            if not all(c.is_contiguous() and c.dtype == cache.dtype and c.shape == cache.shape for c in kv_caches):
                return None
            for d, p in zip(self.layers, ptrs):
                d.kv_cache = p
            self._cache_ptrs = ptrs
        x = x.contiguous()
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        qsl = meta.query_start_loc
        q_lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
        if meta.is_all_decode:
            seq_of = torch.arange(T, dtype=torch.int64)
        else:
            seq_of = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
        tables = meta.block_tables.to(torch.int64).contiguous()
        _, num_blocks, block_size, _, _ = cache.shape
        kv_dtype = KV_DTYPE_CODES[cache.dtype]
        nth = self.lib.kvs_get_num_threads()
        if T <= self.max_tokens:
            out = torch.empty_like(x)
            rc = self.lib.kvs_forward(ctypes.byref(self.desc), kv_dtype, num_blocks, block_size, x.data_ptr(), T,
                                      positions.data_ptr(), slots.data_ptr(), seq_of.data_ptr(), tables.data_ptr(),
                                      tables.shape[1], out.data_ptr(), nth)
            return out if rc == 0 else None
        # Larger steps: the layers' own projections, C between them.
        long_seqs = [(i, qsl[i], qsl[i + 1]) for i, n in enumerate(q_lens) if n > ATTN_C_MAX_QUERY]
        attend = torch.ones(T, dtype=torch.uint8)
        for _, s, e in long_seqs:
            attend[s:e] = 0
        lib, desc = self.lib, ctypes.byref(self.desc)
        for layer, (n1, n2), cache in zip(self.model.layers, self.norms, kv_caches):
            qkv = layer.qkv_proj(self._rms_norm(x, n1)).contiguous()
            attn = torch.empty(T, self.q_size)
            lib.kvs_rope_kv_attention(desc, qkv.data_ptr(), T, positions.data_ptr(), slots.data_ptr(),
                                      seq_of.data_ptr(), tables.data_ptr(), tables.shape[1], cache.data_ptr(),
                                      kv_dtype, num_blocks, block_size, attend.data_ptr(), attn.data_ptr(), nth)
            for i, s, e in long_seqs:   # rotated q of the chunk, K/V (already written) from the cache
                q = qkv[s:e, :self.q_size].view(e - s, self.num_heads, self.head_dim)
                k, v = gather_kv(cache, tables[i], meta.seq_lens[i])
                attn[s:e] = attend_sdpa(q, k.float(), v.float(), self.scale).reshape(e - s, self.q_size)
            x += layer.o_proj(attn)
            gu = layer.gate_up_proj(self._rms_norm(x, n2)).contiguous()
            act = torch.empty(T, gu.shape[1] // 2)
            lib.kvs_silu_mul(gu.data_ptr(), T, act.shape[1], act.data_ptr(), nth)
            x += layer.down_proj(act)
        return self._rms_norm(x, self.model.norm.weight)

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        self.lib.kvs_rms_norm(x.data_ptr(), w.data_ptr(), x.shape[0], x.shape[1], self.eps, y.data_ptr())
        return y
