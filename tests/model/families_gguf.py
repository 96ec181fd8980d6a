"""Write a tiny transformers checkpoint as GGUF the way llama.cpp's convert_hf_to_gguf does for its
architecture: tensor names from gguf-py's own HF -> GGUF name map, the family's metadata keys,
Q/K rows permuted for `llama`, Gemma norms stored as 1 + w, experts stacked into 3-D tensors."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch
from ggufmaker import add_byte_tokenizer, byte_vocab, permute

from kvserve.model.gguf_write import add_llama_shape, finish

# our family -> (GGUF architecture, gguf-py MODEL_ARCH)
GGUF_ARCH = {"qwen3": "qwen3", "phi3": "phi3", "phi3_swa": "phi3", "mistral_swa": "llama", "gemma2": "gemma2", "gemma3": "gemma3",
             "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_MIXTRAL = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def write_gguf(checkpoint: Path, family: str, path: Path, qtype: str = "F32") -> Path:
    """checkpoint: the directory save_pretrained wrote (read as the converter reads it)."""
    import transformers
    from safetensors.torch import load_file

    c = transformers.AutoConfig.from_pretrained(checkpoint)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    arch = GGUF_ARCH[family]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    n_layers = c.num_hidden_layers
    tmap = gguf.get_tensor_name_map(model_arch, n_layers)
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    add_llama_shape(w, name=f"tiny-{family}", layers=n_layers, ctx=c.max_position_embeddings, hidden=c.hidden_size,
                    inter=c.intermediate_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rp = c.rope_parameters
    theta = rp.get("full_attention", rp)["rope_theta"]
    w.add_rope_freq_base(theta)
    scaling = rp.get("full_attention", rp)
    if scaling.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if getattr(c, "sliding_window", None) and family in ("mistral_swa", "gemma2", "gemma3", "phi3_swa"):
        w.add_sliding_window(c.sliding_window)
    if family == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    n_exp = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if n_exp:
        w.add_expert_count(n_exp)
        w.add_expert_used_count(c.num_experts_per_tok)
        if family != "mixtral":
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        if family == "qwen3_moe":
            w.add_expert_weights_norm(bool(c.norm_topk_prob))
    add_byte_tokenizer(w, byte_vocab())

    def add(name: str, t: torch.Tensor) -> None:
        x = t.detach().float().numpy()
        if x.ndim >= 2 and qtype != "F32" and name != "token_embd.weight" and x.shape[-1] % 32 == 0:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(x, q), raw_dtype=q)
        else:
            w.add_tensor(name, np.ascontiguousarray(x))

    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for hf_name, t in sorted(tensors.items()):
        m = _EXPERT.fullmatch(hf_name)
        if m:
            experts.setdefault((int(m[1]), _MIXTRAL.get(m[3], m[3])), {})[int(m[2])] = t
            continue
        if hf_name == "lm_head.weight" and getattr(c, "tie_word_embeddings", False):
            continue
        name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if arch == "llama" and re.search(r"self_attn\.[qk]_proj", hf_name):
            heads = c.num_attention_heads if ".q_proj" in hf_name else c.num_key_value_heads
            t = torch.from_numpy(permute(t.float().numpy(), heads))
        if family in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            t = t + 1.0
        add(name, t)
    for (layer, proj), per_expert in sorted(experts.items()):
        stacked = torch.stack([per_expert[e] for e in range(len(per_expert))])
        add(f"blk.{layer}.ffn_{proj.split('_')[0]}_exps.weight", stacked)
    finish(w)
    return path
