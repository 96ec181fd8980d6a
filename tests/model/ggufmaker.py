"""Build tiny GGUF files for tests: a small Llama with a byte-level BPE tokenizer, weights in
any tensor type, written the way llama.cpp's converter writes them (Q/K rows permuted)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from kvserve.model.gguf_write import add_llama_shape, finish

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def byte_vocab() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    return SPECIALS + alphabet + ["Ġt", "he", "Ġthe"]


def add_byte_tokenizer(w: gguf.GGUFWriter, vocab: list[str], n_specials: int = len(SPECIALS)) -> None:
    """`byte_vocab()` (its first `n_specials` tokens control tokens) as the gpt2 BPE tokenizer of a
    GGUF: the merges of its three joined tokens, bos 1, eos 2 and the ChatML template."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([3] * n_specials + [1] * (len(vocab) - n_specials))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute for Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def k_quant_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random but well-formed K-quant rows (gguf-py cannot quantize K types): random payload
    bytes with small, finite f16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nb = cols // block
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    d = np.array([0.0002], dtype=np.float16).view(np.uint8)
    dmin = np.array([0.0001], dtype=np.float16).view(np.uint8)
    name = qtype.name
    if name in ("Q4_K", "Q5_K"):
        raw[:, :, 0:2] = d
        raw[:, :, 2:4] = dmin
    elif name == "Q6_K":
        raw[:, :, size - 2:size] = d
    return raw.reshape(rows, nb * size)


def make_tiny_llama_gguf(path: Path, *, qtype: str = "F32", arch: str = "llama", seed: int = 0,
                         hidden: int = 256, inter: int = 512, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                         ctx: int = 128, tied: bool = False, tensor_type_override: dict | None = None,
                         extra_specials: tuple[str, ...] = ()) -> Path:
    """`extra_specials`: more control tokens (after SPECIALS, so the bos/eos ids stay 1 and 2)."""
    rng = np.random.default_rng(seed)
    vocab = byte_vocab()
    vocab[len(SPECIALS):len(SPECIALS)] = list(extra_specials)
    n_specials = len(SPECIALS) + len(extra_specials)
    n_vocab = len(vocab)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    add_llama_shape(w, name="tiny-test", layers=layers, ctx=ctx, hidden=hidden, inter=inter, heads=heads,
                    kv_heads=kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    add_byte_tokenizer(w, vocab, n_specials)

    override = tensor_type_override or {}

    def mat(name: str, rows: int, cols: int, scale: float = 0.05, permute_heads: int | None = None):
        x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if permute_heads:
            x = permute(x, permute_heads)
        t = gguf.GGMLQuantizationType[override.get(name, qtype)]
        if t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        elif t == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif t.name in ("Q4_K", "Q5_K", "Q6_K", "Q2_K"):
            w.add_tensor(name, k_quant_blocks(rows, cols, t, rng), raw_dtype=t)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, t), raw_dtype=t)

    def vec(name: str, n: int, base: float = 1.0):
        w.add_tensor(name, (base + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", n_vocab, hidden, 0.5)
    for i in range(layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", hidden)
        vec(p + "ffn_norm.weight", hidden)
        perm = arch == "llama"
        mat(p + "attn_q.weight", heads * head_dim, hidden, permute_heads=heads if perm else None)
        mat(p + "attn_k.weight", kv_heads * head_dim, hidden, permute_heads=kv_heads if perm else None)
        mat(p + "attn_v.weight", kv_heads * head_dim, hidden)
        mat(p + "attn_output.weight", hidden, heads * head_dim)
        mat(p + "ffn_gate.weight", inter, hidden)
        mat(p + "ffn_up.weight", inter, hidden)
        mat(p + "ffn_down.weight", hidden, inter)
        if arch == "qwen2":
            vec(p + "attn_q.bias", heads * head_dim, 0.0)
            vec(p + "attn_k.bias", kv_heads * head_dim, 0.0)
            vec(p + "attn_v.bias", kv_heads * head_dim, 0.0)
    vec("output_norm.weight", hidden)
    if not tied:
        mat("output.weight", n_vocab, hidden, 0.5)
    finish(w)
    return path


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """Reference: transformers loading the same GGUF file (dequantized to fp32)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0]
