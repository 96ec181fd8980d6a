"""Small random GGUFs with the shapes of the Llama-family models people serve (issue 52): real
vocabulary sizes (up to 256k), untied heads, head_dim 64/80/96/128, q/k/v biases, rope scaling in
GGUF metadata (linear, YaRN) or as Llama 3.1's `rope_freqs.weight`; few layers and narrow widths.

Block-quantized matrices are random well-formed blocks (random nibbles or int8 values, small
random f16 scales) written directly: quantizing a 256k x 256 table through gguf-py takes seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from kvserve.model.gguf_write import add_llama_shape, finish

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass
class Shape:
    name: str
    arch: str = "llama"
    vocab: int = 32000
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    inter: int = 512
    layers: int = 2
    qtype: str = "Q4_1"
    tied: bool = False
    bias: bool = False
    rope: dict = field(default_factory=dict)   # "linear"/"yarn": GGUF metadata; "llama3": rope_freqs.weight
    ctx: int = 4096
    theta: float = 500000.0

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


def llama3_freq_factors(head_dim: int, theta: float, factor: float, low: float, high: float, old: int) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs.weight for Llama 3.1's rope scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks whose values have mean zero or near it (a row with a large mean would win
    every argmax: a random model that says one token)."""
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    nb = cols // block
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    d = rng.uniform(0.004, 0.012, size=(rows, nb)).astype(np.float16)
    if qtype == "Q8_0":
        d = (d / 8).astype(np.float16)
    if qtype == "Q4_0":   # nibbles 1..15: (q - 8) d has mean zero
        lo, hi = (rng.integers(1, 16, size=(rows, nb, size - 2), dtype=np.uint8) for _ in range(2))
        raw[:, :, 2:] = lo | (hi << 4)
    if qtype in ("Q4_0", "Q8_0"):
        raw[:, :, 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
    elif qtype == "Q4_1":
        raw[:, :, 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
        raw[:, :, 2:4] = (d.astype(np.float32) * -7.5).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    elif qtype == "Q4_K":   # every sub-block's 6-bit scale equals its min (12 bytes of 0x11 k): with
        dk = (d / 24).astype(np.float16)   # dmin = 7.5 d the values d sc (q - 7.5) have mean zero
        raw[:, :, 0:2] = dk.view(np.uint8).reshape(rows, nb, 2)
        raw[:, :, 2:4] = (dk.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
        raw[:, :, 4:16] = (0x11 * rng.integers(1, 4, size=(rows, nb, 1))).astype(np.uint8)
    else:
        raise ValueError(qtype)
    return raw.reshape(rows, nb * size)


def write_shape(path: Path, s: Shape, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = _SPECIALS + alphabet + ["Ġt", "he"]
    tokens += [f"x{i}" for i in range(s.vocab - len(tokens))]
    w = gguf.GGUFWriter(str(path), s.arch)
    add_llama_shape(w, name=s.name, layers=s.layers, ctx=s.ctx, hidden=s.hidden, inter=s.inter, heads=s.heads,
                    kv_heads=s.kv_heads)
    w.add_rope_freq_base(s.theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.vocab)
    kind = s.rope.get("type")
    if kind in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.rope["factor"])
        if kind == "yarn":
            w.add_rope_scaling_orig_ctx_len(s.rope["original"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(_SPECIALS) + [1] * (s.vocab - len(_SPECIALS)))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)

    def mat(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, _blocks(rows, cols, s.qtype, rng), raw_dtype=gguf.GGMLQuantizationType[s.qtype])

    def vec(name: str, n: int, base: float, spread: float = 0.1) -> None:
        w.add_tensor(name, (base + spread * rng.standard_normal(n)).astype(np.float32))

    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    mat("token_embd.weight", s.vocab, s.hidden)
    if kind == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(s.head_dim, s.theta, s.rope["factor"], s.rope["low"],
                                                              s.rope["high"], s.rope["original"]))
    for i in range(s.layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", s.hidden, 1.0)
        vec(p + "ffn_norm.weight", s.hidden, 1.0)
        mat(p + "attn_q.weight", q, s.hidden)
        mat(p + "attn_k.weight", kv, s.hidden)
        mat(p + "attn_v.weight", kv, s.hidden)
        mat(p + "attn_output.weight", s.hidden, q)
        mat(p + "ffn_gate.weight", s.inter, s.hidden)
        mat(p + "ffn_up.weight", s.inter, s.hidden)
        mat(p + "ffn_down.weight", s.hidden, s.inter)
        if s.bias:
            vec(p + "attn_q.bias", q, 0.0, 0.5)
            vec(p + "attn_k.bias", kv, 0.0, 0.5)
            vec(p + "attn_v.bias", kv, 0.0, 0.5)
    vec("output_norm.weight", s.hidden, 1.0)
    if not s.tied:
        mat("output.weight", s.vocab, s.hidden)
    finish(w)
    return path
