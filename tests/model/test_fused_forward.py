"""The one-call C forward of the layer stack against the per-layer PyTorch path on the same packed
weights: tiny GGUF models of every packed type, llama and qwen2 (q/k/v bias), GQA, fp32 and bf16
KV caches, batches of 1, 7 and 64 tokens mixing decodes with prompt chunks."""

from dataclasses import replace

import pytest
import torch
from ggufmaker import make_tiny_llama_gguf

from kvserve.model.attention import AttentionMetadata
from kvserve.model.kernels.backend import UNLIMITED_TOKENS, KernelBackend
from kvserve.model.kernels.cpu_ops import CpuOps
from kvserve.model.kv_quant import cache_shape, to_compute
from kvserve.model.loader import load_model
from kvserve.model.ops import TorchOps

BACKEND = KernelBackend.detect()
pytestmark = pytest.mark.skipif(BACKEND.lib is None, reason="compiled kernels unavailable")

BLOCK = 16


@pytest.fixture
def int8_only():
    """Every call on the int8 kernels (no bf16/fp32 GEMM switch), so any batch size can be fused."""
    return replace(BACKEND, bf16_min_tokens=None, f32_min_tokens=None)


def _tiny(tmp_path, qtype, arch, weight_format="auto", backend=BACKEND):
    path = make_tiny_llama_gguf(tmp_path / f"tiny-{qtype}-{arch}.gguf", qtype=qtype, arch=arch,
                                hidden=256, inter=512, heads=8, kv_heads=2, layers=3, ctx=256)
    return load_model(str(path), weight_format=weight_format, backend=backend).model


def _step(model, path: str | None, ids, positions, meta, kv):
    """One paged forward: path None = the PyTorch layers, "one-call" = kvs_forward for the whole
    step, "batched" = the layers' projections with the C glue between them. The path is picked by
    giving the model a variant of its backend (the projections keep theirs)."""
    base = model.backend
    model.backend = replace(base, fused_forward=path is not None, fused_max_tokens=64 if path == "one-call" else 0)
    assert type(model.layer_ops()) is (CpuOps if path else TorchOps)
    try:
        with torch.inference_mode():
            return model(torch.tensor(ids), torch.tensor(positions), meta, kv)
    finally:
        model.backend = base


def _run_plans(model, path, kv_dtype, check):
    """Prefill 10 sequences (PyTorch path), then steps of 1, 7, 64 and 22 tokens (decodes, chunks of
    2-9 tokens, one of 20: SDPA in the batched path) on `path` and on the PyTorch path, each with its
    own copy of the KV cache; check(out, ref, n_tokens) per step, and the caches must agree."""
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    prefix = [3 + 11 * i for i in range(10)]
    blocks = torch.randperm(80, generator=g).tolist()   # scattered blocks, 8 per sequence
    tables = [blocks[8 * i: 8 * i + 8] for i in range(10)]
    kv_ref = [torch.zeros(cache_shape(80, BLOCK, cfg.num_key_value_heads, cfg.head_dim, kv_dtype), dtype=kv_dtype)
              for _ in range(cfg.num_hidden_layers)]
    tokens = [torch.randint(3, cfg.vocab_size, (128,), generator=g).tolist() for _ in range(10)]
    meta = AttentionMetadata.build(prefix, prefix, tables, BLOCK)
    _step(model, None, [tok for t, n in zip(tokens, prefix) for tok in t[:n]],
          [p for n in prefix for p in range(n)], meta, kv_ref)
    kv_new = [c.clone() for c in kv_ref]
    sizes = []
    for plan in ({0: 1}, {1: 1, 2: 3, 3: 1, 4: 1, 5: 1},
                 {**{i: 9 for i in range(6)}, 6: 3, 7: 3, 8: 2, 9: 2}, {0: 20, 1: 1, 2: 1}):
        ids, pos, q_lens, s_lens, tbl = [], [], [], [], []
        for i, n in plan.items():
            ids += tokens[i][prefix[i]: prefix[i] + n]
            pos += range(prefix[i], prefix[i] + n)
            q_lens.append(n)
            s_lens.append(prefix[i] + n)
            tbl.append(tables[i])
            prefix[i] += n
        meta = AttentionMetadata.build(q_lens, s_lens, tbl, BLOCK)
        ref = _step(model, None, ids, pos, meta, kv_ref)
        out = _step(model, path, ids, pos, meta, kv_new)
        assert out.shape == ref.shape == (len(ids), cfg.hidden_size)
        check(out, ref, len(ids))
        for a, b in zip(kv_new, kv_ref):   # the same K/V at the same slots
            a, b = to_compute(a, torch.float32), to_compute(b, torch.float32)
            assert ((a - b).norm() / b.norm()).item() < 1e-2
        sizes.append(len(ids))
    assert sizes == [1, 7, 64, 22]


def _rel_rows(a, b):
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("path", ["one-call", "batched"])
@pytest.mark.parametrize("qtype,arch", [("Q4_1", "llama"), ("Q4_0", "llama"), ("Q8_0", "qwen2"), ("Q4_K", "llama")])
def test_fused_forward_matches_layer_path(tmp_path, int8_only, qtype, arch, path, kv_dtype):
    model = _tiny(tmp_path, qtype, arch, backend=int8_only)
    assert model.layer_ops().packed

    rows = []

    def check(out, ref, n):
        # Same int8 quantization and tiles: rows agree to float rounding (~3e-7), except where a
        # last-bit difference (C vs torch summation order in norms, RoPE, attention) moves an
        # activation across an int8 (or 16-bit K/V) rounding boundary: one quantization step,
        # ~1e-3 to 1e-2 after a few layers, and the later rows of the same sequence inherit it
        # through attention (so the step with a 20-token chunk is left out of the count).
        errs = _rel_rows(out, ref)
        assert errs.max().item() < 3e-2, (n, errs)
        if n != 22:
            rows.append(errs)

    _run_plans(model, path, kv_dtype, check)
    errs = torch.cat(rows)
    assert (errs < 1e-5).float().mean().item() >= 0.5, errs


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_glue_matches_layer_path_fp32(tmp_path, arch, kv_dtype):
    """Dense fp32 weights: no int8 step anywhere, so the C glue must agree with PyTorch to rounding
    (with a bf16 cache, to one bf16 rounding step of a K/V element where the last bit differs)."""
    model = _tiny(tmp_path, "Q8_0", arch, weight_format="fp32")
    assert not model.layer_ops().packed
    # 16-bit K/V: a last-bit flip is one 16-bit step; int8 rows: one int8 step of a K/V element
    bound = {torch.float32: 1e-5, torch.int8: 2e-2}.get(kv_dtype, 1e-3)

    def check(out, ref, n):
        assert _rel_rows(out, ref).max().item() < bound, n

    _run_plans(model, "batched", kv_dtype, check)


def test_fused_forward_applies_only_to_packed_int8_steps(tmp_path):
    path = make_tiny_llama_gguf(tmp_path / "tiny.gguf", qtype="Q4_1", hidden=128, inter=256, heads=4, kv_heads=2)
    dense_model = load_model(str(path), weight_format="fp32", backend=BACKEND).model
    dense = dense_model.layer_ops()
    assert not dense.packed and dense.max_tokens == 0    # dense weights: only the batched glue
    model = load_model(str(path), weight_format="auto", backend=BACKEND).model
    # The packed model keeps no fp32 embedding table: rows come from the packed (untied) weights.
    assert model.embed_tokens is None and dense_model.embed_tokens is not None
    ids = torch.tensor([[5, 7, 200]])
    assert torch.equal(model.embed(ids), dense_model.embed(ids))
    ops = model.layer_ops()
    assert isinstance(ops, CpuOps) and ops.packed
    points = [p for p in (BACKEND.bf16_min_tokens, BACKEND.f32_min_tokens) if p is not None]
    # below the layers' own GEMM switch; without one (batch-invariant), every step
    assert ops.max_tokens == (min(points) - 1 if points else UNLIMITED_TOKENS)
    cfg = model.config
    kv = [torch.zeros(2, 4, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float64)
          for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata.build([1], [1], [[0]], BLOCK)
    x = torch.zeros(1, cfg.hidden_size)
    assert ops.prepare(x, torch.tensor([0]), meta, kv) is None     # fp64 cache: no C kernel, PyTorch path
    with torch.inference_mode():                                   # ... which still answers
        assert model(torch.tensor([5]), torch.tensor([0]), meta, kv).shape == (1, cfg.hidden_size)
    model.backend = replace(BACKEND, fused_forward=False)
    assert type(model.layer_ops()) is TorchOps


@pytest.mark.parametrize(("fmt", "tol"), [("q8_0", 0.05), ("q4_1", 0.2)])
def test_packed_formats_pack_dense_weights_for_the_c_forward(tmp_path, fmt, tol):
    """weight_format="q8_0" or "q4_1": a dense (F32) model's projections are packed into those blocks
    at load, so it runs the one-call C forward, and answers close to its fp32 self."""
    import gguf

    path = make_tiny_llama_gguf(tmp_path / "tiny-f32.gguf", hidden=128, inter=256, heads=4, kv_heads=2)
    dense = load_model(str(path), weight_format="fp32", backend=BACKEND).model
    packed = load_model(str(path), weight_format=fmt, backend=BACKEND).model
    ops = packed.layer_ops()
    assert isinstance(ops, CpuOps) and ops.packed and not dense.layer_ops().packed
    assert packed.layers[0].down_proj.qtype == gguf.GGMLQuantizationType[fmt.upper()]
    cfg = packed.config
    ids = [5, 7, 200, 31, 64, 9]
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[0]], BLOCK)
    outs = []
    for m in (dense, packed):
        kv = [torch.zeros(cache_shape(2, BLOCK, cfg.num_key_value_heads, cfg.head_dim, torch.float32))
              for _ in range(cfg.num_hidden_layers)]
        with torch.inference_mode():
            outs.append(m(torch.tensor(ids), torch.arange(len(ids)), meta, kv))
    assert _rel_rows(outs[1], outs[0]).max() < tol
    assert not torch.equal(outs[1], outs[0])


@pytest.mark.skipif(BACKEND.attn_isa < 1, reason="no AVX-512 on this CPU: only the AVX2 attention build runs")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_avx512_attention_gives_the_avx2_bits(tmp_path, int8_only, head_dim, kv_dtype):
    """The AVX-512 attention (cpu/kvserve_attention_avx512.cpp) against the AVX2 one: the same
    hidden states bit for bit, for prompt chunks of 1-16 queries (odd and even: rows in threes and
    what is left), prefixes with and without a partial 8-key block, GQA groups of 3, and lone
    queries (decodes) beside them, one KV head per work item or all three."""
    path = make_tiny_llama_gguf(tmp_path / f"tiny-{head_dim}.gguf", qtype="Q8_0", hidden=6 * head_dim, inter=256,
                                heads=6, kv_heads=2, layers=2, ctx=256)
    model = load_model(str(path), backend=int8_only).model
    avx2 = replace(int8_only, isa="avx2")
    assert avx2.attn_isa == 0 and int8_only.attn_isa == 1
    cfg = model.config
    g = torch.Generator().manual_seed(head_dim)
    # two prompts in chunks, and four sequences that take one token per step (decodes)
    chunks = [[5, 16, 13, 9, 16, 2, 11, 1, 16, 7, 15, 3], [16, 1, 16, 14, 8, 16, 12, 16, 6, 10, 4, 13]]
    chunks += [[1] * 12 for _ in range(4)]
    tables = [list(range(12 * s, 12 * s + 12)) for s in range(len(chunks))]
    tokens = [torch.randint(3, cfg.vocab_size, (sum(c),), generator=g).tolist() for c in chunks]
    caches = {b: [torch.zeros(cache_shape(12 * len(chunks), BLOCK, cfg.num_key_value_heads, cfg.head_dim, kv_dtype),
                              dtype=kv_dtype) for _ in range(cfg.num_hidden_layers)] for b in ("avx512", "avx2")}
    done = [0] * len(chunks)
    for step in range(len(chunks[0])):
        ids, pos, q_lens, s_lens = [], [], [], []
        for s in range(len(chunks)):
            n = chunks[s][step]
            ids += tokens[s][done[s]:done[s] + n]
            pos += range(done[s], done[s] + n)
            q_lens.append(n)
            done[s] += n
            s_lens.append(done[s])
        meta = AttentionMetadata.build(q_lens, s_lens, tables, BLOCK)
        outs = {}
        for name, backend in (("avx512", int8_only), ("avx2", avx2)):
            model.backend = replace(backend, fused_forward=True, fused_max_tokens=128)
            with torch.inference_mode():
                outs[name] = model(torch.tensor(ids), torch.tensor(pos), meta, caches[name])
        assert torch.equal(outs["avx512"], outs["avx2"]), (step, q_lens, s_lens)
    for a, b in zip(caches["avx512"], caches["avx2"]):
        assert torch.equal(a, b)


def test_captured_inner_layers_match_the_layer_path():
    """forward_features(capture_layers=...): the one-call C forward copies out the same residual rows as the layer path,
    RMS-normalised (an EAGLE-3-style draft reads them, spec_decode/eagle.py)."""
    m = load_model(None).model
    cfg = m.config
    if not getattr(m.layer_ops(), "packed", False):
        pytest.skip("no C whole-stack forward here")

    def caches():
        return [torch.zeros(cache_shape(8, 16, cfg.num_key_value_heads, cfg.head_dim, torch.float16),
                            dtype=torch.float16) for _ in range(cfg.num_hidden_layers)]

    ids, pos = torch.arange(100, 140), torch.arange(40)
    meta = AttentionMetadata.build([40], [40], [list(range(8))], 16)
    with torch.no_grad():
        h_c, aux_c = m.forward_features(ids, pos, meta, caches(), capture_layers=(14, 2, 26))
        ops = m.layer_ops()
        ops.forward_stack = lambda *a, **k: None
        h_l, aux_l = m.forward_features(ids, pos, meta, caches(), capture_layers=(14, 2, 26))
    assert aux_c.shape == (40, 3, cfg.hidden_size)
    assert torch.equal(h_c, h_l) and torch.equal(aux_c, aux_l)
    assert not torch.equal(aux_c[:, 0], aux_c[:, 1])
    assert torch.allclose(aux_c.pow(2).mean(-1), torch.ones(40, 3), atol=1e-4)
