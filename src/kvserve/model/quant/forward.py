"""The whole layer stack of a packed-GGUF Llama in one C call (csrc/kvserve_forward.cpp).

For steps of a few tokens (single-stream decode, a handful of sequences) the per-layer PyTorch
path spends as long dispatching its ~10 small operations per layer as the matmuls take; the C
forward runs every layer inside one OpenMP region. It applies when every projection is a
GGUFQuantLinear on the int8 kernels and this step's token count is below the size where those
layers would switch to their bf16/fp32 GEMM paths, so the numerics are those of the per-layer
path over the same weights. Anything else (dense weights, fp16 KV cache, no compiled kernels,
large steps) returns None and the caller runs the PyTorch layers.
"""

from __future__ import annotations

import ctypes
import os

import torch

from kvserve.model.quant.attention import KV_DTYPE_CODES
from kvserve.model.quant.build import KvsWeight, load_kernels
from kvserve.model.quant.gguf_linear import GGUFQuantLinear

# Without a bf16/fp32 switch point (CPUs where the int8 kernel is the only path), steps up to this
# many tokens still go through the C forward.
DEFAULT_MAX_TOKENS = 16


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

    def __init__(self, model: torch.nn.Module, lib: ctypes.CDLL):
        cfg = model.config
        self.lib = lib
        self.model = model
        linears = [lin for layer in model.layers
                   for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        points = [p for p in map(_switch_point, linears) if p is not None]
        self.max_tokens = (min(points) - 1) if points else DEFAULT_MAX_TOKENS
        self.hidden = cfg.hidden_size
        # Keep every tensor the descriptors point into alive for the model's lifetime.
        self._keep = [model.rotary.cos.contiguous(), model.rotary.sin.contiguous(), model.norm.weight]
        self.layers = (KvsLayerDesc * len(model.layers))()
        for i, layer in enumerate(model.layers):
            for norm in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight):
                self._keep.append(norm.detach().float().contiguous())
            d = self.layers[i]
            d.attn_norm, d.ffn_norm = self._keep[-2].data_ptr(), self._keep[-1].data_ptr()
            d.qkv = ctypes.pointer(layer.qkv_proj._desc)
            d.o = ctypes.pointer(layer.o_proj._desc)
            d.gate_up = ctypes.pointer(layer.gate_up_proj._desc)
            d.down = ctypes.pointer(layer.down_proj._desc)
        first = model.layers[0]
        self.desc = KvsModelDesc(len(model.layers), cfg.hidden_size, first.num_heads, first.num_kv_heads,
                                 first.head_dim, first.intermediate_size, model.norm.eps, first.scale,
                                 self._keep[0].data_ptr(), self._keep[1].data_ptr(), self._keep[2].data_ptr(),
                                 self.layers)
        self.max_positions = self._keep[0].shape[0]
        self._cache_ptrs: tuple[int, ...] = ()

    @classmethod
    def build(cls, model: torch.nn.Module) -> FusedForward | None:
        """The fused forward for `model`, or None when its layers are not all packed int8 weights."""
        if os.environ.get("KVSERVE_FUSED_FORWARD", "1") == "0":
            return None
        lib = load_kernels()
        if lib is None or not len(model.layers):
            return None
        for layer in model.layers:
            if not all(map(_packed, (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))):
                return None
            if layer.num_heads % layer.num_kv_heads or layer.head_dim % 2:
                return None
        return cls(model, lib)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta, kv_caches: list[torch.Tensor]
                 ) -> torch.Tensor | None:
        """x [T, H] float32 embeddings (overwritten) -> final-normed hidden [T, H], or None."""
        T = x.shape[0]
        cache = kv_caches[0]
        if (T == 0 or T > self.max_tokens or x.dim() != 2 or cache.dtype not in KV_DTYPE_CODES
                or torch.is_grad_enabled() and x.requires_grad):
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
        if meta.is_all_decode:
            seq_of = torch.arange(T, dtype=torch.int64)
        else:
            seq_of = torch.repeat_interleave(torch.arange(len(qsl) - 1),
                                             torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]))
        tables = meta.block_tables.to(torch.int64).contiguous()
        _, num_blocks, block_size, _, _ = cache.shape
        out = torch.empty_like(x)
        rc = self.lib.kvs_forward(ctypes.byref(self.desc), KV_DTYPE_CODES[cache.dtype], num_blocks, block_size,
                                  x.data_ptr(), T, positions.data_ptr(), slots.data_ptr(), seq_of.data_ptr(),
                                  tables.data_ptr(), tables.shape[1], out.data_ptr(), self.lib.kvs_get_num_threads())
        return out if rc == 0 else None
