"""GGUF packed-weight Linear variants against the fp32 dequantized reference.

Error bounds, relative Frobenius norm of y - y_ref over y_ref (y_ref in float64):
  * int8 kernel path (Q4_0, Q4_1, Q8_0): x is quantized to int8 per 32-element block with scale
    max|x|/127, so each element is off by at most max|x|/254 (uniform, RMS ~ step/sqrt(12)). For
    Gaussian x, max|x| over 32 values is ~2.5 sigma, giving ~0.6% RMS relative error on x, which
    passes to y unchanged in expectation (independent of W). The weights themselves are exact
    (integer dot products, fp32 scales). Bound: 2% (3x margin); measured ~0.55%.
  * bf16 path (large T): x, W and y each rounded to bf16 (relative 2^-9 = 0.2%), accumulation in
    fp32: ~0.3% expected. Bound: 1%.
  * fp32-GEMM path (large T without bf16) and torch fallback: W dequantized exactly to fp32, fp32
    matmul: 1e-5.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvserve.errors import ModelLoadError
from kvserve.model.kernels import reference
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kernels.gguf_linear import GGUFQuantLinear, supports
from kvserve.model.linear import DenseLinear

FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
SHAPES = [(192, 576), (37, 96), (576, 1536)]   # (out, in); 37 rows, 3 blocks: odd tile and pair counts
BATCHES = [1, 7, 64]
INT8_BOUND = 0.02
BF16_BOUND = 0.01

BACKEND = KernelBackend.detect()     # this machine's (or KVSERVE_ISA's) choice, made once
INT8 = replace(BACKEND, bf16_min_tokens=None, f32_min_tokens=None)   # every call on the int8 kernel
requires_kernels = pytest.mark.skipif(BACKEND.lib is None, reason="compiled kernels unavailable here")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def make(qtype: Q, out_f: int, in_f: int, seed: int = 0, bias: bool = False):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_f, in_f)).astype(np.float32)
    raw = quantize(w, qtype)
    ref_w = torch.from_numpy(dequantize(raw, qtype)).double()
    b = torch.from_numpy(rng.standard_normal(out_f).astype(np.float32)) if bias else None
    return raw, ref_w, b


def kernel_layer(raw, qtype, in_f, out_f, bias=None) -> GGUFQuantLinear:
    return GGUFQuantLinear(raw, qtype, in_f, out_f, bias, backend=INT8)


def random_q4_k(out_f: int, in_f: int, seed: int = 0) -> np.ndarray:
    """gguf-py cannot quantize to Q4_K; random super-blocks are valid Q4_K data all the same."""
    rng = np.random.default_rng(seed)
    n = out_f * in_f // 256
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    blocks[:, 0:4] = np.stack([rng.uniform(1e-3, 1e-2, n), rng.uniform(1e-3, 1e-2, n)], 1).astype(
        np.float16).view(np.uint8)
    return blocks.reshape(out_f, -1)


def test_supports():
    assert all(supports(q) for q in [*FORMATS, Q.Q4_K])
    assert supports(Q.Q6_K) and supports(Q.Q5_K)     # Q6_K its own layout, Q5_K requantized (kquants.py)
    assert supports(Q.Q5_0) and supports(Q.Q5_1)     # as Q8_0 blocks (exact for Q5_0)
    assert not supports(Q.F32)


@requires_kernels
@pytest.mark.parametrize("T", BATCHES)
@pytest.mark.parametrize("shape", [(64, 512), (37, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_q4_k_repacked_into_q4_kernel(shape, T):
    out_f, in_f = shape
    raw = random_q4_k(out_f, in_f, seed=T)
    ref_w = torch.from_numpy(dequantize(raw, Q.Q4_K)).double()
    layer = kernel_layer(raw, Q.Q4_K, in_f, out_f)
    assert torch.equal(layer.dequantized_weight().double(), ref_w)
    x = torch.randn(T, in_f)
    assert rel_err(layer(x), x.double() @ ref_w.T) < INT8_BOUND


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_reference_dequantize_matches_gguf(qtype):
    raw, ref_w, _ = make(qtype, 48, 96)
    assert torch.equal(reference.dequantize(raw, qtype, 96).double(), ref_w)


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_repack_is_exact(qtype):
    raw, ref_w, _ = make(qtype, 37, 160)
    layer = GGUFQuantLinear(raw, qtype, 160, 37, backend=BACKEND)
    assert torch.equal(layer.dequantized_weight().double(), ref_w)


@requires_kernels
@pytest.mark.parametrize("qtype", [*FORMATS, Q.Q4_K], ids=lambda q: q.name)
def test_embedding_rows_from_packed_weights(qtype):
    """rows(ids) is the exact dequantized row (the packed embedding lookup), any id shape."""
    raw = random_q4_k(40, 256) if qtype == Q.Q4_K else make(qtype, 40, 256)[0]
    layer = GGUFQuantLinear(raw, qtype, 256, 40, backend=replace(BACKEND, bf16_min_tokens=3), lookup_only=True)
    assert layer.weight_bf16 is None                  # a lookup table needs no matmul copy
    ids = torch.tensor([[0, 39, 7], [7, 1, 2]])
    rows = layer.rows(ids)
    assert rows.shape == (2, 3, 256) and rows.dtype == torch.float32
    assert torch.equal(rows, layer.dequantized_weight()[ids])
    with pytest.raises(IndexError, match="out of range"):
        layer.rows(torch.tensor([3, 40]))


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("T", BATCHES)
def test_int8_kernel_matches_reference(qtype, shape, T):
    out_f, in_f = shape
    raw, ref_w, _ = make(qtype, out_f, in_f, seed=T)
    layer = kernel_layer(raw, qtype, in_f, out_f)
    x = torch.randn(T, in_f, generator=torch.Generator().manual_seed(T))
    y = layer(x)
    assert y.shape == (T, out_f) and y.dtype == torch.float32
    assert rel_err(y, x.double() @ ref_w.T) < INT8_BOUND


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_bias_and_leading_dims(qtype):
    raw, ref_w, b = make(qtype, 64, 128, bias=True)
    layer = kernel_layer(raw, qtype, 128, 64, b)
    x = torch.randn(2, 5, 128)
    y = layer(x)
    assert y.shape == (2, 5, 64)
    assert rel_err(y, x.double() @ ref_w.T + b.double()) < INT8_BOUND


@requires_kernels
def test_thread_counts_give_identical_results():
    lib = BACKEND.lib
    raw, _, _ = make(Q.Q4_1, 576, 576)
    layer = kernel_layer(raw, Q.Q4_1, 576, 576)
    assert_threads_agree(lib, layer, torch.randn(7, 576))


def assert_threads_agree(lib, layer, x: torch.Tensor) -> None:
    """`layer(x)` on 1 thread and on 2 is the same to the bit (the thread count restored after)."""
    before = lib.kvs_get_num_threads()
    try:
        lib.kvs_set_num_threads(1)
        y1 = layer(x)
        lib.kvs_set_num_threads(2)
        y2 = layer(x)
    finally:
        lib.kvs_set_num_threads(before)
    assert torch.equal(y1, y2)


def _int8_arithmetic(layer: GGUFQuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The kernels' definition, written out (cpu/kvserve_kernels.cpp): x quantized per 32-block to
    int8, exact integer block sums, then per output one fp32 fma per block in block order
    (emulated in float64: a product of two floats is exact there, one rounding to fp32 follows)."""
    nb = layer.in_features // 32
    xb = x.view(-1, nb, 32)
    amax = xb.abs().amax(-1)
    xd = amax / 127
    xq = torch.round(xb * torch.where(amax > 0, 127 / amax, 0.0)[..., None]).to(torch.int32)
    xs = xd * xq.sum(-1).float()
    w = layer.dequantized_weight()
    d, m = layer.block_scales()
    q4 = m is not None
    q = torch.round((w.view(-1, nb, 32) - (m[..., None] if q4 else 0)) / torch.where(d == 0, 1, d)[..., None])
    isum = torch.einsum("tbk,rbk->trb", xq.double(), q.double())                   # exact integers
    acc = torch.zeros(x.shape[0], layer.out_features, dtype=torch.float32)
    for b in range(nb):
        scale = (d[:, b][None, :] * xd[:, b][:, None]).float()                     # one fp32 rounding
        acc = (isum[:, :, b] * scale.double() + acc.double()).float()
        if q4:
            acc = (m[:, b][None, :].double() * xs[:, b][:, None].double() + acc.double()).float()
    return acc + (0 if layer.bias is None else layer.bias)


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS + [Q.Q4_K], ids=lambda q: q.name)
def test_every_batch_size_gives_a_token_the_same_bits(qtype):
    """Batch invariance at the kernel: a token's outputs are bitwise the same whatever the call's
    token count and its place in the call, and equal to the written-out arithmetic."""
    out_f, in_f = (37, 256) if qtype == Q.Q4_K else (37, 96)     # 37 rows: a padded 16-row group
    raw = random_q4_k(out_f, in_f) if qtype == Q.Q4_K else make(qtype, out_f, in_f)[0]
    layer = kernel_layer(raw, qtype, in_f, out_f)
    x = torch.randn(70, in_f, generator=torch.Generator().manual_seed(1))
    full = layer(x)
    for T in (1, 2, 3, 4, 5, 6, 7, 13, 64):
        assert torch.equal(layer(x[:T]), full[:T]), T
    perm = torch.randperm(70, generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer(x[perm]), full[perm])
    # bit for bit: fma emulated in fp64 could only differ on a double-rounding tie (~2^-29 per op)
    assert torch.equal(full, _int8_arithmetic(layer, x))


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_avx2_avx512_and_amx_tiles_give_the_same_bits(qtype):
    """The AVX-512 VNNI and AMX-INT8 tiles are only faster ways to the AVX2 tiles' numbers, for
    any token count (AMX takes full tiles of 16 tokens and hands the rest to VNNI)."""
    if not BACKEND.gemm_isa:
        pytest.skip(f"this CPU (or KVSERVE_ISA) has no AVX-512 VNNI: isa={BACKEND.isa}")
    raw, _, b = make(qtype, 200, 608, bias=True)    # 19 blocks: an odd one after the AMX pairs
    layer = GGUFQuantLinear(raw, qtype, 608, 200, b, backend=INT8)
    assert layer.desc.isa == BACKEND.gemm_isa
    for T in (1, 15, 16, 33, 70):
        x = torch.randn(T, 608)
        layer.desc.isa = BACKEND.gemm_isa
        best = layer(x)
        for isa in range(BACKEND.gemm_isa):
            layer.desc.isa = isa
            assert torch.equal(layer(x), best), (T, isa)


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_bf16_path_for_large_batches(qtype):
    """The bf16 copy (batch invariance off, KVSERVE_BF16_MIN_TOKENS) as this backend makes it:
    oneDNN-prepacked from avx512 up."""
    if BACKEND.isa not in ("avx512", "amx"):
        pytest.skip(f"oneDNN's bf16 matmul needs avx512bw/vl/dq or AVX-NE-CONVERT; isa={BACKEND.isa}")
    raw, ref_w, b = make(qtype, 192, 576, bias=True)
    layer = GGUFQuantLinear(raw, qtype, 576, 192, b, backend=replace(BACKEND, bf16_min_tokens=16))
    assert layer.weight_bf16 is not None
    x = torch.randn(64, 576)
    assert rel_err(layer(x), x.double() @ ref_w.T + b.double()) < BF16_BOUND
    assert rel_err(layer(x[:7]), x[:7].double() @ ref_w.T + b.double()) < INT8_BOUND   # below 16: int8


@requires_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_f32_gemm_path_for_large_batches(qtype):
    raw, ref_w, b = make(qtype, 192, 96, bias=True)   # 3 blocks per row: odd pair count
    layer = GGUFQuantLinear(raw, qtype, 96, 192, b, backend=replace(BACKEND, bf16_min_tokens=None, f32_min_tokens=32))
    assert layer.weight_bf16 is None
    x = torch.randn(64, 96)
    assert rel_err(layer(x), x.double() @ ref_w.T + b.double()) < 1e-5


@requires_kernels
def test_real_model_tensor():
    """A Q4_1 projection and the Q8_0 embedding of the default model, as GGUFReader gives them."""
    from kvserve.model.gguf_loader import open_gguf
    from kvserve.model.registry import resolve

    reader = open_gguf(resolve(None).path)
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        in_f, out_f = (int(n) for n in t.shape)
        ref_w = torch.from_numpy(dequantize(t.data, t.tensor_type)).double()
        layer = kernel_layer(t.data, t.tensor_type, in_f, out_f)
        x = torch.randn(7, in_f)
        assert rel_err(layer(x), x.double() @ ref_w.T) < INT8_BOUND


def test_rejects_bad_input():
    raw, _, _ = make(Q.Q4_1, 8, 64)
    with pytest.raises(ModelLoadError):
        GGUFQuantLinear(raw, Q.Q4_1, 64, 9, backend=BACKEND)   # byte shape does not match out_features
    with pytest.raises(ModelLoadError):
        GGUFQuantLinear(np.zeros((4, 8), np.uint8), Q.IQ4_NL, 256, 4, backend=BACKEND)   # no packed IQ4_NL kernel


def test_fallback_without_kernels(tmp_path):
    """With the kernels disabled, layers warn once and compute with dequantized fp32 weights."""
    code = """
import numpy as np, torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kernels.gguf_linear import GGUFQuantLinear
backend = KernelBackend.detect()
assert backend.lib is None and backend.isa == "torch"
w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
ok = True
for qt in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
    raw = quantize(w, qt)
    layer = GGUFQuantLinear(raw, qt, 96, 48, backend=backend)
    assert layer.lib is None and layer.weight_f32 is not None
    ok = ok and torch.equal(layer.rows(torch.tensor([3, 0])), layer.weight_f32[[3, 0]])
    x = torch.randn(7, 96)
    ref = x.double() @ torch.from_numpy(dequantize(raw, qt)).double().T
    err = float((layer(x).double() - ref).norm() / ref.norm())
    ok = ok and err < 1e-5
print("OK" if ok else "BAD")
"""
    env = {**os.environ, "KVSERVE_NO_KERNELS": "1", "KVSERVE_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"
    assert proc.stderr.count("fast CPU kernels unavailable") == 1


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-6), (torch.bfloat16, BF16_BOUND)])
@pytest.mark.parametrize("T", BATCHES)
def test_dense_linear(dtype, bound, T):
    w = torch.randn(192, 576)
    b = torch.randn(192)
    layer = DenseLinear(w.to(dtype), b)
    x = torch.randn(T, 576)
    y = layer(x)
    assert y.dtype == torch.float32
    assert rel_err(y, x.double() @ w.double().T + b.double()) < bound


@requires_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_lens", [[1], [37], [5, 16, 17, 130]])
def test_paged_decode_attention_matches_torch(seq_lens, kv_dtype):
    """The C decode attention against PyTorch SDPA over each sequence's gathered K/V (GQA 9:3,
    D=64), for fp32, bf16 and fp16 caches (the reference reads the same 16-bit values as fp32)."""
    from kvserve.model.attention import AttentionMetadata, attend, gather_kv

    g = torch.Generator().manual_seed(len(seq_lens))
    block_size, hq, hkv, d = 16, 9, 3, 64
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()   # blocks scattered over the pool
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    kv_cache = torch.randn(2, len(perm), block_size, hkv, d, generator=g).to(kv_dtype)
    q = torch.randn(len(seq_lens), hq, d, generator=g)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, block_size)
    ref = []
    for b, n in enumerate(seq_lens):
        k, v = gather_kv(kv_cache.float(), meta.block_tables[b], n)
        ref.append(attend(q[b:b + 1], k, v, 0.125))
    ref = torch.cat(ref)
    out = BACKEND.paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    assert out is not None and out.shape == ref.shape
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)
    assert BACKEND.paged_decode_attention(q, kv_cache.to(torch.float64), meta.block_tables, seq_lens, 0.125) is None
    assert KernelBackend.pytorch().paged_decode_attention(q, kv_cache, meta.block_tables, seq_lens, 0.125) is None


@requires_kernels
@pytest.mark.parametrize("rows", [1, 7, 15])
def test_c_rms_norm_matches_torch(rows):
    """kvs_rms_norm, the norm of the C layer glue."""
    x, w = torch.randn(rows, 576), torch.randn(576)
    y = torch.empty_like(x)
    BACKEND.lib.kvs_rms_norm(x.data_ptr(), w.data_ptr(), rows, 576, 1e-5, y.data_ptr())
    assert torch.allclose(y, torch.nn.functional.rms_norm(x, (576,), w, 1e-5), atol=1e-5, rtol=1e-5)


@requires_kernels
def test_block_scales_kept_in_float16_where_exact():
    """GGUF's float16 scales stay float16 (fewer bytes per decode step); a Q4_0 block whose minimum
    -8 d overflows float16, keeps float32 scales; Q4_K keeps its super-block scales (bytes: fp16
    d and dmin, 6-bit scales and minima); all exact."""
    raw, ref_w, _ = make(Q.Q4_0, 32, 64)
    assert kernel_layer(raw, Q.Q4_0, 64, 32).d.dtype == torch.float16
    raw = raw.copy()
    raw[0, 0:2] = np.array([10000.0], dtype=np.float16).view(np.uint8)   # -8 d = -80000: no float16
    ref_w = torch.from_numpy(dequantize(raw, Q.Q4_0)).double()
    layer = kernel_layer(raw, Q.Q4_0, 64, 32)
    assert layer.d.dtype == torch.float32
    assert torch.equal(layer.dequantized_weight().double(), ref_w)
    q4k = kernel_layer(random_q4_k(16, 256), Q.Q4_K, 256, 16)
    assert q4k.d.dtype == torch.uint8 and q4k.d.numel() == 320 and q4k.m.numel() == 0


def scattered_block_tables(seq_lens: list[int], block_size: int, g: torch.Generator) -> tuple[list[list[int]], int]:
    """Block tables for `seq_lens` drawn out of order from a pool with 3 spare blocks; (tables, pool size)."""
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    return tables, len(perm)


@requires_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_batched_decode_attention_same_bits_as_alone(kv_dtype):
    """A batch of decode queries (each query's KV heads swept together, for contiguous cache reads)
    gives every query the bits it gets alone (one item per KV head)."""
    from kvserve.model.attention import AttentionMetadata
    from kvserve.model.kv_quant import quantize_rows

    g = torch.Generator().manual_seed(7)
    block_size, hq, hkv, d = 16, 9, 3, 64
    seq_lens = [1, 9, 16, 17, 40, 64, 130, 201]
    tables, nblocks = scattered_block_tables(seq_lens, block_size, g)
    x = torch.randn(2, nblocks, block_size, hkv, d, generator=g)
    kv_cache = quantize_rows(x) if kv_dtype == torch.int8 else x.to(kv_dtype)
    q = torch.randn(len(seq_lens), hq, d, generator=g)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, block_size)
    batched = BACKEND.paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    assert batched is not None
    for b in range(len(seq_lens)):
        alone = BACKEND.paged_decode_attention(q[b:b + 1], kv_cache, meta.block_tables[b:b + 1], [seq_lens[b]], 0.125)
        assert torch.equal(alone[0], batched[b]), (kv_dtype, seq_lens[b])
