"""The one-call C forward of the layer stack against the per-layer PyTorch path on the same packed
weights: tiny GGUF models of every packed type, llama and qwen2 (q/k/v bias), GQA, fp32 and bf16
KV caches, batches of 1, 7 and 64 tokens mixing decodes with prompt chunks."""

import pytest
import torch
from ggufmaker import make_tiny_llama_gguf

from kvserve.model.attention import AttentionMetadata
from kvserve.model.loader import load_model
from kvserve.model.quant import QuantLinearConfig, get_config, load_kernels, set_config
from kvserve.model.quant.forward import FusedForward

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="compiled kernels unavailable")

BLOCK = 16


@pytest.fixture
def int8_only():
    """Every call on the int8 kernels (no bf16/fp32 GEMM switch), so any batch size can be fused."""
    old = get_config()
    set_config(QuantLinearConfig(bf16_min_tokens=None, f32_min_tokens=None))
    yield
    set_config(old)


def _tiny(tmp_path, qtype, arch):
    path = make_tiny_llama_gguf(tmp_path / f"tiny-{qtype}-{arch}.gguf", qtype=qtype, arch=arch,
                                hidden=256, inter=512, heads=8, kv_heads=2, layers=3, ctx=256)
    return load_model(str(path), weight_format="auto").model


def _step(model, fused: bool, ids, positions, meta, kv):
    model._fused = FusedForward.build(model) if fused else None
    if fused:
        model._fused.max_tokens = 64
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.tensor(positions), meta, kv)


def _rel_rows(a, b):
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype,arch", [("Q4_1", "llama"), ("Q4_0", "llama"), ("Q8_0", "qwen2"), ("Q4_K", "llama")])
def test_fused_forward_matches_layer_path(tmp_path, int8_only, qtype, arch, kv_dtype):
    model = _tiny(tmp_path, qtype, arch)
    cfg = model.config
    assert FusedForward.build(model) is not None
    g = torch.Generator().manual_seed(0)
    # 10 sequences with scattered blocks; sequence i has a cached prefix of 3 + 11 * i tokens.
    prefix = [3 + 11 * i for i in range(10)]
    blocks = torch.randperm(80, generator=g).tolist()
    tables = [blocks[8 * i: 8 * i + 8] for i in range(10)]
    kv_ref = [torch.zeros(2, 80, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=kv_dtype)
              for _ in range(cfg.num_hidden_layers)]
    tokens = [torch.randint(3, cfg.vocab_size, (120,), generator=g).tolist() for _ in range(10)]
    meta = AttentionMetadata.build(prefix, prefix, tables, BLOCK)   # prefill every prefix (PyTorch path)
    _step(model, False, [tok for t, n in zip(tokens, prefix) for tok in t[:n]],
          [p for n in prefix for p in range(n)], meta, kv_ref)
    kv_fused = [c.clone() for c in kv_ref]

    # batch 1: one decode; batch 7: decodes and a 3-token chunk; batch 64: chunks of 9, 3 and 2 tokens
    for plan in ({0: 1}, {1: 1, 2: 3, 3: 1, 4: 1, 5: 1},
                 {**{i: 9 for i in range(6)}, 6: 3, 7: 3, 8: 2, 9: 2}):
        ids, pos, q_lens, s_lens, tbl = [], [], [], [], []
        for i, n in plan.items():
            ids += tokens[i][prefix[i]: prefix[i] + n]
            pos += range(prefix[i], prefix[i] + n)
            q_lens.append(n)
            s_lens.append(prefix[i] + n)
            tbl.append(tables[i])
            prefix[i] += n
        meta = AttentionMetadata.build(q_lens, s_lens, tbl, BLOCK)
        ref = _step(model, False, ids, pos, meta, kv_ref)
        out = _step(model, True, ids, pos, meta, kv_fused)
        assert out.shape == ref.shape == (len(ids), cfg.hidden_size)
        # Same int8 quantization and tiles: rows agree to float rounding (~3e-7), except where a
        # last-bit difference (C vs torch summation order in norms, RoPE, attention) moves an
        # activation across an int8 rounding boundary: one quantization step, ~1e-3 to 1e-2 after a
        # few layers, and the rows after it in the same sequence inherit it through attention.
        errs = _rel_rows(out, ref)
        assert (errs < 1e-5).float().mean().item() >= 0.5, (qtype, arch, len(ids), errs)
        assert errs.max().item() < 3e-2, (qtype, arch, len(ids), errs)
        for a, b in zip(kv_fused, kv_ref):   # the fused step wrote the same K/V at the same slots
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2
    assert len(ids) == 64


def test_fused_forward_applies_only_to_packed_int8_steps(tmp_path, monkeypatch):
    path = make_tiny_llama_gguf(tmp_path / "tiny.gguf", qtype="Q4_1", hidden=128, inter=256, heads=4, kv_heads=2)
    assert load_model(str(path), weight_format="fp32").model.fused_forward() is None   # dense weights
    model = load_model(str(path), weight_format="auto").model
    fused = model.fused_forward()
    assert fused is not None
    points = [p for p in (get_config().bf16_min_tokens, get_config().f32_min_tokens) if p is not None]
    assert fused.max_tokens == (min(points) - 1 if points else 16)   # below the layers' own GEMM switch
    cfg = model.config
    kv = [torch.zeros(2, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float16)
          for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata.build([1], [1], [[0]], BLOCK)
    x = torch.zeros(1, cfg.hidden_size)
    assert fused(x, torch.tensor([0]), meta, kv) is None     # fp16 cache: no C kernel, PyTorch path
    monkeypatch.setenv("KVSERVE_FUSED_FORWARD", "0")
    assert FusedForward.build(model) is None
