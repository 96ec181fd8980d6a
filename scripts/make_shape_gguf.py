"""Write a random-weight Q4 GGUF of a real model shape, for speed measurements (issue 52).

    python scripts/make_shape_gguf.py 1b /tmp/shape-1b.gguf          # TinyLlama's body, 128k vocab
    python scripts/make_shape_gguf.py 3b /tmp/shape-3b.gguf          # Qwen2.5-3B's body (q/k/v bias)

Every matrix is Q4_1 (or --qtype Q4_0) with random nibbles and small fixed block scales (no
quantization pass: a 3B file is written in seconds); the output head is untied and the vocabulary
is 128,256 tokens (Llama 3's size), a byte-level BPE alphabet padded with filler tokens so that
prompts tokenize. The numbers a model of random weights says are meaningless; its speed is not.
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np

SHAPES = {   # arch, hidden, intermediate, layers, heads, kv heads, q/k/v bias
    "1b": ("llama", 2048, 5632, 22, 32, 4, False),
    "3b": ("qwen2", 2048, 11008, 36, 16, 2, True),
}
VOCAB = 128256


def vocab(n: int) -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(ByteLevel.alphabet())
    tokens = specials + alphabet + ["Ġt", "he"]
    return tokens + [f"x{i}" for i in range(n - len(tokens))]


def write(path: str, shape: str, qtype: str = "Q4_1", n_vocab: int = VOCAB, seed: int = 0) -> None:
    arch, hidden, inter, layers, heads, kv_heads, bias = SHAPES[shape]
    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    head_dim = hidden // heads
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"random-{shape}")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    toks = vocab(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(toks)
    w.add_token_types([3] * 3 + [1] * (n_vocab - 3))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    scale = np.array([0.002], dtype=np.float16).view(np.uint8)
    low = np.array([-0.015], dtype=np.float16).view(np.uint8)

    def mat(name: str, rows: int, cols: int) -> None:
        raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        raw[:, :, 0:2] = scale
        if qtype == "Q4_1":
            raw[:, :, 2:4] = low
        w.add_tensor(name, raw.reshape(rows, -1), raw_dtype=t)

    def vec(name: str, n: int, base: float) -> None:
        w.add_tensor(name, (base + 0.01 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", n_vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", hidden, 1.0)
        vec(p + "ffn_norm.weight", hidden, 1.0)
        mat(p + "attn_q.weight", heads * head_dim, hidden)
        mat(p + "attn_k.weight", kv_heads * head_dim, hidden)
        mat(p + "attn_v.weight", kv_heads * head_dim, hidden)
        mat(p + "attn_output.weight", hidden, heads * head_dim)
        mat(p + "ffn_gate.weight", inter, hidden)
        mat(p + "ffn_up.weight", inter, hidden)
        mat(p + "ffn_down.weight", hidden, inter)
        if bias:
            for n, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
                vec(p + f"attn_{n}.bias", rows, 0.0)
    vec("output_norm.weight", hidden, 1.0)
    mat("output.weight", n_vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("path")
    ap.add_argument("--qtype", default="Q4_1", choices=["Q4_0", "Q4_1"])
    a = ap.parse_args()
    write(a.path, a.shape, a.qtype)


if __name__ == "__main__":
    main()
