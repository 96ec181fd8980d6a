"""Every Llama-family shape on the fast path (issue 52): small random GGUFs with the real features
(vocabularies of 128k-256k, untied heads, head_dim 64/80/96/128, q/k/v biases, rope scaling from
GGUF metadata or rope_freqs.weight) decode greedily to the same tokens on the whole-stack C forward
as on the PyTorch reference path (KVSERVE_FUSED_FORWARD=0), with nothing left on a slow path.
`make test-avx2` runs this file again as on an AVX2-only CPU; natively it covers AMX, and on an AMX
CPU the AVX-512 kernels too (test_greedy_matches_the_reference_path_on_avx512).
RoPE scaling is checked against transformers' own formulas for the same config."""

import os
from dataclasses import replace

import pytest
import torch
from paged_greedy import assert_on_the_fast_path, paged_greedy
from test_shapes_gguf import Shape, llama3_freq_factors, write_shape

from kvserve.model.attention import AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kv_quant import cache_shape
from kvserve.model.loader import load_model
from kvserve.model.rope import RotaryEmbedding, rope_attention_factor, rope_inv_freq

BACKEND = KernelBackend.detect()
needs_kernels = pytest.mark.skipif(BACKEND.lib is None, reason="compiled kernels unavailable")
BLOCK = 16
LLAMA31 = {"type": "llama3", "factor": 8.0, "low": 1.0, "high": 4.0, "original": 8192}

SHAPES = [
    # Llama 3.2-1B-like: 128k vocabulary, untied head, Llama 3.1's rope scaling as rope_freqs.weight
    Shape("llama3-128k", vocab=128256, heads=8, kv_heads=2, head_dim=64, qtype="Q4_K", rope=LLAMA31),
    # Qwen2.5-like: 152k vocabulary, head_dim 128, q/k/v biases, YaRN in the metadata
    Shape("qwen2-152k", arch="qwen2", vocab=151936, heads=2, kv_heads=1, head_dim=128, qtype="Q4_0", bias=True,
          rope={"type": "yarn", "factor": 4.0, "original": 1024}, theta=1e6),
    # head_dim 80 (Phi-2/StableLM-like sizes), tied, linear rope scaling
    Shape("hd80-linear", vocab=32000, heads=4, kv_heads=4, head_dim=80, qtype="Q8_0", tied=True,
          rope={"type": "linear", "factor": 2.0}),
    # head_dim 96 with a 256k vocabulary (Gemma's size), GQA 4:1
    Shape("hd96-256k", vocab=256000, heads=4, kv_heads=1, head_dim=96, qtype="Q4_1"),
]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: s.name)
def model(request, tmp_path_factory):
    path = write_shape(tmp_path_factory.mktemp("shapes") / f"{request.param.name}.gguf", request.param)
    return load_model(str(path), backend=BACKEND).model


def _greedy(model, backend: KernelBackend, prompt: list[int], n: int, chunks: list[int] | None = None,
            kv_dtype: torch.dtype = torch.float16) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill `prompt` (in `chunks`, default one) then decode greedily: the argmax at every prompt
    position (one chunk only) and the n decoded tokens, and every decode step's logits row. The
    fp16 KV cache is the engine's default."""
    cfg = model.config
    blocks = (len(prompt) + n) // BLOCK + 1
    table = list(range(blocks))[::-1]   # blocks out of order, as the engine's pool hands them
    kv = [torch.zeros(cache_shape(blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, kv_dtype),
                      dtype=kv_dtype) for _ in range(cfg.num_hidden_layers)]
    return paged_greedy(model, backend, prompt, n, kv,
                        lambda q, s: AttentionMetadata.build([q], [s], [table], BLOCK), chunks)


@needs_kernels
def test_every_shape_is_on_the_fast_path(model):
    assert_on_the_fast_path(BACKEND, model)


@needs_kernels
def test_greedy_matches_the_reference_path(model):
    """Token for token against KVSERVE_FUSED_FORWARD=0 (PyTorch layer ops over the same packed
    weights). The logits agree to a few int8 rounding steps: a last-bit difference (C vs torch
    summation order in norms, RoPE, attention) may move an activation across an int8 or fp16 KV
    rounding boundary, ~1e-3 to 1e-2 (test_fused_forward.py's bound too)."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, model.config.vocab_size, (40,), generator=g).tolist()
    fast, fast_logits = _greedy(model, BACKEND, prompt, 16)
    ref, ref_logits = _greedy(model, replace(BACKEND, fused_forward=False), prompt, 16)
    assert fast == ref
    for a, b in zip(fast_logits, ref_logits):
        assert ((a - b).norm() / b.norm()).item() < 3e-2
    assert len(fast) == 40 + 16 and len(set(fast)) > 3   # the model does not say one thing only


# On an AMX CPU the default run covers AMX; this covers the AVX-512 kernels the same CPU also has
# (an AVX-512 CPU without AMX, like AMD Zen 4/5, runs those). `make test-avx2` sets KVSERVE_ISA.
AVX512_TOO = BACKEND.isa == "amx" and not os.environ.get("KVSERVE_ISA")


@pytest.mark.skipif(not AVX512_TOO, reason="needs an AMX CPU and no KVSERVE_ISA (AVX-512 is then the default)")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_greedy_matches_the_reference_path_on_avx512(shape, tmp_path):
    backend = KernelBackend.detect(isa="avx512")
    assert backend.isa == "avx512"
    model = load_model(str(write_shape(tmp_path / f"{shape.name}.gguf", shape)), backend=backend).model
    assert backend.slow_paths(model) == []
    g = torch.Generator().manual_seed(7)     # the prompt of the test above (random models have near ties)
    prompt = torch.randint(3, model.config.vocab_size, (40,), generator=g).tolist()
    fast, _ = _greedy(model, backend, prompt, 16)
    ref, _ = _greedy(model, replace(backend, fused_forward=False), prompt, 16)
    assert fast == ref and len(set(fast)) > 3


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.int8])
def test_chunked_prompt_gives_the_same_bits(model, kv_dtype):
    """Batch invariance on these shapes: a prompt in chunks (tiles of the head size's vector
    attention beside lone queries) gives the one-chunk logits bit for bit."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, model.config.vocab_size, (37,), generator=g).tolist()
    whole, whole_logits = _greedy(model, BACKEND, prompt, 4, kv_dtype=kv_dtype)
    parts, parts_logits = _greedy(model, BACKEND, prompt, 4, chunks=[3, 17, 1, 16], kv_dtype=kv_dtype)
    assert whole[-4:] == parts
    assert all(torch.equal(a, b) for a, b in zip(whole_logits, parts_logits))


def test_head_dim_72_is_named_on_the_startup_line(tmp_path):
    s = Shape("hd72", vocab=1000, heads=4, kv_heads=2, head_dim=72, qtype="Q8_0")
    m = load_model(str(write_shape(tmp_path / "hd72.gguf", s)), backend=BACKEND).model
    line = BACKEND.describe_model(m)
    if BACKEND.lib is None:
        assert "PyTorch path" in line
    else:
        assert "every layer's attention on the generic C loop: head_dim 72 has no vector kernel" in line
    off = replace(BACKEND, fused_forward=False)
    if BACKEND.lib is not None:
        assert off.describe_model(m).endswith("the C forward is off (KVSERVE_FUSED_FORWARD=0)")


# ---- rope scaling against transformers --------------------------------------------------------

def _hf(kind: str, params: dict, head_dim: int, theta: float, ctx: int):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                                   max_position_embeddings=ctx, rope_parameters={"rope_type": kind,
                                                                                 "rope_theta": theta, **params})
    inv, attn = ROPE_INIT_FUNCTIONS[kind](cfg) if kind != "default" else (None, 1.0)
    return inv, attn, LlamaRotaryEmbedding(cfg)


ROPES = [
    ("linear", {"factor": 4.0}, 64, 10000.0),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, 64, 500000.0),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 1024}, 128, 1e6),
    ("yarn", {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0, "beta_slow": 2.0}, 80,
     10000.0),
    ("yarn", {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
     96, 10000.0),
]


@pytest.mark.parametrize("kind,params,head_dim,theta", ROPES)
def test_rope_scaling_matches_transformers(kind, params, head_dim, theta):
    ctx = 8192
    inv, attn, hf_rope = _hf(kind, params, head_dim, theta, ctx)
    cfg = ModelConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, rope_theta=theta,
                      max_position_embeddings=ctx, rope_scaling={"rope_type": kind, **params}, num_hidden_layers=1)
    torch.testing.assert_close(rope_inv_freq(cfg), inv.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg) == pytest.approx(attn, rel=1e-12)
    ours = RotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 17, 1000, 4095, 8191])
    with torch.no_grad():
        cos, sin = hf_rope(torch.zeros(1, len(pos), head_dim), pos[None])
    torch.testing.assert_close(ours.cos[pos], cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(ours.sin[pos], sin[0], rtol=0, atol=2e-6)


def test_llama31_rope_freqs_from_gguf_match_transformers_llama3():
    """llama.cpp stores Llama 3.1's scaling as per-frequency factors: they give HF's llama3 frequencies."""
    p = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv, _, _ = _hf("llama3", p, 128, 500000.0, 8192)
    factors = llama3_freq_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192).tolist()
    cfg = ModelConfig(hidden_size=256, num_attention_heads=2, head_dim=128, rope_theta=500000.0, num_hidden_layers=1,
                      rope_scaling={"rope_type": "freq_factors", "factors": factors})
    torch.testing.assert_close(rope_inv_freq(cfg), inv.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("rope,expect", [
    ({"type": "yarn", "factor": 4.0, "original": 1024},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0,
      "beta_slow": 1.0}),
    ({"type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    (LLAMA31, None),
])
def test_gguf_rope_metadata_becomes_the_hf_scaling(tmp_path, rope, expect):
    s = Shape("rope", vocab=600, heads=2, kv_heads=1, head_dim=128, qtype="Q8_0", rope=rope, layers=1)
    cfg = load_model(str(write_shape(tmp_path / "rope.gguf", s)), backend=KernelBackend.pytorch()).config
    if expect is None:
        assert cfg.rope_scaling["rope_type"] == "freq_factors" and len(cfg.rope_scaling["factors"]) == 64
    else:
        assert cfg.rope_scaling == expect


# ---- sampling over a large vocabulary ----------------------------------------------------------

@pytest.mark.parametrize("scale", [0.5, 3.0, 20.0])   # flat (past 4,096 candidates), medium, peaked
def test_top_p_over_a_128k_vocabulary_matches_a_full_sort(scale):
    """top_p widens its candidates (256, then 4,096, then the full sort) only as far as needed, and
    keeps exactly the tokens a full sort of the vocabulary keeps."""
    from kvserve.engine.sampler import _top_p

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 128256, generator=g) * scale
    top_p = [0.95, 0.5, 0.999]
    vals = logits.sort(dim=-1, descending=True).values
    probs = (vals - logits.logsumexp(dim=-1, keepdim=True)).exp()
    keep = ((probs.cumsum(dim=-1) - probs) < torch.tensor(top_p)[:, None]).sum(dim=-1, keepdim=True)
    expect = logits.masked_fill(logits < vals.gather(1, keep - 1), float("-inf"))
    assert torch.equal(_top_p(logits, top_p), expect)
