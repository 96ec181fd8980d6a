"""Random-weight GGUF files of real model shapes, for start-up, memory and speed measurements.

`python -m kvserve.bench.gguf_random OUT.gguf --shape llama-1b --type Q4_1` writes a Llama-family
file the way llama.cpp's converter lays one out (architecture "llama", byte-level BPE tokenizer
metadata, untied output head, norms in F32), with block-quantized tensors whose payload bytes are
random and whose block scales are small finite float16s, so every kernel runs on it and the
numbers are those of a real file of that shape. The tokenizer is synthetic but of the real size
(its tokens are byte pairs grown by merges up to the vocabulary), so building it costs what a
real one costs. The outputs are meaningless: use it for speed and memory, never for quality.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

# name -> hidden, intermediate, layers, heads, kv heads, vocab (all untied, head_dim = hidden / heads)
SHAPES = {
    "tiny": (256, 512, 2, 4, 2, 4096),
    "llama-1b": (2048, 5632, 22, 32, 4, 128256),       # TinyLlama-1.1B's body, Llama 3's vocabulary
    "llama-3b": (3072, 8192, 28, 24, 8, 128256),       # Llama-3.2-3B
}
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")


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


def random_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes_per_row]: random quants, float16 scales of about 1/sqrt(cols)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = np.float16(1.0 / np.sqrt(cols) / 4).reshape(1).view(np.uint8)
    name = qtype.name
    if name == "Q4_K":
        raw[:, :, 0:2] = d
        raw[:, :, 2:4] = np.float16(0.0).reshape(1).view(np.uint8)
    else:
        raw[:, :, 0:2] = d
        if name == "Q4_1":      # minimum -8 d: values centred on zero
            raw[:, :, 2:4] = np.float16(-8 / np.sqrt(cols) / 4).reshape(1).view(np.uint8)
    return raw.reshape(rows, -1)


def write(path: str | Path, shape: str = "llama-1b", qtype: str = "Q4_1", seed: int = 0) -> Path:
    """Write the random-weight file; returns its path."""
    import gguf

    hidden, inter, layers, heads, kv_heads, vocab = SHAPES[shape]
    qt = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random-{shape}-{qtype}")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(vocab)
    tokens, merges = synthetic_vocab(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 3) + [3, 3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)

    def mat(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, random_blocks(rows, cols, qt, rng), raw_dtype=qt)

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    head_dim = hidden // heads
    mat("token_embd.weight", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        ones(p + "attn_norm.weight", hidden)
        mat(p + "attn_q.weight", heads * head_dim, hidden)
        mat(p + "attn_k.weight", kv_heads * head_dim, hidden)
        mat(p + "attn_v.weight", kv_heads * head_dim, hidden)
        mat(p + "attn_output.weight", hidden, heads * head_dim)
        ones(p + "ffn_norm.weight", hidden)
        mat(p + "ffn_gate.weight", inter, hidden)
        mat(p + "ffn_up.weight", inter, hidden)
        mat(p + "ffn_down.weight", hidden, inter)
    ones("output_norm.weight", hidden)
    mat("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--type", choices=TYPES, default="Q4_1")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(write(a.out, a.shape, a.type, a.seed))


if __name__ == "__main__":
    main()
