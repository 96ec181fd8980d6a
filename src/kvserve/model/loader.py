"""load_model: any model source -> (model, tokenizer, config), ready for the engine.

This is where the kernel backend is chosen (once per loaded model, from the CPU's features and
the KVSERVE_* switches; see kernels/backend.py) and handed to every layer that uses it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.decoder import DecoderLM
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.registry import ModelSource, resolve
from kvserve.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: DecoderLM
    tokenizer: Tokenizer
    config: ModelConfig
    source: ModelSource
    load_seconds: float
    backend: KernelBackend


def load_model(model: str | None = None, weight_format: str = "auto", *, device: str | torch.device = "cpu",
               isa: str | None = None, backend: KernelBackend | None = None) -> LoadedModel:
    """Load `model` (a built-in name, a .gguf file or a Hugging Face directory; None = the default).

    weight_format: auto (GGUF quants stay packed), gguf, fp32, bf16, fp16, q8_0 (dense weights packed
        into Q8_0 blocks at load).
    device: where the model runs; on anything but the CPU only PyTorch paths are used.
    isa: force a lower kernel ISA level than the CPU's (avx2, avx512, amx; as KVSERVE_ISA).
    backend: a KernelBackend made by the caller (then device and isa are not used).
    """
    t0 = time.perf_counter()
    if backend is None:
        backend = KernelBackend.detect(device=device, isa=isa)
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
        net = DecoderLM.from_weights(cfg, weights, weight_format, backend=backend).eval()
    if torch.device(backend.device).type != "cpu":
        net.to(backend.device)
    return LoadedModel(net, tok, cfg, src, time.perf_counter() - t0, backend)
