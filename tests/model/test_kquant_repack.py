"""The K-quant load-time repack in C (cpu/kvserve_repack_kquant.cpp) gives the same bytes as the
numpy code it replaced: Q4_K into the Q4 layout (gguf_linear.unpack_q4_k + kvs_pack_q4) and
Q4_K/Q5_K/Q6_K decoded and requantized into Q8_0 rows (kquants.q8_0_rows with native=False), on
random blocks with scales of either sign and any magnitude, and rows that leave a padded group."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvserve.model.kernels import kquants
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kernels.gguf_linear import unpack_q4_k

LIB = KernelBackend.detect().lib
pytestmark = pytest.mark.skipif(LIB is None, reason="compiled kernels unavailable")
SIZE = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
SCALES_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    raw = rng.integers(0, 256, size=(n, SIZE[qtype]), dtype=np.uint8)
    scales = (rng.standard_normal((n, 2)) * 10.0 ** rng.integers(-7, 3, (n, 1))).astype(np.float16)
    for k, a in enumerate(SCALES_AT[qtype]):
        raw[:, a:a + 2] = scales[:, k:k + 1].view(np.uint8)
    raw[:3, SCALES_AT[qtype][0]:SCALES_AT[qtype][0] + 2] = 0     # all-zero blocks: scale 0
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_q8_0_rows_in_c_equal_numpy(qtype):
    raw = random_blocks(qtype, 37, 1024, seed=int(qtype))
    want = kquants.q8_0_rows(raw, qtype, 1024, native=False)
    got = kquants.q8_0_rows(raw, qtype, 1024, lib=LIB)
    assert got.shape == want.shape
    assert np.array_equal(got, want)


def test_q4_k_repack_in_c_equals_numpy():
    rows, cols = 37, 768
    raw = random_blocks(Q.Q4_K, rows, cols, seed=5)
    n_qs, n_sc = LIB.kvs_packed_qs_bytes(0, rows, cols), LIB.kvs_packed_scales(rows, cols)
    want = [torch.empty(n_qs, dtype=torch.uint8), torch.empty(n_sc), torch.empty(n_sc)]
    q, d, m = unpack_q4_k(raw, rows)
    LIB.kvs_pack_q4(rows, cols, q.ctypes.data, d.ctypes.data, m.ctypes.data, *(t.data_ptr() for t in want))
    got = [torch.full((n_qs,), 7, dtype=torch.uint8), torch.full((n_sc,), 7.0), torch.full((n_sc,), 7.0)]
    LIB.kvs_repack_q4_k(raw.ctypes.data, rows, cols, *(t.data_ptr() for t in got))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))    # bit for bit, -0.0 too


@pytest.mark.parametrize("sdtype", [1, 0])
def test_q8_0_repack_equals_kvs_repack(sdtype):
    rows, cols = 37, 512
    raw = kquants.q8_0_rows(random_blocks(Q.Q6_K, rows, cols, seed=6), Q.Q6_K, cols, lib=LIB)
    n_qs, n_sc = LIB.kvs_packed_qs_bytes(1, rows, cols), LIB.kvs_packed_scales(rows, cols)
    dt = torch.float16 if sdtype else torch.float32
    want = [torch.empty(n_qs, dtype=torch.uint8), torch.empty(n_sc, dtype=dt)]
    assert LIB.kvs_repack(8, raw.ctypes.data, rows, cols, want[0].data_ptr(), want[1].data_ptr(), None, sdtype) == 0
    got = [torch.full((n_qs,), 7, dtype=torch.uint8), torch.full((n_sc,), 7.0, dtype=dt)]
    LIB.kvs_repack_q8_0(raw.ctypes.data, rows, cols, got[0].data_ptr(), got[1].data_ptr(), sdtype)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
