"""Random-weight GGUF files of real model shapes, for start-up, memory and speed measurements.

`python -m kvserve.bench.gguf_random OUT.gguf --shape llama-1b --type Q4_1` writes a Llama-family
file the way llama.cpp's converter lays one out (architecture "llama" or "qwen2", byte-level BPE
tokenizer metadata, untied output head, norms in F32, q/k/v biases for Qwen2), with
block-quantized tensors whose payload bytes are random and whose block scales are small finite
float16s (values of mean about zero, so a random model does not say one token only): every kernel
runs on it and the numbers are those of a real file of that shape, written in seconds (no
quantization pass). The tokenizer is synthetic but of the real size (its tokens are byte pairs
grown by merges up to the vocabulary), so building it costs what a real one costs. The outputs
are meaningless: use it for speed and memory, never for quality.

Types: one block type for every matrix (Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0), or the mixes llama.cpp's
`Q4_K_M` / `Q5_K_M` write: Q6_K output head, Q6_K attn_v and ffn_down in the layers llama.cpp's
`use_more_bits` picks (the first and last eighth, every third between), Q4_K / Q5_K elsewhere.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvserve.model.gguf_write import add_llama_shape, finish


class Shape(NamedTuple):
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    arch: str = "llama"
    bias: bool = False        # q/k/v biases (Qwen2)
    head_dim: int = 0         # 0: hidden / heads (Gemma's is 256 whatever the width)
    window: int = 0           # sliding window (Gemma's local layers, Mistral, Phi-3); 0: none
    name: str = ""            # general.name: transformers reads arch "llama" named "...mistral..." as Mistral


# name -> Shape (untied head, head_dim = hidden / heads); a plain 6-tuple is a llama Shape
SHAPES: dict[str, tuple] = {
    "tiny": Shape(256, 512, 2, 4, 2, 4096),
    "llama-1b": Shape(2048, 5632, 22, 32, 4, 128256),       # TinyLlama-1.1B's body, Llama 3's vocabulary
    "llama-3b": Shape(3072, 8192, 28, 24, 8, 128256),       # Llama-3.2-3B
    "qwen2-3b": Shape(2048, 11008, 36, 16, 2, 128256, "qwen2", True),   # Qwen2.5-3B's body: head_dim 128, biases
    # the SentencePiece families' shapes (the tokenizer written is still the synthetic byte-level one)
    "gemma2-tiny": Shape(256, 512, 4, 4, 2, 4096, "gemma2", head_dim=256, window=16),
    "gemma2-2b": Shape(2304, 9216, 26, 8, 4, 256000, "gemma2", head_dim=256, window=4096),     # Gemma-2-2B
    "gemma3-tiny": Shape(256, 512, 7, 4, 1, 4096, "gemma3", head_dim=256, window=16),
    "gemma3-1b": Shape(1152, 6912, 26, 4, 1, 262144, "gemma3", head_dim=256, window=512),     # Gemma-3-1B
    "llama2-tiny": Shape(256, 512, 2, 4, 4, 4096, name="llama2"),
    "llama2-7b": Shape(4096, 11008, 32, 32, 32, 32000, name="llama2"),                        # Llama-2-7B
    "mistral-tiny": Shape(256, 512, 2, 4, 1, 4096, window=16, name="mistral"),
    "mistral-7b": Shape(4096, 14336, 32, 32, 8, 32000, window=4096, name="mistral"),         # Mistral-7B-v0.1
    "phi3-tiny": Shape(256, 512, 2, 4, 4, 4096, "phi3", window=24),
    "phi3-mini": Shape(3072, 8192, 32, 32, 32, 32064, "phi3", window=2047),                 # Phi-3-mini-4k
}
# What llama.cpp's converter writes per architecture beyond the Llama keys (convert_hf_to_gguf.py):
# Gemma 2: no rope.freq_base (10000), softcaps 50 / 30, sliding_window, tied head; Gemma 3: rope.freq_base
# 1e6 (local layers' 10000 is llama.cpp's constant), sliding_window, q/k norms, tied head; both store norms
# as 1 + w and key/value_length = head_dim. Phi-3: fused attn_qkv and ffn_up (gate then up),
# rope.dimension_count, sliding_window. Mistral: architecture llama, named so.
TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_K_M", "Q5_K_M")
_MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}


def synthetic_vocab(n: int) -> tuple[list[str], list[str]]:
    """n byte-level BPE tokens and the merges that make them (every merge's parts are tokens)."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tokens, merges, seen = list(alphabet), [], set(alphabet)
    i = 0
    while len(tokens) < n - len(specials):
        a, b = tokens[i // 97 % len(tokens)], alphabet[(i * 31 + 7) % len(alphabet)]
        i += 1
        if a + b in seen or len(a) > 12:
            continue
        seen.add(a + b)
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    return tokens + specials, merges


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _pack_k_scales(sc: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 scale bytes for 6-bit scales sc [..., 8] with each block's min equal to its scale."""
    out = np.empty((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = out[..., 0:4]
    out[..., 8:12] = (sc[..., 4:8] & 0x0F) * 0x11
    return out


def random_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes_per_row]: random quants and per-block float16 scales that give values of
    mean about zero and a standard deviation of about 0.6 / sqrt(cols) (a unit-RMS input gives
    outputs of about 0.6)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nb = cols // block
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    std = 0.6 / np.sqrt(cols) * rng.uniform(0.5, 1.5, size=(rows, nb)).astype(np.float32)
    name = qtype.name
    if name == "Q4_0":      # nibbles 1..15: (q - 8) d has mean zero
        lo, hi = (rng.integers(1, 16, size=(rows, nb, size - 2), dtype=np.uint8) for _ in range(2))
        raw[:, :, 2:] = lo | (hi << 4)
        raw[:, :, 0:2] = _f16_bytes(std / 4.32)
    elif name == "Q4_1":    # minimum -7.5 d
        d = std / 4.61
        raw[:, :, 0:2], raw[:, :, 2:4] = _f16_bytes(d), _f16_bytes(-7.5 * d)
    elif name == "Q8_0":
        raw[:, :, 0:2] = _f16_bytes(std / 73.9)
    elif name in ("Q4_K", "Q5_K"):   # 6-bit scale = min per block, dmin = 7.5 d (15.5 d): d sc (q - 7.5)
        sc = rng.integers(16, 64, size=(rows, nb, 8), dtype=np.uint8)
        d = std / (40 * (4.61 if name == "Q4_K" else 9.23))
        raw[:, :, 0:2], raw[:, :, 2:4] = _f16_bytes(d), _f16_bytes(d * (7.5 if name == "Q4_K" else 15.5))
        raw[:, :, 4:16] = _pack_k_scales(sc)
    elif name == "Q6_K":    # int8 scales of either sign, d at the end: d sc (q - 32)
        sc = rng.integers(16, 64, size=(rows, nb, 16)) * rng.choice([-1, 1], size=(rows, nb, 16))
        raw[:, :, 192:208] = sc.astype(np.int8).view(np.uint8)
        raw[:, :, 208:210] = _f16_bytes(std / (40 * 18.5))
    else:
        raise ValueError(f"no random blocks for {name}")
    return raw.reshape(rows, -1)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in a *_K_M file."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, qtype: str, n_layers: int) -> str:
    """The block type of tensor `name` in a file of type `qtype` (a single type, or a *_K_M mix)."""
    if qtype not in _MIXES:
        return qtype
    if name == "output.weight":
        return "Q6_K"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and use_more_bits(int(parts[1]), n_layers):
        return "Q6_K"
    return _MIXES[qtype]


def write(path: str | Path, shape: str = "llama-1b", qtype: str = "Q4_1", seed: int = 0,
          spm_model: str | Path | None = None) -> Path:
    """Write the random-weight file; returns its path. `spm_model`: a SentencePiece model whose
    vocabulary the file carries (tokenizer model `llama`, its size replacing the shape's) instead
    of the synthetic byte-level BPE."""
    import gguf

    s = Shape(*SHAPES[shape])
    if spm_model is not None:
        from kvserve.bench.gguf_vocab import sentencepiece_vocab
        s = s._replace(vocab=len(sentencepiece_vocab(spm_model)["tokens"]))
    if qtype not in TYPES:
        raise ValueError(f"type {qtype!r} is not one of {', '.join(TYPES)}")
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), s.arch)
    gemma = s.arch in ("gemma2", "gemma3")
    head_dim = s.head_dim or s.hidden // s.heads
    ctx = {"gemma3": 32768, "phi3": 4096}.get(s.arch, 32768 if s.name == "mistral" else
                                                4096 if s.name == "llama2" else 8192)
    add_llama_shape(w, name=f"random-{s.name or shape}-{qtype}", layers=s.layers, ctx=ctx, hidden=s.hidden,
                    inter=s.inter, heads=s.heads, kv_heads=s.kv_heads)
    w.add_layer_norm_rms_eps(1e-5 if s.arch in ("llama", "phi3") else 1e-6)
    if gemma:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if s.arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    else:
        w.add_rope_freq_base({"gemma3": 1e6, "phi3": 10000.0, "qwen2": 1e6}.get(
            s.arch, 10000.0 if s.name in ("llama2", "mistral") else 500000.0))
    if s.arch == "phi3":
        w.add_rope_dimension_count(head_dim)
    if s.window:
        w.add_sliding_window(s.window)
    w.add_vocab_size(s.vocab)
    if spm_model is not None:
        from kvserve.bench.gguf_vocab import add_sentencepiece_vocab
        add_sentencepiece_vocab(w, spm_model)
    else:
        tokens, merges = synthetic_vocab(s.vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_list(tokens)
        w.add_token_types([1] * (s.vocab - 3) + [3, 3, 3])
        w.add_token_merges(merges)
        w.add_bos_token_id(s.vocab - 3)
        w.add_eos_token_id(s.vocab - 1)

    def mat(name: str, rows: int, cols: int) -> None:
        qt = gguf.GGMLQuantizationType[tensor_type(name, qtype, s.layers)]
        w.add_tensor(name, random_blocks(rows, cols, qt, rng), raw_dtype=qt)

    def vec(name: str, n: int, base: float, spread: float) -> None:
        w.add_tensor(name, (base + spread * rng.standard_normal(n)).astype(np.float32))

    norm = 0.1 if gemma else 0.0          # Gemma's norms are stored as 1 + w: give w a spread
    q, kv = s.heads * head_dim, s.kv_heads * head_dim
    mat("token_embd.weight", s.vocab, s.hidden)
    for i in range(s.layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", s.hidden, 1.0, norm)
        if s.arch == "phi3":
            mat(p + "attn_qkv.weight", q + 2 * kv, s.hidden)
        else:
            mat(p + "attn_q.weight", q, s.hidden)
            mat(p + "attn_k.weight", kv, s.hidden)
            mat(p + "attn_v.weight", kv, s.hidden)
        if s.bias:
            vec(p + "attn_q.bias", q, 0.0, 0.1)
            vec(p + "attn_k.bias", kv, 0.0, 0.1)
            vec(p + "attn_v.bias", kv, 0.0, 0.1)
        if s.arch == "gemma3":
            vec(p + "attn_q_norm.weight", head_dim, 1.0, norm)
            vec(p + "attn_k_norm.weight", head_dim, 1.0, norm)
        mat(p + "attn_output.weight", s.hidden, q)
        if gemma:
            vec(p + "post_attention_norm.weight", s.hidden, 1.0, norm)
        vec(p + "ffn_norm.weight", s.hidden, 1.0, norm)
        if s.arch == "phi3":
            mat(p + "ffn_up.weight", 2 * s.inter, s.hidden)
        else:
            mat(p + "ffn_gate.weight", s.inter, s.hidden)
            mat(p + "ffn_up.weight", s.inter, s.hidden)
        mat(p + "ffn_down.weight", s.hidden, s.inter)
        if gemma:
            vec(p + "post_ffw_norm.weight", s.hidden, 1.0, norm)
    vec("output_norm.weight", s.hidden, 1.0, norm)
    if not gemma:                          # Gemma's head is the embedding
        mat("output.weight", s.vocab, s.hidden)
    finish(w)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--type", choices=TYPES, default="Q4_1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spm-model", help="a SentencePiece .model whose vocabulary the file carries")
    a = ap.parse_args(argv)
    print(write(a.out, a.shape, a.type, a.seed, a.spm_model))


if __name__ == "__main__":
    main()
