"""Fused CPU ops from csrc/kvserve_attention.cpp: paged decode attention and RMSNorm.

Each returns None when it does not apply (kernels unavailable, tensors not contiguous fp32 on CPU,
a step that is not all single-token queries) and the caller keeps its PyTorch path. The decode
attention reads K/V in place through the block tables, so the per-layer gather copy and the GQA
repeat of the PyTorch path disappear.
"""

from __future__ import annotations

import torch

from kvserve.model.quant.build import load_kernels


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: list[int] | torch.Tensor, scale: float) -> torch.Tensor | None:
    """q [B, Hq, D] float32 (one query token per sequence), kv_cache [2, num_blocks, block_size, Hkv, D]
    float32, block_tables [B, max_blocks] int64, seq_lens B ints -> [B, Hq, D], or None."""
    lib = load_kernels()
    if (lib is None or q.dtype != torch.float32 or kv_cache.dtype != torch.float32 or q.device.type != "cpu"
            or not kv_cache.is_contiguous() or q.dim() != 3):
        return None
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    b, hq, _ = q.shape
    if hq % hkv or block_tables.shape[0] != b:
        return None
    q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = torch.as_tensor(seq_lens, dtype=torch.int64).contiguous()
    out = torch.empty_like(q)
    lib.kvs_paged_decode_attention(q.data_ptr(), kv_cache.data_ptr(), num_blocks, block_size, hq, hkv, d,
                                   tables.data_ptr(), tables.shape[1], lens.data_ptr(), b, scale,
                                   out.data_ptr(), lib.kvs_get_num_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm over the last dim in one pass (x and weight float32 on CPU), or None if not applicable."""
    lib = load_kernels()
    if (lib is None or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or x.requires_grad or weight.requires_grad or x.shape[-1] != weight.shape[0]):
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    lib.kvs_rms_norm(x.data_ptr(), weight.data_ptr(), x.numel() // n, n, eps, y.data_ptr())
    return y
