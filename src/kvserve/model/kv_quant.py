"""The 8-bit KV cache: one int8 row per (token, KV head) with its own fp16 scale at the end.

    fp16 cache  [2, num_blocks, block_size, Hkv, D]       D * 2 bytes per row
    int8 cache  [2, num_blocks, block_size, Hkv, D + 2]   D int8 values, then the row's scale
                                                          as fp16 in the last 2 bytes: D + 2 bytes

    scale = fp16(max|x| / 127);  q = clamp(round_half_even(x / scale), -127, 127);  x' = q * scale

A row is quantized alone, from its own values only, when its token is written, so what a token's
K/V become never depends on the batch, the chunking of its prompt or what else is cached (batch
invariance), and a cached row never changes afterwards (prefix caching, rollback by position).
Readers widen a row as float(q) * float(scale) in fp32 (one rounding), in the C kernels and here
alike. For head_dim 64 that is 66 bytes per row against fp16's 128: 1.94x the tokens per byte.

Everything above the cache layout (scheduler, block manager) is unchanged; the dtype reaches the
attention code through the cache tensor itself (torch.int8).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2     # fp16 scale after the D values of each row
KV_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16, "int8": torch.int8, "auto": torch.float16}


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of the cache's last dimension for a head of `head_dim` values."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, row_width(head_dim, dtype))


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes over all layers (K and V)."""
    item = torch.empty(0, dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * row_width(head_dim, dtype) * item


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 [..., D + 2] rows with their fp16 scales."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / 127.0).half()
    s = scale.float()
    q = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8).reshape(*scale.shape[:-1], SCALE_BYTES)], dim=-1)


def dequantize_rows(c: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows [..., D + 2] -> [..., D] in `dtype` (float32 math, then cast)."""
    scale = c[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()
    out = c[..., :-SCALE_BYTES].float() * scale
    return out if dtype == torch.float32 else out.to(dtype)


def to_compute(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V rows as `dtype` for the PyTorch attention paths, whatever the cache dtype."""
    return dequantize_rows(c, dtype) if c.dtype == torch.int8 else c.to(dtype)
