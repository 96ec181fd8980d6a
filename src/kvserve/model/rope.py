"""RoPE: the inverse frequencies of every rope scaling a Llama-family model declares, and the
cos/sin tables both layer paths read (the PyTorch ops and the C forward use the same tables, so a
scaling type is supported on the fast path as soon as it is supported here).

Scaling types, as Hugging Face names them in `rope_scaling` (transformers' modeling_rope_utils is
the reference the tests compare against): `default`, `linear` (positions divided by `factor`),
`llama3` (Llama 3.1: low frequencies divided by `factor`, a smooth ramp between), `yarn` (NTK-by-
parts interpolation and an attention factor that scales cos and sin), and `freq_factors`, GGUF's
precomputed `rope_freqs.weight` (what llama.cpp's converter writes for Llama 3.1 instead of the
llama3 parameters). `rope_scaling_from_gguf` translates GGUF metadata into that dict.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from kvserve.errors import ModelLoadError
from kvserve.model.config import ModelConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: torch.Tensor, cfg: ModelConfig, rs: dict[str, Any]) -> torch.Tensor:
    """YaRN's NTK-by-parts frequencies (transformers' _compute_yarn_parameters)."""
    d, base = cfg.head_dim, cfg.rope_theta
    factor = rs.get("factor") or cfg.max_position_embeddings / rs["original_max_position_embeddings"]
    old = rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr_dim(rotations: float) -> float:
        return (d * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies for cfg's rope_theta and rope_scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if not rs:
        return inv_freq
    kind = rope_type(cfg)
    if kind == "default":
        return inv_freq
    if kind == "freq_factors":   # GGUF's precomputed `rope_freqs.weight` (Llama 3.x)
        return inv_freq / torch.tensor(rs["factors"], dtype=torch.float32)
    if kind == "linear":
        return inv_freq / rs["factor"]
    if kind == "yarn":
        return _yarn(inv_freq, cfg, rs)
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]   # llama3
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def rope_type(cfg: ModelConfig) -> str:
    """cfg's scaling type (a ModelLoadError for one kvserve does not implement)."""
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope scaling {kind!r}: kvserve supports {', '.join(ROPE_TYPES)}")
    return kind


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 for the other types)."""
    rs = cfg.rope_scaling or {}
    if rope_type(cfg) != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    factor = rs.get("factor") or cfg.max_position_embeddings / rs["original_max_position_embeddings"]
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def rope_scaling_from_gguf(get: Callable[[str, Any], Any]) -> dict[str, Any] | None:
    """`rope_scaling` from GGUF metadata; get(key, default) reads `<arch>.<key>`. llama.cpp's YaRN
    multiplies its attention factor (`rope.scaling.attn_factor`, default 1) into YaRN's own
    0.1 ln(factor) + 1, which is transformers' attention_factor."""
    kind = get("rope.scaling.type", None)
    factor = get("rope.scaling.factor", None)
    if kind in (None, "none") or factor is None:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        orig = get("rope.scaling.original_context_length", None)
        if orig is None:
            raise ModelLoadError("GGUF metadata: YaRN rope scaling without rope.scaling.original_context_length")
        out = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(orig),
               "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
               "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0))}
        attn = get("rope.scaling.attn_factor", None)
        if attn is not None and float(attn) != 1.0:
            out["attention_factor"] = float(attn) * _yarn_mscale(float(factor))
        return out
    raise ModelLoadError(f"unsupported GGUF rope scaling type {kind!r}: kvserve supports linear and yarn "
                         f"(Llama 3.1's scaling comes as rope_freqs.weight)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to the context length (HF's rotate-half layout),
    times the scaling's attention factor (YaRN).

    The angles are HF's float32 products; their cos and sin are computed in float64 by numpy and
    rounded once, so each entry is the float32 nearest the true value, whatever the process is
    doing. torch's CPU cos/sin go through MKL's VML, and a VML call that races another thread's
    first use of MKL (the sentence encoder loading beside the model) can run at VML's EP accuracy,
    11 bits: one load in a few gave a table off by up to 1.5e-4 for its whole life, so every greedy
    answer of that process differed (issue 53, BENCHMARKS.md)."""

    def __init__(self, cfg: ModelConfig, theta: float | None = None):
        super().__init__()
        cfg = cfg if theta is None else replace(cfg, rope_theta=theta, rope_scaling=None)
        inv_freq = rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1).numpy().astype(np.float64)
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        attn = rope_attention_factor(cfg)
        if attn != 1.0:   # as transformers: the float32 tables times the factor
            cos, sin = cos * np.float32(attn), sin * np.float32(attn)
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]
