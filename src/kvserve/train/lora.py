"""LoRA and QLoRA training, PEFT's file layout, and merging an adapter into its base.

    inject(model, rank, alpha, targets, qlora)   freeze the base; wrap each fused projection in a
                                                 LoRATrainLinear holding A, B per targeted module
    save_adapter(model, out, base)               adapter_config.json + adapter_model.safetensors
                                                 (PEFT's names: `peft` loads them, kvserve serves them)
    merge(base_dir, adapter_dir, out)            W += scale * B A, written as an HF directory

A LoRATrainLinear computes `base(x) + (dropout(x) A_m^T) B_m^T * alpha / r` for each targeted
module m of the fused projection (q/k/v share qkv_proj, gate/up share gate_up_proj), its delta in
m's slice of the output. B starts at zero (PEFT's init), so step 0 is the base model.

QLoRA: the frozen base projections become 4-bit (GGUF q4_0, packed in kvserve's own int8-dot
kernels, `GGUFQuantLinear`), run forward by those kernels; the gradient with respect to the input
multiplies by the weight dequantized for that one call (`Frozen4bit`), so only the adapters train
in fp32 while the base stays at ~4.5 bits a weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvserve.errors import InvalidRequest
from kvserve.model.lora import MODULES, PROJECTIONS, load_adapter, module_shapes, parse_targets


class _Dequant4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        with torch.no_grad():
            return layer.q(x)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.layer.weight_fp32()
        return grad @ w, None


class Frozen4bit(nn.Module):
    """A frozen projection held as GGUF q4_0 and run by kvserve's kernels; differentiable in x."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, backend) -> None:
        super().__init__()
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        from kvserve.model.kernels.gguf_linear import GGUFQuantLinear

        qt = GGMLQuantizationType.Q4_0
        self.raw = quantize(weight.detach().float().numpy(), qt)
        self.qtype = qt
        self.out_features, self.in_features = weight.shape
        self.q = GGUFQuantLinear(np.ascontiguousarray(self.raw), qt, self.in_features, self.out_features,
                                 None if bias is None else bias.detach().float(), backend=backend)

    def weight_fp32(self) -> torch.Tensor:
        from gguf.quants import dequantize

        return torch.from_numpy(np.ascontiguousarray(dequantize(self.raw, self.qtype), dtype=np.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Dequant4.apply(x, self)


class LoRATrainLinear(nn.Module):
    def __init__(self, base: nn.Module, parts: list[tuple[str, int]], targets: list[str], rank: int,
                 alpha: float, dropout: float = 0.0, seed: int = 0) -> None:
        """parts: (HF module, output size) in the fused order; only `targets` get an adapter."""
        super().__init__()
        self.base = base
        self.parts, self.rank, self.scale = parts, rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        g = torch.Generator().manual_seed(seed)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        in_f = base.in_features
        for name, out in parts:
            if name in targets:   # PEFT's init: A Kaiming-uniform, B zero
                bound = 1 / in_f ** 0.5
                self.lora_A[name] = nn.Parameter((torch.rand(rank, in_f, generator=g) * 2 - 1) * bound)
                self.lora_B[name] = nn.Parameter(torch.zeros(out, rank))
        self.in_features, self.out_features = in_f, sum(o for _, o in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        h = self.dropout(x)
        deltas = []
        for name, out in self.parts:
            if name in self.lora_A:
                deltas.append((h @ self.lora_A[name].t()) @ self.lora_B[name].t() * self.scale)
            else:
                deltas.append(y.new_zeros(*y.shape[:-1], out))
        return y + torch.cat(deltas, dim=-1)


def inject(model: nn.Module, rank: int, alpha: float | None = None, targets: str | list[str] | None = None,
           qlora: bool = False, dropout: float = 0.0, seed: int = 0) -> dict:
    """Freeze `model` and add trainable LoRA weights on `targets` (default all seven projections);
    with qlora the frozen projections become 4-bit. Returns the adapter's PEFT config fields."""
    if not isinstance(rank, int) or rank < 1:
        raise InvalidRequest(f"--lora-rank must be a positive integer, got {rank!r}", param="lora_rank")
    if model.config.num_experts:
        raise InvalidRequest("LoRA training supports dense (non-MoE) models", param="lora_rank")
    names = parse_targets(targets)
    alpha = float(alpha if alpha is not None else 2 * rank)
    model.requires_grad_(False)
    shapes = module_shapes(model.config)
    backend = model.backend
    if qlora:
        from kvserve.model.kernels.backend import KernelBackend
        if backend.lib is None:
            backend = KernelBackend.detect()
    for i, layer in enumerate(model.layers):
        for proj in PROJECTIONS:
            base = getattr(layer, proj)
            parts = [(m, shapes[m][0]) for m, (p, _) in sorted(MODULES.items(), key=lambda kv: kv[1][1])
                     if p == proj]
            if qlora:
                base = Frozen4bit(base.weight, base.bias, backend)
            if any(m in names for m, _ in parts):
                base = LoRATrainLinear(base, parts, names, rank, alpha, dropout, seed * 1000 + i)
            setattr(layer, proj, base)
    model.train()
    model.lora_train = {"r": rank, "lora_alpha": alpha, "target_modules": names, "lora_dropout": dropout,
                        "qlora": qlora}
    return model.lora_train


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained adapter under PEFT's tensor names."""
    out = {}
    for i, layer in enumerate(model.layers):
        for proj in PROJECTIONS:
            mod = getattr(layer, proj)
            if not isinstance(mod, LoRATrainLinear):
                continue
            part = "self_attn" if proj in ("qkv_proj", "o_proj") else "mlp"
            for m in mod.lora_A:
                p = f"base_model.model.model.layers.{i}.{part}.{m}"
                out[f"{p}.lora_A.weight"] = mod.lora_A[m].detach().float().contiguous().clone()
                out[f"{p}.lora_B.weight"] = mod.lora_B[m].detach().float().contiguous().clone()
    return out


def write_adapter(out: str | Path, tensors: dict[str, torch.Tensor], rank: int, alpha: float,
                  targets: list[str], base: str | None = None, dropout: float = 0.0) -> Path:
    """Write PEFT's layout: adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": sorted(targets), "lora_dropout": dropout, "bias": "none",
            "base_model_name_or_path": base, "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, "use_rslora": False, "use_dora": False,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
            "revision": None}
    (d / "adapter_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
    return d


def random_adapter(out: str | Path, cfg, seed: int = 0, rank: int = 8, targets: list[str] | None = None,
                   std: float = 0.08) -> Path:
    """A PEFT adapter with random A and B (nonzero) for `cfg`'s shapes: for tests and benchmarks."""
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(cfg)
    targets = targets or list(shapes)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for m in targets:
            out_f, in_f = shapes[m]
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            p = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * std
            tensors[f"{p}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * std
    return write_adapter(out, tensors, rank, 2.0 * rank, targets)


def save_adapter(model: nn.Module, out: str | Path, base: str | None = None) -> Path:
    c = model.lora_train
    return write_adapter(out, adapter_tensors(model), c["r"], c["lora_alpha"], c["target_modules"], base,
                         c["lora_dropout"])


def merge(base_dir: str | Path, adapter_dir: str | Path, out: str | Path) -> Path:
    """Fold an adapter into its base: W += scale * B A on every adapted projection; the result is
    an fp32 Hugging Face directory (tokenizer files copied) that serves without the adapter."""
    from kvserve.model.loader import load_model
    from kvserve.train.export import export_hf

    lm = load_model(str(base_dir), weight_format="fp32")
    adapter = load_adapter(adapter_dir, lm.config, Path(adapter_dir).name)
    with torch.no_grad():
        for layer, fused in zip(lm.model.layers, adapter.layers):
            for proj, (A, B) in fused.items():
                getattr(layer, proj).weight += B @ A
    src = lm.source.path if Path(str(lm.source.path)).is_dir() else Path(str(lm.source.path)).parent
    return export_hf(lm.model, src, out, lm.tokenizer.eos_token_ids)
