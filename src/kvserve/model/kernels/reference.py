"""Pure-PyTorch dequantization of GGUF block quants: the fallback path and a second reference.

Each takes the tensor's raw bytes as gguf.GGUFReader gives them (uint8, [rows, bytes_per_row])
and returns float32 [rows, cols]. Other types go through gguf.quants.dequantize (numpy).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

QK = 32
BLOCK_BYTES = {
    GGMLQuantizationType.Q4_0: 18,
    GGMLQuantizationType.Q4_1: 20,
    GGMLQuantizationType.Q8_0: 34,
}


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # byte j holds element j (low nibble) and element j + 16 (high nibble)
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()


def dequantize(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, cols: int) -> torch.Tensor:
    """raw uint8 [rows, bytes_per_row] -> float32 [rows, cols]."""
    if qtype not in BLOCK_BYTES:
        out = quants.dequantize(np.asarray(raw), qtype)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(-1, cols)
    r = torch.as_tensor(np.asarray(raw)) if not isinstance(raw, torch.Tensor) else raw
    rows = r.shape[0]
    blocks = r.reshape(rows, cols // QK, BLOCK_BYTES[qtype])
    if qtype == GGMLQuantizationType.Q4_0:
        w = (_nibbles(blocks[..., 2:]) - 8.0) * _f16(blocks, 0)
    elif qtype == GGMLQuantizationType.Q4_1:
        w = _nibbles(blocks[..., 4:]) * _f16(blocks, 0) + _f16(blocks, 2)
    else:  # Q8_0
        w = blocks[..., 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)
    return w.reshape(rows, cols)
