"""Write a Llama-family model as a GGUF file the way llama.cpp's converter does.

Metadata under `llama.*` (block count, widths, heads, RoPE base, norm epsilon), the tokenizer as
`tokenizer.ggml.*` (byte-level BPE "gpt2": tokens, token types, merges, the pre-tokenizer name,
special ids, chat template; copied field by field when the source was itself a GGUF), tensors
under llama.cpp's names with the rows of Q and K permuted for its RoPE on adjacent pairs (the
inverse of gguf_loader's unpermute). Norms stay F32; projections take the requested type; the
embedding table (also the output head when tied) is Q8_0, as llama.cpp's own quantizer does for
small models, unless F32/F16 is asked for.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvserve.errors import InvalidRequest
from kvserve.model.config import ModelConfig
from kvserve.model.gguf_write import add_llama_shape, finish
from kvserve.tokenizer import Tokenizer
from kvserve.train.quant_formats import ggml_type, quantize_rows

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
# general.file_type (llama_ftype) of each output type
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K": 15, "Q6_K": 18}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, i, rest = hf.split(".", 3)
    base, suffix = rest.rsplit(".", 1)
    return f"blk.{i}.{_LAYER[base]}.{suffix}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute of Q/K rows (rotate-half -> adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_supported(cfg: ModelConfig) -> None:
    if cfg.architecture != "llama" or cfg.num_experts or cfg.qk_norm or cfg.sliding_window:
        raise InvalidRequest(f"kvserve quantize writes Llama-architecture models; this one is "
                             f"{cfg.architecture!r}", param="model")


def write_gguf(path: str | Path, cfg: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer,
               qtype: str, source_reader=None, on_tensor: Callable[[str, str], None] | None = None) -> dict[str, int]:
    """Quantize `weights` (fp32, Hugging Face names) to `qtype` and write the GGUF file.
    Returns {GGUF type name: tensor count}. on_tensor(name, type) is called after each tensor."""
    import gguf

    check_supported(cfg)
    qtype = qtype.upper()
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_shape(w, name=cfg.name or "model", layers=cfg.num_hidden_layers, ctx=cfg.max_position_embeddings,
                    hidden=cfg.hidden_size, inter=cfg.intermediate_size, heads=cfg.num_attention_heads,
                    kv_heads=cfg.num_key_value_heads)
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    elif scaling:
        raise InvalidRequest(f"kvserve quantize cannot write RoPE scaling {scaling.get('rope_type')!r} yet",
                             param="model")
    w.add_file_type(FILE_TYPES.get(qtype, 7))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if source_reader is not None:
        _copy_tokenizer_fields(w, source_reader)
    else:
        _tokenizer_fields(w, tokenizer, cfg)
    counts: dict[str, int] = {}
    for name, t in weights.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().contiguous().numpy()
        if ".self_attn.q_proj." in name:
            a = permute(a, cfg.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            a = permute(a, cfg.num_key_value_heads)
        out_name = gguf_name(name)
        if a.ndim == 1:
            w.add_tensor(out_name, a.astype(np.float32))
            used = "F32"
        elif qtype in ("F32", "F16"):
            w.add_tensor(out_name, a.astype(np.float32 if qtype == "F32" else np.float16))
            used = qtype
        else:
            want = "Q8_0" if name in ("model.embed_tokens.weight", "lm_head.weight") else qtype
            raw, used = quantize_rows(a, want)
            w.add_tensor(out_name, raw, raw_dtype=ggml_type(used))
        counts[used] = counts.get(used, 0) + 1
        if on_tensor is not None:
            on_tensor(out_name, used)
    finish(w)
    return counts


def _copy_tokenizer_fields(w, reader) -> None:
    import gguf

    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), vtype)


def _tokenizer_fields(w, tok: Tokenizer, cfg: ModelConfig) -> None:
    """tokenizer.ggml.* from a Hugging Face tokenizer.json (byte-level BPE)."""
    j = json.loads(tok.hf.to_str())
    model = j.get("model", {})
    if model.get("type") != "BPE":
        raise InvalidRequest("kvserve quantize writes byte-level BPE tokenizers only", param="model")
    vocab = {t: i for t, i in model["vocab"].items()}
    specials = {a["id"]: a for a in j.get("added_tokens", [])}
    for i, a in specials.items():
        vocab.setdefault(a["content"], i)
    n = max(cfg.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf_token_type("unused")] * n
    for t, i in vocab.items():
        tokens[i] = t
        a = specials.get(i)
        types[i] = gguf_token_type("control" if a and a.get("special") else "user" if a else "normal")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre = json.dumps(j.get("pre_tokenizer"))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm" if '"individual_digits": true' in pre else "gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if tok.bos_token_id is not None:
        w.add_bos_token_id(tok.bos_token_id)
    if tok.eos_token_ids:
        w.add_eos_token_id(tok.eos_token_ids[0])
    w.add_add_bos_token(bool(tok.add_bos))
    if tok.has_chat_template:
        w.add_chat_template(tok.chat_template)


def gguf_token_type(kind: str) -> int:
    import gguf

    return {"normal": gguf.TokenType.NORMAL, "control": gguf.TokenType.CONTROL,
            "user": gguf.TokenType.USER_DEFINED, "unused": gguf.TokenType.UNUSED}[kind]
