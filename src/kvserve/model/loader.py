"""load_model: any model source -> (model, tokenizer, config), ready for the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.registry import ModelSource, resolve
from kvserve.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    source: ModelSource
    load_seconds: float


def load_model(model: str | None = None, weight_format: str = "auto") -> LoadedModel:
    t0 = time.perf_counter()
    src = resolve(model)
    if src.kind == "gguf":
        from kvserve.model.gguf_loader import config_from_gguf, open_gguf, weights_from_gguf

        reader = open_gguf(src.path)
        cfg = config_from_gguf(reader, src.name)
        tok = Tokenizer.from_gguf(reader)
        weights = weights_from_gguf(reader, cfg)
    else:
        from kvserve.model.hf_loader import config_from_dir, weights_from_dir

        cfg = config_from_dir(src.path)
        tok = Tokenizer.from_dir(src.path)
        weights = weights_from_dir(src.path, cfg)
    with torch.no_grad():
        net = LlamaForCausalLM.from_weights(cfg, weights, weight_format).eval()
    return LoadedModel(net, tok, cfg, src, time.perf_counter() - t0)
