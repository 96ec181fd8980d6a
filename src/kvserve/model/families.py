"""Model families: how each architecture's Hugging Face config and weight names map onto the one
ModelConfig and the one set of HF-style weight names the model is built from.

| family       | what differs from Llama                                                        |
|--------------|--------------------------------------------------------------------------------|
| qwen3        | RMSNorm on each head of q and k before RoPE, no q/k/v bias                     |
| phi3         | fused `qkv_proj` and `gate_up_proj` weights; an optional sliding window        |
| mistral      | a sliding window on every layer                                                |
| gemma2       | (1 + w) norms, post-attention and post-feedforward norms, GeGLU, sqrt(H)-scaled |
|              | embeddings, attention and final logit soft-capping, local/global layers        |
| gemma3_text  | gemma2 without soft-capping, plus q/k-norm and its own RoPE base on local layers |
| mixtral      | 8 experts, softmax -> top-2 -> renormalise                                     |
| qwen2_moe    | experts + a shared expert behind a sigmoid gate; q/k/v bias                    |
| qwen3_moe    | experts (norm_topk_prob) + q/k-norm                                            |
| olmoe        | experts + RMSNorm over the whole q and k projections                           |

Weights are normalised here to one naming (`mlp.experts.{e}.gate_proj.weight`, `mlp.gate.weight`
for the router, Gemma norms with the 1 folded in) so the model builder has one path per feature.
"""

from __future__ import annotations

import re
from typing import Any

from kvserve.errors import ModelLoadError


def hf_family_fields(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields for `arch` from a Hugging Face config.json dict."""
    kw: dict[str, Any] = {}
    window = d.get("sliding_window") or None
    if d.get("use_sliding_window") is False:          # Qwen families write a window they do not use
        window = None
    layer_types = d.get("layer_types") if window else None
    if window and window >= int(d.get("max_position_embeddings") or 0) and layer_types is None:
        window = None                                   # a window as long as the context is no window
    kw["sliding_window"] = window
    kw["layer_types"] = layer_types
    rp = d.get("rope_parameters") or {}
    if float(rp.get("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0) != 1.0:
        raise ModelLoadError(f"unsupported {arch} config: partial rotary embeddings (partial_rotary_factor) "
                             "are not supported yet")
    if arch == "qwen2":
        kw["attention_bias"] = True
    elif arch == "qwen3":
        kw["qk_norm"] = "head"
    elif arch in ("gemma2", "gemma3_text"):
        kw.update(gemma_norms=True, hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
                  query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or d.get("head_dim") or 256),
                  attn_logit_softcapping=d.get("attn_logit_softcapping"),
                  final_logit_softcapping=d.get("final_logit_softcapping"))
        if arch == "gemma3_text":
            kw["qk_norm"] = "head"
            full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
            kw["rope_theta"] = float(full.get("rope_theta") or d.get("rope_theta") or 1e6)
            kw["rope_local_theta"] = float(local.get("rope_theta") or d.get("rope_local_base_freq") or 1e4)
            kw["rope_scaling"] = full if full.get("rope_type", "default") != "default" else d.get("rope_scaling")
    elif arch in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        if d.get("mlp_only_layers") or int(d.get("decoder_sparse_step") or 1) != 1:
            raise ModelLoadError(f"unsupported {arch} config: dense layers between MoE layers "
                                 "(mlp_only_layers / decoder_sparse_step) are not supported yet")
        if d.get("clip_qkv") is not None:
            raise ModelLoadError(f"unsupported {arch} config: clip_qkv is not supported yet")
        kw["num_experts"] = int(d.get("num_experts") or d.get("num_local_experts") or 0)
        kw["num_experts_per_tok"] = int(d["num_experts_per_tok"])
        kw["moe_intermediate_size"] = int(d.get("moe_intermediate_size") or d["intermediate_size"])
        kw["norm_topk_prob"] = True if arch == "mixtral" else bool(d.get("norm_topk_prob", False))
        if arch == "qwen2_moe":
            kw["attention_bias"] = bool(d.get("qkv_bias", True))
            kw["shared_expert_intermediate_size"] = int(d.get("shared_expert_intermediate_size") or 0)
        if arch == "qwen3_moe":
            kw["qk_norm"] = "head"
        if arch == "olmoe":
            kw["qk_norm"] = "full"
    return kw


_MIXTRAL_EXPERT = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(experts\.\d+\.)w([123])\.weight")
_MIXTRAL_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def normalise_hf_names(name: str) -> str:
    """One naming for every family's checkpoint tensors (Mixtral's w1/w2/w3 -> gate/down/up)."""
    m = _MIXTRAL_EXPERT.fullmatch(name)
    if m:
        return f"{m[1]}mlp.{m[2]}{_MIXTRAL_NAMES[m[3]]}.weight"
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


def gemma_norm_names(name: str) -> bool:
    """The Gemma norms whose HF weight is w in x * (1 + w)."""
    return name.endswith("norm.weight")
