"""KernelBackend: the ISA level from CPU flags, KVSERVE_ISA forcing a lower one, batch invariance by
default (KVSERVE_BATCH_INVARIANT=0 restores the GEMM and SDPA switch points), the switches read once
at detection, one log line per load, and PyTorch-only models (another device, no kernels)."""

import logging
from dataclasses import replace

import pytest
import torch
from ggufmaker import make_tiny_llama_gguf

from kvserve.model.attention import AttentionMetadata
from kvserve.model.kernels.backend import ATTN_C_MAX_QUERY, KernelBackend, features_up_to, isa_of
from kvserve.model.kernels.gguf_linear import GGUFQuantLinear
from kvserve.model.loader import load_model
from kvserve.model.ops import TorchOps

AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx_vnni"}
AMX = AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}
SWITCHES = ("KVSERVE_ISA", "KVSERVE_NO_KERNELS", "KVSERVE_BATCH_INVARIANT", "KVSERVE_BF16_MIN_TOKENS",
            "KVSERVE_F32_MIN_TOKENS", "KVSERVE_FUSED_FORWARD")


@pytest.fixture
def clean_env(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama_gguf(tmp_path_factory.mktemp("backend") / "tiny.gguf", qtype="Q8_0")


def test_isa_levels_from_flags():
    assert isa_of(set()) == "torch" and isa_of({"avx2", "fma"}) == "torch"
    assert isa_of(AVX2 | {"avx_vnni"}) == "avx2"
    assert isa_of(AVX512) == "avx512"
    assert isa_of(AMX) == "amx"
    assert isa_of(AMX - {"avx512bw"}) == "avx2"      # AMX without the AVX-512 baseline is not used
    # Forcing a level keeps only what a CPU of that level has.
    assert features_up_to("avx2", AMX) == AVX2
    assert features_up_to("avx512", AMX) == AVX512
    assert features_up_to("amx", AMX) == AMX


def test_forced_avx2_is_an_avx2_cpu(clean_env):
    full = KernelBackend.detect()
    if full.lib is None:
        pytest.skip(f"no kernels here ({full.reason})")
    b = KernelBackend.detect(isa="avx2")
    assert b.isa == "avx2" and b.features <= AVX2 and b.lib is not None
    assert b.batch_invariant and (b.bf16_min_tokens, b.f32_min_tokens, b.attn_c_max_query) == (None, None, None)
    assert not b.bf16_prepack                                     # oneDNN refuses bf16 prepacking on AVX2
    clean_env.setenv("KVSERVE_ISA", "avx2")                       # the environment says the same
    assert KernelBackend.detect().features == b.features
    clean_env.setenv("KVSERVE_BATCH_INVARIANT", "0")              # invariance off: fp32 MKL for large calls
    off = KernelBackend.detect()
    assert (off.isa, off.bf16_min_tokens, off.f32_min_tokens, off.attn_c_max_query) == ("avx2", None, 32, 16)


def test_batch_invariant_by_default(clean_env):
    """Default: the int8 kernels for every step size and C attention for every query token.
    KVSERVE_BATCH_INVARIANT=0: bf16 oneDNN from 3 tokens on AMX, else fp32 MKL from 32, and SDPA
    for chunks of more than 16 query tokens; the one-call forward (every step by default) stops
    below the GEMM switch."""
    b = KernelBackend.detect()
    if b.lib is None:
        pytest.skip(f"no kernels here ({b.reason})")
    assert b.batch_invariant
    assert (b.bf16_min_tokens, b.f32_min_tokens, b.attn_c_max_query) == (None, None, None)
    assert b.max_fused_tokens >= 4096                          # every step runs the whole-stack C forward
    assert "batch-invariant: int8 kernels for every step size, C attention for every query" in b.describe()
    clean_env.setenv("KVSERVE_BATCH_INVARIANT", "1")
    assert KernelBackend.detect().batch_invariant
    clean_env.setenv("KVSERVE_BATCH_INVARIANT", "0")
    off = KernelBackend.detect()
    assert off.lib is not None and not off.batch_invariant and off.attn_c_max_query == ATTN_C_MAX_QUERY == 16
    if off.isa == "amx":
        assert (off.bf16_min_tokens, off.f32_min_tokens, off.max_fused_tokens) == (3, None, 2)
    else:
        assert (off.bf16_min_tokens, off.f32_min_tokens, off.max_fused_tokens) == (None, 32, 31)
    assert "batch-dependent numerics" in off.describe() and "SDPA above" in off.describe()
    # The token-count switches still override the defaults, with invariance on or off.
    clean_env.setenv("KVSERVE_F32_MIN_TOKENS", "64")
    assert KernelBackend.detect().f32_min_tokens == 64
    clean_env.delenv("KVSERVE_BATCH_INVARIANT")
    on = KernelBackend.detect()
    assert on.f32_min_tokens == 64 and not on.batch_invariant
    # A PyTorch-only backend is never batch-invariant (torch picks its matmul kernel by shape).
    assert not KernelBackend.pytorch().batch_invariant


def test_switches_are_read_at_detection_only(clean_env):
    base = KernelBackend.detect()
    if base.lib is None:
        pytest.skip(f"no kernels here ({base.reason})")
    clean_env.setenv("KVSERVE_BF16_MIN_TOKENS", "5")
    clean_env.setenv("KVSERVE_F32_MIN_TOKENS", "0")
    clean_env.setenv("KVSERVE_FUSED_FORWARD", "0")
    b = KernelBackend.detect()
    assert (b.bf16_min_tokens, b.f32_min_tokens, b.fused_forward, b.max_fused_tokens) == (5, None, False, 0)
    # A backend made earlier, and every layer holding it, is untouched by the new environment.
    assert base.fused_forward and (base.bf16_min_tokens, base.f32_min_tokens) != (5, None)
    clean_env.setenv("KVSERVE_NO_KERNELS", "1")
    off = KernelBackend.detect()
    assert off.lib is None and off.isa == "torch" and "KVSERVE_NO_KERNELS" in off.reason
    clean_env.setenv("KVSERVE_ISA", "sse2")
    with pytest.raises(ValueError, match="KVSERVE_ISA"):
        KernelBackend.detect()


def test_one_log_line_per_load(tiny, clean_env, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.model.kernels.backend"):
        lm = load_model(str(tiny))
    lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.model.kernels.backend"]
    assert len(lines) == 1 and lines[0].startswith(f"kvserve kernels: isa={lm.backend.isa}"), lines
    assert lines[0] == lm.backend.describe()
    assert lm.model.backend is lm.backend
    assert all(m.backend is lm.backend for m in lm.model.modules() if isinstance(m, GGUFQuantLinear))


def _paged_logits(model, ids):
    cfg = model.config
    kv = [torch.zeros(2, 4, 16, cfg.num_key_value_heads, cfg.head_dim, device=model.rotary.cos.device)
          for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[2, 0]], 16, device=kv[0].device)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids, device=kv[0].device), torch.arange(len(ids), device=kv[0].device),
                       meta, kv)
        return model.compute_logits(hidden)


def test_pytorch_backend_runs_no_c_code(tiny):
    """A PyTorch-only backend: packed weights held dequantized, PyTorch layer ops, and the same
    logits as the fp32 model (both compute in fp32 from the same dequantized weights)."""
    lm = load_model(str(tiny), backend=KernelBackend.pytorch())
    linears = [m for m in lm.model.modules() if isinstance(m, GGUFQuantLinear)]
    assert linears and all(m.lib is None and m.desc is None and m.weight_f32 is not None for m in linears)
    assert type(lm.model.layer_ops()) is TorchOps
    ref = load_model(str(tiny), weight_format="fp32", backend=KernelBackend.pytorch()).model
    ids = [5, 9, 31, 2, 17]
    assert torch.allclose(_paged_logits(lm.model, ids), _paged_logits(ref, ids), atol=1e-4, rtol=1e-4)


def test_other_device_uses_pytorch_only(tiny):
    """device="meta" stands in for a GPU: no ctypes kernels, every tensor on the device, and the
    paged forward runs there (shapes only, on meta)."""
    lm = load_model(str(tiny), device="meta")
    assert lm.backend.lib is None and lm.backend.device == "meta"
    assert all(t.device.type == "meta" for t in [*lm.model.parameters(), *lm.model.buffers()])
    assert type(lm.model.layer_ops()) is TorchOps
    assert _paged_logits(lm.model, [5, 9, 31]).shape == (3, lm.config.vocab_size)


def test_replace_makes_an_independent_scratch():
    a = KernelBackend.pytorch()
    b = replace(a, f32_min_tokens=8)
    with a.f32_scratch(16) as sa, b.f32_scratch(4) as sb:
        assert sa.numel() == 16 and sb.numel() == 4 and sa.data_ptr() != sb.data_ptr()
