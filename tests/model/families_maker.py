"""Tiny random checkpoints of each model family, built with transformers from small configs that
keep the family's real feature flags, saved as safetensors (and written as GGUF by ggufwriter)."""

from __future__ import annotations

import torch

COMMON = {"vocab_size": 262,   # = len(ggufmaker.byte_vocab()): the GGUF carries that tokenizer
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "initializer_range": 0.1,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}      # ggufmaker's specials
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}

# family -> (transformers config class, model class, config overrides)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None}),
    "phi3_swa": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 24}),     # Phi-3-mini-4k's window
    "mistral_swa": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24, "head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 24, "num_hidden_layers": 4,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "tie_word_embeddings": True}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 24, "num_hidden_layers": 6,
        "hidden_size": 48, "intermediate_size": 64,    # six layers: five local, one global (Gemma 3's pattern)
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            # the 4B+ models' linear scaling, on the global layers only
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
        "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2,
                                                        "intermediate_size": 32, "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**MOE, "num_experts": 8,
                                                             "shared_expert_intermediate_size": 64}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**MOE, "num_experts": 8, "norm_topk_prob": True,
                                                             "head_dim": 16}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {**MOE, "num_experts": 8}),
}


def make_hf_model(family: str, seed: int = 0):
    """A tiny random transformers model of `family` in fp32, eval mode; norms and biases perturbed
    (default init leaves them at one/zero, which would hide a wrong offset or a missing bias)."""
    import transformers

    cfg_cls, model_cls, over = FAMILIES[family]
    kw = {**COMMON, **over}
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("gate.weight"):      # routers: spread the expert choice
                p.normal_(0, 0.5)
    return model.float().eval()
