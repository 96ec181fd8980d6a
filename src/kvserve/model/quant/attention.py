"""Fused CPU ops from csrc/kvserve_attention.cpp: paged decode attention (fp32, bf16 or fp16 KV) and RMSNorm.

Each returns None when it does not apply (kernels unavailable, tensors not contiguous fp32 on CPU,
a step that is not all single-token queries) and the caller keeps its PyTorch path. The decode
attention reads K/V in place through the block tables, so the per-layer gather copy and the GQA
repeat of the PyTorch path disappear.
"""

from __future__ import annotations

import torch

from kvserve.model.quant.build import load_kernels

KV_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # what the C kernels read (kv_dtype argument)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: list[int] | torch.Tensor, scale: float) -> torch.Tensor | None:
    """q [B, Hq, D] float32 (one query token per sequence, at position seq_lens[i] - 1), kv_cache
    [2, num_blocks, block_size, Hkv, D] float32, bfloat16 or float16, block_tables [B, max_blocks] int64,
    seq_lens B ints -> [B, Hq, D], or None."""
    lib = load_kernels()
    if (lib is None or q.dtype != torch.float32 or kv_cache.dtype not in KV_DTYPE_CODES or q.device.type != "cpu"
            or not kv_cache.is_contiguous() or q.dim() != 3):
        return None
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    b, hq, _ = q.shape
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
