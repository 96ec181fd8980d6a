"""ModelConfig: the one description of a transformer that every loader produces.

It follows Hugging Face's `config.json` names, so a model directory's config maps onto it
directly and GGUF metadata (`llama.block_count`, ...) is translated once, in the GGUF loader.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from kvserve.errors import ModelLoadError
from kvserve.model.families import hf_family_fields

# Architectures the one model file runs. The Llama shapes (llama, mistral, qwen2) differ only in
# config values (q/k/v bias, rope scaling, tied embeddings, GQA ratio); the other families switch
# on the feature fields below (q/k-norm, sliding windows, soft-capping, Gemma norms, experts).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
LLAMA_SHAPED = ("llama", "mistral", "qwen2", "phi3")   # phi3: fused weights, the Llama math


@dataclass
class ModelConfig:
    architecture: str = "llama"            # a value of SUPPORTED_ARCHITECTURES
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False           # Qwen2: bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # ---- family features (defaults: the Llama shape) ----
    hidden_act: str = "silu"               # "silu" (SwiGLU) | "gelu_pytorch_tanh" (GeGLU, Gemma)
    qk_norm: str | None = None             # RMSNorm on q and k: "head" (Qwen3, Gemma 3), "full" (OLMoE)
    sliding_window: int | None = None      # keys a query sees on "sliding_attention" layers (itself included)
    layer_types: list[str] | None = None   # per layer: "full_attention" | "sliding_attention"
    rope_local_theta: float | None = None  # RoPE base of sliding layers when it differs (Gemma 3)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None   # attention scale = this ** -0.5 (Gemma; default head_dim)
    gemma_norms: bool = False              # norms scale by (1 + w); post-attention/feedforward norms; sqrt(H) embed
    num_experts: int = 0                   # MoE: routed experts per layer (0: dense MLP)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0     # Qwen2-MoE: one always-on expert behind a sigmoid gate
    norm_topk_prob: bool = False           # renormalise the top-k router probabilities to sum to 1
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_values()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}); the model config is inconsistent")

        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {
                "full_attention", "sliding_attention"}:
            raise ModelLoadError(f"layer_types {self.layer_types!r} does not give full_attention or "
                                 f"sliding_attention for each of the {self.num_hidden_layers} layers")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ModelLoadError("the config has sliding_attention layers but no sliding_window")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                                 f"num_experts ({self.num_experts}); the model config is inconsistent")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be a positive number of tokens, got {self.sliding_window}")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"unsupported hidden_act {self.hidden_act!r}: kvserve runs silu and gelu_pytorch_tanh")

    _LIMITS: ClassVar[dict[str, int]] = {
        "vocab_size": 1 << 24, "hidden_size": 1 << 20, "intermediate_size": 1 << 22, "num_hidden_layers": 4096,
        "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 1 << 16,
        "max_position_embeddings": 1 << 24}

    def _check_values(self) -> None:
        """Sizes are integers in a sane range and the float settings positive numbers: a corrupt
        config fails here, by name, not later as a division by zero or a huge allocation."""
        for name, hi in self._LIMITS.items():
            v = getattr(self, name)
            if v is None and name in ("num_key_value_heads", "head_dim"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
                raise ModelLoadError(f"model config {name} is {v!r}: expected an integer in [1, {hi}]")
        for name, hi in (("rms_norm_eps", 1.0), ("rope_theta", 1e15)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= hi:
                raise ModelLoadError(f"model config {name} is {v!r}: expected a positive number")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ModelLoadError(f"model config rope_scaling is {self.rope_scaling!r}: expected an object")

    @property
    def max_model_len(self) -> int:
        return self.max_position_embeddings

    @property
    def llama_attention(self) -> bool:
        """Llama's attention, norms and RoPE (the MLP may be experts): the C layer ops apply."""
        return (self.architecture in LLAMA_SHAPED + ("mixtral",) and not self.qk_norm and not self.gemma_norms
                and self.attn_logit_softcapping is None and self.final_logit_softcapping is None
                and self.query_pre_attn_scalar is None and "sliding_attention" not in self.layer_types)

    @property
    def c_layer_ops(self) -> bool:
        """The C layer ops and whole-stack forward (kernels/cpu_ops.py) implement this model's attention
        and norms: Llama's, and the Gemma 2/3 features through the layer descriptors (per-head q/k norm,
        Gemma's sandwich norms, sliding windows with their own RoPE base, soft-capping,
        query_pre_attn_scalar, GeGLU)."""
        return self.architecture in LLAMA_SHAPED + ("mixtral", "gemma2", "gemma3_text") and self.qk_norm in (None, "head")

    @property
    def llama_shaped(self) -> bool:
        """No family feature: the C whole-stack forward and C layer ops apply."""
        return self.llama_attention and self.hidden_act == "silu" and not self.num_experts

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def kv_window(self) -> int | None:
        """The window when every layer is a sliding one: KV blocks wholly before it can be freed."""
        return self.sliding_window if set(self.layer_types) == {"sliding_attention"} else None

    @property
    def local_window(self) -> int | None:
        """The window when sliding layers sit beside full ones (Gemma): those layers get their own
        KV pool and block tables (engine/kv_hybrid.py), so what they hold is bounded by it."""
        return self.sliding_window if set(self.layer_types) == {"sliding_attention", "full_attention"} else None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        if not isinstance(archs, list):
            archs = [archs]
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            mt = d.get("model_type")
            if mt in SUPPORTED_ARCHITECTURES.values():
                arch = mt
            else:
                raise ModelLoadError(
                    f"unsupported architecture {archs or mt!r}: kvserve runs "
                    f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rp = d.get("rope_parameters")  # transformers >= 5 nests rope settings here
        if isinstance(rp, dict):
            rope_theta = rope_theta if rope_theta is not None else rp.get("rope_theta")
            if rope_scaling is None and rp.get("rope_type", "default") != "default":
                rope_scaling = rp
        known = {f for f in cls.__dataclass_fields__}

        kw = {k: v for k, v in d.items() if k in known and k not in ("architecture", "extra")}
        kw["rope_scaling"] = rope_scaling
        rope_theta = 10000.0 if rope_theta is None else rope_theta
        if not isinstance(rope_theta, (int, float)) or isinstance(rope_theta, bool):
            raise ModelLoadError(f"model config rope_theta is {rope_theta!r}: expected a positive number")
        kw["rope_theta"] = float(rope_theta)
        kw.update(hf_family_fields(arch, d))
        kw.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
        return cls(architecture=arch, **kw)

    def to_hf_dict(self) -> dict[str, Any]:
        if not self.llama_shaped:
            raise ModelLoadError(f"exporting a {self.architecture} config is not supported (Llama shapes only)")
        d = asdict(self)
        for k in ("extra", "hidden_act", "qk_norm", "sliding_window", "layer_types", "rope_local_theta",
                  "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "gemma_norms",
                  "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob"):
            d.pop(k)
        d.pop("extra", None)
        d.pop("name")
        arch = d.pop("architecture")
        cls_name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[arch]
        d.update(architectures=[cls_name], model_type=arch, hidden_act="silu", torch_dtype="float32")
        if arch == "qwen2":
            d.pop("attention_bias")
        return d
