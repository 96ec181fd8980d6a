"""The fast Q4_0/Q4_1 load-time repack (cpu/kvserve_repack_q4.cpp: 4-byte runs, all threads) gives
kvs_repack's bytes and return codes: random blocks with scales of any magnitude and sign, rows
that leave a padded group, both scale dtypes, and a Q4_0 scale whose minimum -8 d is not a
float16 (code 1: the loader retries with float32 scales)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.model.kernels.backend import KernelBackend

LIB = KernelBackend.detect().lib
pytestmark = pytest.mark.skipif(LIB is None, reason="compiled kernels unavailable")


def random_rows(ggml_type: int, rows: int, cols: int, seed: int, huge: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    bsz, n = (18 if ggml_type == 2 else 20), rows * cols // 32
    raw = rng.integers(0, 256, size=(n, bsz), dtype=np.uint8)
    n_scales = 1 if ggml_type == 2 else 2
    scales = (rng.standard_normal((n, n_scales)) * 10.0 ** rng.integers(-7, 3, (n, 1))).astype(np.float16)
    if huge:
        scales[n // 2, 0] = 9000.0      # -8 d = -72000: beyond float16
    raw[:, :2 * n_scales] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def repack(fn, ggml_type: int, raw: np.ndarray, rows: int, cols: int, sdtype: int, fill: int):
    n_qs, n_sc = LIB.kvs_packed_qs_bytes(0, rows, cols), LIB.kvs_packed_scales(rows, cols)
    dt = torch.float16 if sdtype else torch.float32
    out = [torch.full((n_qs,), fill, dtype=torch.uint8), torch.full((n_sc,), fill, dtype=dt),
           torch.full((n_sc,), fill, dtype=dt)]
    rc = fn(ggml_type, raw.ctypes.data, rows, cols, *(t.data_ptr() for t in out), sdtype)
    return rc, out


@pytest.mark.parametrize("rows", [37, 64, 5])
@pytest.mark.parametrize("sdtype", [1, 0])
@pytest.mark.parametrize("ggml_type", [2, 3], ids=["Q4_0", "Q4_1"])
def test_fast_q4_repack_equals_kvs_repack(ggml_type, sdtype, rows):
    cols = 256
    raw = random_rows(ggml_type, rows, cols, seed=rows * 10 + ggml_type)
    rc_want, want = repack(LIB.kvs_repack, ggml_type, raw, rows, cols, sdtype, 0)
    rc_got, got = repack(LIB.kvs_repack_q4, ggml_type, raw, rows, cols, sdtype, 7)
    assert rc_got == rc_want == 0
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))    # bit for bit, -0.0 too


def test_fast_q4_0_repack_reports_a_minimum_beyond_float16():
    rows, cols = 37, 256
    raw = random_rows(2, rows, cols, seed=3, huge=True)
    assert repack(LIB.kvs_repack_q4, 2, raw, rows, cols, 1, 7)[0] == repack(LIB.kvs_repack, 2, raw, rows, cols, 1, 0)[0] == 1
    rc_want, want = repack(LIB.kvs_repack, 2, raw, rows, cols, 0, 0)
    rc_got, got = repack(LIB.kvs_repack_q4, 2, raw, rows, cols, 0, 7)
    assert rc_got == rc_want == 0
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_fast_q4_repack_rejects_other_types():
    raw = random_rows(2, 16, 32, seed=1)
    assert repack(LIB.kvs_repack_q4, 8, raw, 16, 32, 1, 0)[0] == -1
