"""The families' GGUF conventions, as llama.cpp's convert_hf_to_gguf writes them: architecture
names, metadata keys and tensor names beyond the Llama ones, translated to ModelConfig fields and
Hugging Face names (families.py's naming) for gguf_loader.py.

Conventions worth knowing:
* Gemma 2/3 norms are stored as (1 + w): the 1 is taken off again here, to HF's w.
* Gemma's local/global layout is not in the file unless `{arch}.attention.sliding_window_pattern`
  is: llama.cpp's defaults are every other layer local for Gemma 2 (layer 0 local) and five local
  layers in six for Gemma 3; the local RoPE base of Gemma 3 is 10000, the scale head_dim ** -0.5
  except on the 27B models (46 / 62 layers), whose query_pre_attn_scalar is hidden / heads (llama.cpp's
  LLM_TYPE_27B rule: the file does not record it).
* Mixtral is written as architecture `llama` with `llama.expert_count`; experts come as one 3-D
  tensor per projection (`ffn_gate_exps` [experts, ff, hidden]), split here into per-expert weights.
* Phi-3's `attn_qkv` and `ffn_up` hold the fused q/k/v and gate/up projections.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvserve.errors import ModelLoadError
from kvserve.model.linear import WeightSource

# GGUF general.architecture -> our family (Mixtral arrives as "llama" with experts).
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                 "gemma2": "gemma2", "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                 "olmoe": "olmoe"}
MOE_NORM_DEFAULT = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}

LAYER_NAMES = {
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight", "attn_qkv.bias": "self_attn.qkv_proj.bias",
    "post_attention_norm.weight": "post_attention_norm.weight",   # Gemma; renamed in fix_weights
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj", "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}


def gguf_family_fields(arch: str, field: Callable[[str, Any], Any], names: set[str],
                       n_layers: int) -> dict[str, Any]:
    """ModelConfig fields beyond the Llama ones. field(key, default) reads `{arch}.key`."""
    kw: dict[str, Any] = {"architecture": ARCHITECTURES[arch]}
    if "rope_factors_long.weight" in names:
        raise ModelLoadError(f"unsupported {arch} GGUF: LongRoPE (rope_factors_long/short, the 128k Phi-3 "
                             "models) is not supported yet")
    window = field("attention.sliding_window", None)
    pattern = field("attention.sliding_window_pattern", None)
    if arch == "qwen3":
        kw["qk_norm"] = "head"
    elif arch in ("gemma2", "gemma3"):
        head_dim = field("attention.key_length", None)
        if n_layers == {"gemma2": 46, "gemma3": 62}[arch]:   # the 27B models: llama.cpp's scale, hidden / heads
            head_dim = int(field("embedding_length", 0)) // int(field("attention.head_count", 1))
        kw.update(gemma_norms=True, hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim and float(head_dim),
                  attn_logit_softcapping=field("attn_logit_softcapping", None),
                  final_logit_softcapping=field("final_logit_softcapping", None))
        if pattern is None:
            pattern = 2 if arch == "gemma2" else 6
        if arch == "gemma3":
            kw.update(qk_norm="head", rope_local_theta=10000.0)
    if window and window >= int(field("context_length", 0) or 0) and pattern is None:
        window = None                                   # a window as long as the context is no window
    if window:
        if isinstance(pattern, int) and pattern > 0:   # n: layers n-1, 2n-1, ... are global
            local = [(i + 1) % pattern != 0 for i in range(n_layers)]
        elif isinstance(pattern, list) and len(pattern) == n_layers:
            local = [bool(x) for x in pattern]
        else:
            local = [True] * n_layers
        kw.update(sliding_window=int(window),
                  layer_types=["sliding_attention" if x else "full_attention" for x in local])
    n_exp = int(field("expert_count", 0) or 0)
    if n_exp:
        if arch not in MOE_NORM_DEFAULT:
            raise ModelLoadError(f"unsupported architecture {arch!r} with experts in GGUF file")
        kw.update(num_experts=n_exp, num_experts_per_tok=int(field("expert_used_count", 0)),
                  norm_topk_prob=bool(field("expert_weights_norm", MOE_NORM_DEFAULT[arch])))
        if arch == "llama":
            kw["architecture"] = "mixtral"
        if arch == "olmoe":
            kw["qk_norm"] = "full"
        if arch == "qwen3moe":
            kw["qk_norm"] = "head"
        if "blk.0.ffn_gate_shexp.weight" in names:
            kw["shared_expert_intermediate_size"] = int(field("expert_shared_feed_forward_length", 0))
    return kw


def expert_weights(name: str, shape: tuple[int, ...], data, qtype) -> dict[str, Any]:
    """Split a stacked expert tensor `model.layers.{i}.mlp.experts.{proj}` of shape (E, rows, cols)
    into per-expert WeightSources (block quants stay packed, one expert's rows each)."""
    prefix, proj = name.rsplit(".", 1)
    rows_cols = (shape[1], shape[2])
    out = {}
    for e in range(shape[0]):
        part = np.asarray(data[e])
        if qtype.name in ("F32", "F16"):
            src = WeightSource(rows_cols, tensor=torch.from_numpy(part.reshape(rows_cols).copy()))
        else:
            src = WeightSource(rows_cols, raw=np.ascontiguousarray(part.reshape(shape[1], -1)), qtype=qtype)
        out[f"{prefix}.{e}.{proj}.weight"] = src
    return out


def fix_weights(cfg, out: dict) -> None:
    """Bring family-specific tensors to HF's values and shapes, in place."""
    if cfg.gemma_norms:   # ffn_norm is Gemma's pre-feedforward norm, post_attention_norm its post-attention one
        for k in [k for k in out if k.endswith("post_attention_layernorm.weight")]:
            out[k.replace("post_attention_layernorm", "pre_feedforward_layernorm")] = out.pop(k)
        for k in [k for k in out if k.endswith("post_attention_norm.weight")]:
            out[k.replace("post_attention_norm", "post_attention_layernorm")] = out.pop(k)
        for k, v in out.items():
            if isinstance(v, torch.Tensor) and k.endswith("norm.weight"):
                out[k] = v - 1.0
    for k, v in list(out.items()):
        if cfg.architecture == "phi3" and k.endswith("mlp.up_proj.weight"):   # ffn_up holds gate and up
            out[k.replace("up_proj", "gate_up_proj")] = out.pop(k)
        if k.endswith("shared_expert_gate.weight") and isinstance(v, torch.Tensor):   # [H] -> [1, H]
            out[k] = WeightSource((1, v.numel()), tensor=v.reshape(1, -1))
