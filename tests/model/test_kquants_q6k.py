"""Q6_K and Q5_K on the int8 kernels (kernels/kquants.py): the rows decoded exactly as llama.cpp
decodes them, requantized into Q8_0 blocks within half a step of each block's int8 grid, and
llama.cpp-style Q4_K_M / Q5_K_M files (Q6_K head, Q6_K attn_v beside Q4_K q/k, Q6_K ffn_down)
served wholly on the fast path: the same greedy tokens on the whole-stack C forward as on the
PyTorch layer ops (KVSERVE_FUSED_FORWARD=0, the same packed weights), the same bits from the pack
cache, and logits near those of the exactly decoded weights in fp32.
`make test-avx2` style: run with KVSERVE_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from test_shapes import _greedy

from kvserve.bench import gguf_random
from kvserve.model.kernels import kquants, pack_cache
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kernels.gguf_linear import GGUFQuantLinear
from kvserve.model.loader import load_model
from kvserve.train.quant_formats import quantize_rows

BACKEND = KernelBackend.detect()
INT8 = replace(BACKEND, bf16_min_tokens=None, f32_min_tokens=None)
needs_kernels = pytest.mark.skipif(BACKEND.lib is None, reason="compiled kernels unavailable")
F32 = np.float32


def ref_q6_k(block: bytes) -> list[float]:
    """One Q6_K block, literally as llama.cpp's dequantize_row_q6_K loops over it (float32 ops)."""
    ql, qh, sc = block[0:128], block[128:192], np.frombuffer(block[192:208], np.int8)
    d = F32(np.frombuffer(block[208:210], np.float16)[0])
    y = [F32(0)] * 256
    for n in range(2):
        for l_ in range(32):
            is_ = l_ // 16
            a, b, h = ql[64 * n + l_], ql[64 * n + l_ + 32], qh[32 * n + l_]
            q = [(a & 0xF) | ((h >> 0) & 3) << 4, (b & 0xF) | ((h >> 2) & 3) << 4,
                 (a >> 4) | ((h >> 4) & 3) << 4, (b >> 4) | ((h >> 6) & 3) << 4]
            for k in range(4):
                y[128 * n + 32 * k + l_] = d * F32(sc[8 * n + is_ + 2 * k]) * F32(q[k] - 32)
    return y


def scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_q5_k(block: bytes) -> list[float]:
    """One Q5_K block as llama.cpp's dequantize_row_q5_K."""
    d, dmin = (F32(v) for v in np.frombuffer(block[0:4], np.float16))
    scales, qh, qs = block[4:16], block[16:48], block[48:176]
    y, u1, u2 = [], 1, 2
    for j in range(4):
        sc1, m1 = scale_min_k4(2 * j, scales)
        sc2, m2 = scale_min_k4(2 * j + 1, scales)
        d1, mm1, d2, mm2 = d * F32(sc1), dmin * F32(m1), d * F32(sc2), dmin * F32(m2)
        ql = qs[32 * j:32 * j + 32]
        y += [d1 * F32((ql[i] & 0xF) + (16 if qh[i] & u1 else 0)) - mm1 for i in range(32)]
        y += [d2 * F32((ql[i] >> 4) + (16 if qh[i] & u2 else 0)) - mm2 for i in range(32)]
        u1, u2 = u1 << 2, u2 << 2
    return y


def random_k_blocks(qtype: Q, n: int, seed: int) -> np.ndarray:
    """n blocks of random bytes with finite float16 scales of either sign and any magnitude."""
    rng = np.random.default_rng(seed)
    size = {Q.Q6_K: 210, Q.Q5_K: 176}[qtype]
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    scales = (rng.standard_normal((n, 2)) * 10.0 ** rng.integers(-6, 2, (n, 1))).astype(np.float16)
    at = (208,) if qtype == Q.Q6_K else (0, 2)
    for k, a in enumerate(at):
        raw[:, a:a + 2] = scales[:, k:k + 1].view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype,ref", [(Q.Q6_K, ref_q6_k), (Q.Q5_K, ref_q5_k)], ids=["Q6_K", "Q5_K"])
def test_decoding_is_exact(qtype, ref):
    raw = random_k_blocks(qtype, 48, seed=1)
    ours = kquants.dequantize(raw.reshape(3, -1), qtype, 16 * 256)
    want = np.array([ref(bytes(b)) for b in raw], dtype=np.float32).reshape(3, -1)
    assert np.array_equal(ours, want)
    assert np.array_equal(ours, gguf_dequantize(raw.reshape(3, -1), qtype))   # gguf-py's decoder agrees


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K], ids=["Q6_K", "Q5_K"])
def test_requantized_within_half_an_int8_step(qtype):
    raw = random_k_blocks(qtype, 64, seed=2).reshape(4, -1)
    exact = kquants.dequantize(raw, qtype, 16 * 256)
    q8 = kquants.q8_0_rows(raw, qtype, 16 * 256)
    back = gguf_dequantize(q8, Q.Q8_0).reshape(exact.shape)
    err = np.abs(back - exact).reshape(-1, 32).max(axis=1)
    amax = np.abs(exact).reshape(-1, 32).max(axis=1)
    d = q8.reshape(-1, 34)[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
    assert np.all(err <= d / 2 * (1 + 1e-4))                    # half a step of the stored scale
    normal = amax / 127 >= 2 ** -14                              # the scale a float16 normal number:
    assert np.all(d[normal] <= amax[normal] / 127 * (1 + 2 ** -10))   # amax / 127 up to fp16 rounding


def test_requantization_adds_little_to_q6_k_error():
    """Gaussian weights through Q6_K (the rounding llama.cpp's quantizer makes), then Q8_0: the
    second rounding adds a small part of the first (measured ~0.25x of Q6_K's RMS error)."""
    w = np.random.default_rng(3).standard_normal((64, 1024)).astype(np.float32)
    raw, t = quantize_rows(w, "q6_k")
    assert t == "Q6_K"
    exact = kquants.dequantize(raw, Q.Q6_K, 1024)
    back = gguf_dequantize(kquants.q8_0_rows(raw, Q.Q6_K, 1024), Q.Q8_0).reshape(w.shape)
    q6_err = np.sqrt(np.mean((exact - w) ** 2))
    requant_err = np.sqrt(np.mean((back - exact) ** 2))
    assert requant_err < 0.5 * q6_err


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K], ids=["Q6_K", "Q5_K"])
def test_layer_holds_the_requantized_rows(qtype):
    """Q6_K and Q5_K keep their own layouts (kernel qtypes 3 and 4), whose dequantized rows are
    llama.cpp's exactly (the name stays from when both were requantized to Q8_0 rows)."""
    rng = np.random.default_rng(4)
    raw = gguf_random.random_blocks(37, 512, qtype, rng)     # 37 rows: a padded 16-row group
    layer = GGUFQuantLinear(raw, qtype, 512, 37, backend=INT8)
    want = kquants.dequantize(raw, qtype, 512)
    assert torch.equal(layer.dequantized_weight(), torch.from_numpy(want))
    x = torch.randn(7, 512)
    ref = x.double() @ torch.from_numpy(kquants.dequantize(raw, qtype, 512)).double().T
    assert float((layer(x).double() - ref).norm() / ref.norm()) < 0.02
    assert "requantized to Q8_0" not in layer.extra_repr()


@pytest.fixture(scope="module", params=["Q4_K_M", "Q5_K_M"])
def mixed(request, tmp_path_factory):
    path = gguf_random.write(tmp_path_factory.mktemp("kmix") / f"{request.param}.gguf", "tiny", request.param)
    return path, load_model(str(path), backend=BACKEND).model


def test_the_mix_is_llama_cpps():
    types = {n: gguf_random.tensor_type(n, "Q4_K_M", 22) for n in (
        "output.weight", "token_embd.weight", "blk.0.attn_v.weight", "blk.3.attn_v.weight", "blk.4.attn_v.weight",
        "blk.5.ffn_down.weight", "blk.20.ffn_down.weight", "blk.1.attn_q.weight", "blk.1.ffn_up.weight")}
    assert types == {"output.weight": "Q6_K", "token_embd.weight": "Q4_K", "blk.0.attn_v.weight": "Q6_K",
                     "blk.3.attn_v.weight": "Q4_K", "blk.4.attn_v.weight": "Q6_K", "blk.5.ffn_down.weight": "Q4_K",
                     "blk.20.ffn_down.weight": "Q6_K", "blk.1.attn_q.weight": "Q4_K", "blk.1.ffn_up.weight": "Q4_K"}


@needs_kernels
def test_mixed_file_is_on_the_fast_path(mixed):
    _, model = mixed
    assert BACKEND.slow_paths(model) == []
    assert "every layer and the LM head on the fast path" in BACKEND.describe_model(model)
    assert model.layers[1].qkv_proj.qtypes[-1] == Q.Q6_K     # Q4_K q/k beside a Q6_K v: each its own type
    assert model.lm_head.qtype == Q.Q6_K


def _prefill_top2_gaps(model, backend, prompt: list[int]) -> list[float]:
    """Top-2 log-probability gap at every prompt position, one prefill on `backend`."""
    from test_shapes import BLOCK

    from kvserve.model.attention import AttentionMetadata
    from kvserve.model.kv_quant import cache_shape

    cfg, n = model.config, len(prompt)
    blocks = n // BLOCK + 1
    kv = [torch.zeros(cache_shape(blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, torch.float16),
                      dtype=torch.float16) for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], BLOCK)
    base, model.backend = model.backend, backend
    try:
        with torch.inference_mode():
            lp = torch.log_softmax(model.compute_logits(model(torch.tensor(prompt), torch.arange(n), meta, kv)).float(), -1)
    finally:
        model.backend = base
    top = lp.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


@needs_kernels
def test_mixed_file_greedy_matches_the_reference_path(mixed):
    _, model = mixed
    prompt = torch.randint(3, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    fast, fast_logits = _greedy(model, BACKEND, prompt, 16)
    ref, ref_logits = _greedy(model, replace(BACKEND, fused_forward=False), prompt, 16)
    # The two paths are not bit-identical (attention differs), so a random model's prompt-position
    # argmax may flip at a near-tie (the bar: top-2 logprob gap < 0.05); decode must agree.
    if fast[:40] != ref[:40]:
        gaps = _prefill_top2_gaps(model, replace(BACKEND, fused_forward=False), prompt)
        for i in range(40):
            if fast[i] != ref[i]:
                assert gaps[i] < 0.05, (i, gaps[i])
    assert fast[39:] == ref[39:]
    for a, b in zip(fast_logits, ref_logits):
        assert ((a - b).norm() / b.norm()).item() < 3e-2
    assert len(set(fast)) > 3


@needs_kernels
def test_mixed_file_near_the_exact_weights(mixed):
    """Against the file's exact values in fp32 (weight_format fp32, PyTorch matmuls): the int8
    activations move the logits by a few percent at most."""
    path, model = mixed
    exact = load_model(str(path), weight_format="fp32", backend=KernelBackend.pytorch()).model
    prompt = torch.randint(3, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(9)).tolist()
    _, fast_logits = _greedy(model, BACKEND, prompt, 1)
    _, exact_logits = _greedy(exact, KernelBackend.pytorch(), prompt, 1)
    a, b = fast_logits[0], exact_logits[0]
    assert ((a - b).norm() / b.norm()).item() < 5e-2


@needs_kernels
def test_mixed_file_from_the_pack_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(pack_cache, "cache_root", lambda: tmp_path / "packed")
    path = gguf_random.write(tmp_path / "m.gguf", "tiny", "Q4_K_M", seed=5)
    prompt = list(range(3, 30))
    first = load_model(str(path), backend=BACKEND).model
    want = _greedy(first, BACKEND, prompt, 4)
    pack_cache.wait()     # the cache file is written in the background
    assert len(list((tmp_path / "packed").glob("*.kvpack"))) == 1

    def no_repack(*_):
        raise AssertionError("repacked although cached")

    monkeypatch.setattr(GGUFQuantLinear, "_repack", no_repack)
    again = load_model(str(path), backend=BACKEND).model
    got = _greedy(again, BACKEND, prompt, 4)
    assert got[0] == want[0] and all(torch.equal(x, y) for x, y in zip(got[1], want[1]))
