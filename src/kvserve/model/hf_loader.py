"""Read a Hugging Face model directory: config.json plus *.safetensors (sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvserve.errors import ModelLoadError
from kvserve.model.config import ModelConfig
from kvserve.model.families import normalise_hf_names
from kvserve.model.gguf_loader import _check_shapes  # the same shape rules as a GGUF's tensors
from kvserve.model.linear import WeightSource


def config_from_dir(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        d = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ModelLoadError(f"{cfg_file} must hold a JSON object, not {type(d).__name__}")
    cfg = ModelConfig.from_hf_dict(d)
    cfg.name = cfg.name or path.name
    return cfg


def weights_from_dir(path: Path, cfg: ModelConfig) -> dict[str, WeightSource | torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    out: dict[str, WeightSource | torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f} is truncated or corrupt ({e})") from None
        for name, t in tensors.items():
            name = normalise_hf_names(name)
            # Every matrix but the embedding table is a projection (q/k/v/o, MLP, experts, router).
            out[name] = WeightSource(tuple(t.shape), tensor=t) if t.dim() == 2 and not name.endswith(
                "embed_tokens.weight") else t
    emb = out.get("model.embed_tokens.weight")
    if isinstance(emb, WeightSource):
        out["model.embed_tokens.weight"] = emb.tensor
    if "lm_head.weight" not in out:
        cfg.tie_word_embeddings = True

    _check_shapes(out, cfg)
    return out
