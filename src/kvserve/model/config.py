"""ModelConfig: the one description of a transformer that every loader produces.

It follows Hugging Face's `config.json` names, so a model directory's config maps onto it
directly and GGUF metadata (`llama.block_count`, ...) is translated once, in the GGUF loader.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from kvserve.errors import ModelLoadError

# Architectures the one model file runs: they differ only in config values (q/k/v bias,
# rope scaling, tied embeddings, GQA ratio), not in code paths.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelConfig:
    architecture: str = "llama"            # "llama" | "mistral" | "qwen2"
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
        if arch == "qwen2":
            kw["attention_bias"] = True
        kw.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
        return cls(architecture=arch, **kw)

    def to_hf_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d.pop("name")
        arch = d.pop("architecture")
        cls_name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[arch]
        d.update(architectures=[cls_name], model_type=arch, hidden_act="silu", torch_dtype="float32")
        if arch == "qwen2":
            d.pop("attention_bias")
        return d
