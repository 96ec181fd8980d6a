"""A Q4_0 projection on the AVX2 tiles keeps no minima (kvs_weight.m NULL: the tiles form -8 d from
the float16 d): its outputs are the same bits as with the minima read from memory, for decode-sized
and prompt-sized calls and rows that leave a padded group, its dequantized rows and block scales
are unchanged, and the pack cache round-trips it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kernels.gguf_linear import GGUFQuantLinear

BACKEND = KernelBackend.detect(isa="avx2")
pytestmark = pytest.mark.skipif(BACKEND.lib is None, reason="compiled kernels unavailable")


def q4_0_rows(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = rows * cols // 32
    raw = rng.integers(0, 256, size=(n, 18), dtype=np.uint8)
    raw[:, :2] = (rng.standard_normal((n, 1)) * 0.02).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("rows", [37, 64])
def test_q4_0_without_minima_gives_the_same_bits(rows):
    cols = 256
    layer = GGUFQuantLinear(q4_0_rows(rows, cols, rows), GGMLQuantizationType.Q4_0, cols, rows, backend=BACKEND)
    assert layer.desc.m is None and layer.m.numel() == 0      # nothing kept, nothing read
    x = torch.randn(19, cols)
    got = [layer(x[:1]), layer(x[:5]), layer(x)]
    dq_got, (d, m) = layer.dequantized_weight(), layer.block_scales()
    kept = (layer.d.float() * -8.0).to(layer.d.dtype)         # the minima the repack would store
    layer.desc.m = kept.data_ptr()                             # the tile that reads them
    want = [layer(x[:1]), layer(x[:5]), layer(x)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(dq_got, layer.dequantized_weight())
    assert torch.equal(m, d * -8.0)
