"""A fused projection whose members have different GGUF types (a Q4_K_M file's Q4_K q/k beside its
Q6_K v) keeps every member in its own layout, as row segments of one kernel descriptor
(kernels/fused_linear.py): its output equals the members run one by one and concatenated, bit for
bit, on every path (int8 tiles at every token count and thread count, the fp32 dequantization,
row lookups), and loading such a file requantizes nothing to Q8_0."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf import quants as gguf_quants
from test_kernels import assert_threads_agree
from test_kquant_repack import random_blocks

from kvserve.bench import gguf_random
from kvserve.model.kernels import kquants
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kernels.fused_linear import SegmentedQuantLinear
from kvserve.model.kernels.gguf_linear import GGUFQuantLinear
from kvserve.model.linear import WeightSource, make_linear
from kvserve.model.loader import load_model

BACKEND = KernelBackend.detect()
INT8 = replace(BACKEND, bf16_min_tokens=None, f32_min_tokens=None)
pytestmark = pytest.mark.skipif(BACKEND.lib is None, reason="compiled kernels unavailable")


def _raw(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return random_blocks(qtype, rows, cols, seed)
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return gguf_quants.quantize(w, qtype)


# (types, rows): q/k/v of a Q4_K_M and a Q5_K_M layer, a 2-member gate/up, rows that end a
# segment inside a 16-row group, a segment narrower than one group
CASES = [((Q.Q4_K, Q.Q4_K, Q.Q6_K), (64, 32, 32)), ((Q.Q5_K, Q.Q5_K, Q.Q6_K), (48, 16, 16)),
         ((Q.Q4_K, Q.Q6_K), (37, 21)), ((Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_K), (5, 40, 19, 16))]


def _members(case, cols: int = 512, bias: bool = True):
    types, rows = case
    parts = [(_raw(q, r, cols, seed=i), q, r) for i, (q, r) in enumerate(zip(types, rows))]
    b = torch.randn(sum(rows), generator=torch.Generator().manual_seed(1)) if bias else None
    return parts, b


@pytest.mark.parametrize("case", CASES, ids=lambda c: "+".join(q.name for q in c[0]))
def test_segments_equal_the_members_one_by_one(case):
    parts, bias = _members(case)
    cols = 512
    fused = SegmentedQuantLinear(parts, cols, bias, backend=INT8)
    assert fused.desc.qtype == 5 and fused.desc.nseg == len(parts)
    assert [s.qtype for s in fused.segments] == list(case[0])      # each keeps the file's type
    offs = np.cumsum([0, *case[1]])
    alone = [GGUFQuantLinear(raw, q, cols, r, bias[offs[i]:offs[i + 1]], backend=INT8)
             for i, (raw, q, r) in enumerate(parts)]
    x = torch.randn(33, cols, generator=torch.Generator().manual_seed(2))
    for T in (1, 2, 3, 4, 5, 16, 33):
        want = torch.cat([m(x[:T]) for m in alone], dim=1)
        assert torch.equal(fused(x[:T]), want), T
    assert torch.equal(fused.dequantized_weight(), torch.cat([m.dequantized_weight() for m in alone]))
    ids = torch.tensor([0, offs[1] - 1, offs[1], offs[-1] - 1, offs[-2]])
    assert torch.equal(fused.rows(ids), fused.dequantized_weight()[ids])
    assert_threads_agree(BACKEND.lib, fused, x[:5])


def test_fp32_path_for_large_calls_equals_the_members():
    parts, bias = _members(CASES[0])
    f32 = replace(INT8, f32_min_tokens=8)
    fused = SegmentedQuantLinear(parts, 512, bias, backend=f32)
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(4))
    want = torch.nn.functional.linear(x, fused.dequantized_weight(), bias)
    assert torch.allclose(fused(x), want, rtol=1e-5, atol=1e-5)


def test_make_linear_keeps_mixed_types_as_segments():
    parts, _ = _members(CASES[0])
    srcs = [WeightSource((r, 512), raw=raw, qtype=q) for raw, q, r in parts]
    src = WeightSource.concat(srcs)
    assert src.raw is None and src.parts == srcs            # nothing requantized
    lin = make_linear(src, None, "auto", backend=INT8)
    assert isinstance(lin, SegmentedQuantLinear) and lin.qtypes == (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    same = WeightSource.concat(srcs[:2])                     # one type: one plain packed weight
    assert same.qtype == Q.Q4_K and type(make_linear(same, None, "auto", backend=INT8)) is GGUFQuantLinear
    torch_only = make_linear(src, None, "auto", backend=KernelBackend.pytorch())
    assert torch.equal(torch_only.weight_f32, src.dequantize())


@pytest.mark.parametrize("mix,inner", [("Q4_K_M", Q.Q4_K), ("Q5_K_M", Q.Q5_K)])
def test_k_quant_mix_loads_without_requantizing(tmp_path, monkeypatch, mix, inner):
    def no_requant(*_a, **_k):
        raise AssertionError("a tensor was requantized to Q8_0")

    monkeypatch.setattr(kquants, "q8_0_rows", no_requant)
    monkeypatch.setenv("KVSERVE_PACK_CACHE", "0")
    path = gguf_random.write(tmp_path / f"{mix}.gguf", "tiny", mix)
    model = load_model(str(path), backend=BACKEND).model
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    mixed = 0
    for i, layer in enumerate(model.layers):
        types = tuple(tensors[f"blk.{i}.attn_{n}.weight"].tensor_type for n in "qkv")
        qkv = layer.qkv_proj
        if len(set(types)) > 1:
            mixed += 1
            assert isinstance(qkv, SegmentedQuantLinear) and qkv.qtypes == types == (inner, inner, Q.Q6_K)
            file_bytes = sum(int(tensors[f"blk.{i}.attn_{n}.weight"].n_bytes) for n in "qkv")
            held = sum(t.numel() * t.element_size() for s in qkv.segments for t in (s.qs, s.d, s.m))
            assert held < 1.1 * file_bytes, (held, file_bytes)       # Q8_0 rows would be ~1.7x
        else:
            assert qkv.qtype == inner
    assert mixed > 0
    assert not [m for m in model.modules() if isinstance(m, GGUFQuantLinear) and m.qtype == Q.Q8_0]
    assert BACKEND.slow_paths(model) == []
