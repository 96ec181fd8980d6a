"""Issue 58's K-quant layout: Q4_K held with its own super-block scales (kernel qtype 2: fp16 d and
dmin, the 6-bit scales and minima as bytes, cpu/kvserve_kernels.cpp) instead of float32 scales
per 32 values. The kernels form d * sc and -(dmin * mn) themselves; both are exact products, so
every output has the bits the per-block float32 layout gave (the same arithmetic contract), on
every batch size, and the layer reads about the file's bytes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants
from test_kernels import assert_threads_agree
from test_kquant_repack import random_blocks

from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kernels.build import KvsWeight
from kvserve.model.kernels.gguf_linear import GGUFQuantLinear

BACKEND = KernelBackend.detect()
LIB = BACKEND.lib
pytestmark = pytest.mark.skipif(LIB is None, reason="compiled kernels unavailable")


def int8_layer(raw: np.ndarray, rows: int, cols: int) -> GGUFQuantLinear:
    from dataclasses import replace

    return GGUFQuantLinear(raw, Q.Q4_K, cols, rows, backend=replace(BACKEND, bf16_min_tokens=None,
                                                                     f32_min_tokens=None))


def old_layout(raw: np.ndarray, rows: int, cols: int):
    """The per-32-value float32 layout (qtype 0) the kernels used for Q4_K before."""
    qs = torch.empty(LIB.kvs_packed_qs_bytes(0, rows, cols), dtype=torch.uint8)
    d = torch.empty(LIB.kvs_packed_scales(rows, cols))
    m = torch.empty(LIB.kvs_packed_scales(rows, cols))
    LIB.kvs_repack_q4_k(raw.ctypes.data, rows, cols, qs.data_ptr(), d.data_ptr(), m.data_ptr())
    desc = KvsWeight(0, rows, cols, BACKEND.gemm_isa, 0, qs.data_ptr(), d.data_ptr(), m.data_ptr(), None)
    return desc, (qs, d, m)


def run(desc: KvsWeight, x: torch.Tensor, rows: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], rows)
    LIB.kvs_linear(ctypes.addressof(desc), x.data_ptr(), x.shape[0], y.data_ptr())
    return y


def extreme_activations(cols: int) -> torch.Tensor:
    """Five rows of activations: all +1, all -1, alternating per value, alternating per 16 values
    (each row quantizes to codes of +-127 only), and a random one."""
    k = torch.arange(cols)
    return torch.stack([torch.ones(cols), -torch.ones(cols), torch.where(k % 2 == 0, 1.0, -1.0),
                        torch.where(k % 32 < 16, 1.0, -1.0), torch.randn(cols, generator=torch.Generator().manual_seed(3))])


def assert_rows_alone(layer: GGUFQuantLinear, x: torch.Tensor, full: torch.Tensor, spans) -> None:
    """`layer` on each span x[t0:t1] gives those rows of `full` (its output on all of x), bit for bit."""
    for t0, t1 in spans:
        assert torch.equal(layer(x[t0:t1]), full[t0:t1]), (t0, t1)


def prefixes(*lengths: int) -> list[tuple[int, int]]:
    return [(0, T) for T in lengths]


@pytest.mark.parametrize("rows,cols", [(37, 768), (64, 256), (5, 512), (45, 512)])
def test_same_bits_as_the_float32_scale_layout(rows, cols):
    raw = random_blocks(Q.Q4_K, rows, cols, seed=rows)
    layer = int8_layer(raw, rows, cols)
    assert layer.desc.qtype == 2 and layer.desc.sdtype == 2 and layer.m.numel() == 0
    desc, keep = old_layout(raw, rows, cols)
    assert torch.equal(layer.qs, keep[0])                   # the codes are laid out as before
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(3))
    want = run(desc, x, rows)
    assert_rows_alone(layer, x, want, prefixes(1, 2, 3, 5, 16, 17, 70))   # every tile width, AMX-sized steps too
    d, m = layer.block_scales()                             # the scales the kernels form, bit for bit
    nb = cols // 32
    old_d = keep[1].view(-1, nb, 16).transpose(1, 2).reshape(-1, nb)[:rows]
    old_m = keep[2].view(-1, nb, 16).transpose(1, 2).reshape(-1, nb)[:rows]
    assert torch.equal(d.view(torch.int32), old_d.view(torch.int32))
    assert torch.equal(m.view(torch.int32), old_m.view(torch.int32))


def test_dequantized_equals_gguf_and_output_within_int8_tolerance():
    rows, cols = 48, 1024
    raw = random_blocks(Q.Q4_K, rows, cols, seed=9)
    blocks = raw.reshape(-1, 144).copy()                     # sane magnitudes for the tolerance check
    blocks[:, 0:4] = np.full((blocks.shape[0], 2), 4e-3, np.float16).view(np.uint8)
    raw = blocks.reshape(rows, -1)
    layer = int8_layer(raw, rows, cols)
    ref = torch.from_numpy(gguf_quants.dequantize(raw, Q.Q4_K).reshape(rows, cols)).double()
    assert torch.equal(layer.dequantized_weight().double(), ref)
    ids = torch.tensor([0, 47, 16, 15])
    assert torch.equal(layer.rows(ids).double(), ref[ids])
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(4))
    y, want = layer(x).double(), x.double() @ ref.T
    assert float((y - want).norm() / want.norm()) < 0.02


def test_layer_reads_about_the_files_bytes():
    rows, cols = 2048, 2048
    raw = random_blocks(Q.Q4_K, rows, cols, seed=1)
    layer = int8_layer(raw, rows, cols)
    held = layer.qs.numel() + layer.d.numel() * layer.d.element_size() + layer.m.numel() * layer.m.element_size()
    assert held == rows * cols // 256 * 148                  # 148 bytes per 256 values; the file has 144
    assert held <= 1.03 * raw.nbytes


def test_thread_counts_give_the_same_bits():
    rows, cols = 160, 512
    layer = int8_layer(random_blocks(Q.Q4_K, rows, cols, seed=2), rows, cols)
    assert_threads_agree(LIB, layer, torch.randn(21, cols, generator=torch.Generator().manual_seed(5)))


def random_q5(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return gguf_quants.quantize(w, qtype)


def test_q5_0_is_exactly_q8_0_blocks():
    from kvserve.model.kernels import kquants

    rows, cols = 37, 256
    raw = random_q5(Q.Q5_0, rows, cols, seed=7)
    as_q8 = kquants.q8_0_rows(raw, Q.Q5_0, cols)
    want = gguf_quants.dequantize(raw, Q.Q5_0).reshape(rows, cols)
    assert np.array_equal(gguf_quants.dequantize(as_q8, Q.Q8_0).reshape(rows, cols), want)
    layer = GGUFQuantLinear(raw, Q.Q5_0, cols, rows, backend=BACKEND)
    assert layer.desc is not None and layer.desc.qtype == 1           # on the int8 kernels
    assert torch.equal(layer.dequantized_weight(), torch.from_numpy(want))


def test_q5_1_on_the_int8_kernels_within_a_half_step():
    rows, cols = 37, 256
    raw = random_q5(Q.Q5_1, rows, cols, seed=8)
    want = torch.from_numpy(gguf_quants.dequantize(raw, Q.Q5_1).reshape(rows, cols))
    layer = GGUFQuantLinear(raw, Q.Q5_1, cols, rows, backend=BACKEND)
    assert layer.desc is not None and layer.desc.qtype == 1
    got = layer.dequantized_weight()
    step = want.view(rows, -1, 32).abs().amax(-1, keepdim=True) / 127      # the Q8_0 block's step
    assert bool(((got - want).view(rows, -1, 32).abs() <= step / 2 * 1.002 + 1e-7).all())


def q6_codes_and_scales(raw: np.ndarray, rows: int, cols: int):
    """Q6_K rows -> codes q - 32 [rows, cols] (int), int8 scales [rows, cols/16], fp16 d [rows, cols/256]."""
    b = raw.reshape(-1, 210)
    n = b.shape[0]
    ql, qh = b[:, :128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
    low = np.concatenate([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = (low | (high << 4)).astype(np.int64).reshape(rows, cols) - 32
    sc = b[:, 192:208].view(np.int8).astype(np.int64).reshape(rows, cols // 16)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32).reshape(rows, cols // 256)
    return q, sc, d


def q6_arithmetic(raw: np.ndarray, rows: int, cols: int, x: torch.Tensor) -> torch.Tensor:
    """The Q6_K layout's arithmetic written out: x to int8 per 32 values, per block the exact
    isum = sc_lo * sum_lo + sc_hi * sum_hi, then acc = fma(float(isum), d * xd, acc) in block order."""
    nb = cols // 32
    xb = x.view(-1, nb, 32)
    amax = xb.abs().amax(-1)
    xd = amax / 127
    xq = torch.round(xb * torch.where(amax > 0, 127 / amax, 0.0)[..., None]).to(torch.int64)
    q, sc, d = (torch.from_numpy(a) for a in q6_codes_and_scales(raw, rows, cols))
    halves = torch.einsum("tbhk,rbhk->trbh", xq.view(-1, nb, 2, 16), q.view(rows, nb, 2, 16))
    isum = (halves * sc.view(1, rows, nb, 2)).sum(-1)                      # exact integers
    acc = torch.zeros(x.shape[0], rows, dtype=torch.float32)
    for blk in range(nb):
        scale = (d[:, blk // 8][None, :] * xd[:, blk][:, None]).float()
        acc = (isum[:, :, blk].double() * scale.double() + acc.double()).float()
    return acc


@pytest.mark.parametrize("rows,cols", [(37, 512), (64, 256), (45, 768)])   # last group: 5, 16, 13 rows
def test_q6_k_layout_is_the_written_out_arithmetic_on_every_batch_size(rows, cols):
    raw = random_blocks(Q.Q6_K, rows, cols, seed=rows)
    blocks = raw.reshape(-1, 210).copy()
    blocks[:, 208:210] = np.full((blocks.shape[0], 1), 2e-3, np.float16).view(np.uint8)   # finite outputs
    raw = blocks.reshape(rows, -1)
    layer = GGUFQuantLinear(raw, Q.Q6_K, cols, rows, backend=BACKEND)
    assert layer.desc.qtype == 3 and layer.desc.sdtype == 2
    held = layer.qs.numel() + layer.d.numel()
    assert held == -(-rows // 16) * 16 * cols // 256 * 210        # 6.56 bits a weight, as the file
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(6))
    full = layer(x)
    assert torch.equal(full, q6_arithmetic(raw, rows, cols, x))
    assert_rows_alone(layer, x, full, prefixes(1, 2, 3, 4, 5, 7, 16, 17))
    ref = x.double() @ torch.from_numpy(gguf_quants.dequantize(raw, Q.Q6_K).reshape(rows, cols)).double().T
    assert float((full.double() - ref).norm() / ref.norm()) < 0.02


def test_q6_k_prompt_inputs_follow_new_activations_of_the_same_shape():
    """Each thread keeps the Q6_K prompt tiles' activation sums and permuted copy while its int8
    activations are unchanged (the forward's row chunks reuse them); calls of one shape with new
    activations in the same scratch buffer must not read the old ones."""
    rows, cols = 37, 512
    blocks = random_blocks(Q.Q6_K, rows, cols, seed=11).reshape(-1, 210).copy()
    blocks[:, 208:210] = np.full((blocks.shape[0], 1), 2e-3, np.float16).view(np.uint8)
    raw = blocks.reshape(rows, -1)
    layer = GGUFQuantLinear(raw, Q.Q6_K, cols, rows, backend=BACKEND)
    gen = torch.Generator().manual_seed(12)
    for T in (9, 9, 3, 3, 9):
        x = torch.randn(T, cols, generator=gen)
        assert torch.equal(layer(x), q6_arithmetic(raw, rows, cols, x)), T


@pytest.mark.parametrize("rows,cols", [(37, 512), (45, 768)])
def test_q5_k_layout_exact_rows_and_the_written_out_arithmetic(rows, cols):
    from test_kernels import _int8_arithmetic

    from kvserve.model.kernels import kquants

    blocks = random_blocks(Q.Q5_K, rows, cols, seed=11).reshape(-1, 176).copy()
    blocks[:, 0:4] = np.array([[3e-3, 2e-3]], np.float16).view(np.uint8)       # finite, sane outputs
    raw = blocks.reshape(rows, -1)
    layer = GGUFQuantLinear(raw, Q.Q5_K, cols, rows, backend=BACKEND)
    assert layer.desc.qtype == 4 and layer.desc.sdtype == 2 and layer.m.numel() == 0
    assert layer.qs.numel() + layer.d.numel() == 3 * (cols // 256) * (320 * 8 + 320)   # 3 groups: 5.63 bits a weight
    want = torch.from_numpy(kquants.dequantize(raw, Q.Q5_K, cols))
    assert torch.equal(layer.dequantized_weight(), want)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(12))
    full = layer(x)
    assert torch.equal(full, _int8_arithmetic(layer, x))
    assert_rows_alone(layer, x, full, prefixes(1, 2, 3, 4, 5, 7, 16, 17))
    ref = x.double() @ want.double().T
    assert float((full.double() - ref).norm() / ref.norm()) < 0.02


@pytest.mark.parametrize("fill", [0x00, 0xFF, 0xA5])   # every code 0 (q - 32 = -32), 63 (+31), mixed
def test_q6_k_extreme_codes_and_activations_same_bits_on_every_batch_size(fill):
    """The Q6_K tiles sum unsigned codes (the batched one a chunk's lower and upper pairs per int16
    lane, unpacked per tile or, from 8 tokens, once per group) and take 32 x the activations' sum off
    per half-block. At the int16 bounds (every code at an end of its range, every activation at
    +-127, scales at -128 and 127) all give the same exact integer, so the same bits, and equal the
    written-out arithmetic."""
    rows, cols = 21, 512
    blocks = np.zeros((rows * cols // 256, 210), np.uint8)
    blocks[:, :192] = fill
    blocks[:, 192:208] = np.array([127, -128, 1, -1, 64, -64, 127, 127, -128, -128, 0, 5, 100, -100, 33, -7],
                                  np.int8).view(np.uint8)
    blocks[:, 208:210] = np.full((1,), 2e-3, np.float16).view(np.uint8)
    raw = blocks.reshape(rows, -1)
    layer = GGUFQuantLinear(raw, Q.Q6_K, cols, rows, backend=BACKEND)
    x = extreme_activations(cols)
    x = torch.cat([x, -x])                                   # 10 tokens: the codes unpacked once per group
    full = layer(x)
    assert torch.equal(full, q6_arithmetic(raw, rows, cols, x))
    # each token alone, the batched tile's 2- and 3-token widths, and unpacked groups
    assert_rows_alone(layer, x, full, [(t, t + 1) for t in range(x.shape[0])] + [(0, 2), (1, 4), (2, 5), (0, 8), (1, 10)])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_prompt_token_blocks_give_the_same_bits(qtype):
    """A long K (8192 values: 24 tokens of int8 activations per L2-sized block) makes a 70-token call
    run its tokens in blocks (run_groups_avx2); every row equals the same token's row alone and in
    shorter calls."""
    rows, cols = 21, 8192
    blocks = random_blocks(qtype, rows, cols, seed=5).reshape(rows * cols // 256, -1).copy()
    at = {Q.Q4_K: slice(0, 4), Q.Q5_K: slice(0, 4), Q.Q6_K: slice(208, 210)}[qtype]
    blocks[:, at] = np.array([2e-3, 1e-3][:(at.stop - at.start) // 2], np.float16).view(np.uint8)   # finite outputs
    raw = blocks.reshape(rows, -1)
    layer = int8_layer(raw, rows, cols) if qtype == Q.Q4_K else GGUFQuantLinear(raw, qtype, cols, rows, backend=BACKEND)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(9))
    full = layer(x)
    assert torch.isfinite(full).all()
    assert_rows_alone(layer, x, full, prefixes(1, 5, 24, 25, 49) + [(t, t + 1) for t in (0, 23, 24, 47, 69)])


@pytest.mark.parametrize("fill", [0xFF, 0xA5])   # every Q5_K code 31 (fifth bits all set), mixed
def test_q5_k_extreme_codes_and_activations_same_bits_on_every_batch_size(fill):
    """The batched Q5_K tile (16 rows x up to 4 tokens; from 8 tokens on codes unpacked once per
    group) sums two chunks' products per int16 lane before widening; at the bound (every code 31,
    every activation +-127: 4 x 2 x 31 x 127) it still gives the exact integer, so the written-out
    arithmetic's bits on every batch size."""
    from test_kernels import _int8_arithmetic

    rows, cols = 21, 512
    blocks = np.full((rows * cols // 256, 176), fill, np.uint8)
    blocks[:, 0:4] = np.array([[3e-3, 2e-3]], np.float16).view(np.uint8)
    raw = blocks.reshape(rows, -1)
    layer = GGUFQuantLinear(raw, Q.Q5_K, cols, rows, backend=BACKEND)
    x = extreme_activations(cols)
    x = torch.cat([x, -x])                                   # 10 tokens: the codes unpacked once per group
    full = layer(x)
    assert torch.equal(full, _int8_arithmetic(layer, x))
    assert_rows_alone(layer, x, full, [(0, 1), (0, 2), (1, 4), (2, 5), (4, 5), (0, 8), (1, 10)])
