"""Linear layers: one call signature, several weight formats.

Every projection in the model is built by `make_linear(weight, bias, weight_format)` and called
as `layer(x)` with `x` of shape [T, in_features], returning [T, out_features] in float32.
A `WeightSource` is the weight as a loader found it: a dense tensor (fp32/fp16/bf16 from
safetensors or GGUF) or the packed bytes of a GGUF block quantization, kept packed so that
quantized variants can multiply without a round trip through fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kvserve.errors import InvalidRequest

WEIGHT_FORMATS = ("auto", "fp32", "bf16", "fp16", "gguf")


@dataclass
class WeightSource:
    shape: tuple[int, int]                 # (out_features, in_features)
    tensor: torch.Tensor | None = None     # dense weight, any float dtype
    raw: np.ndarray | None = None          # GGUF packed rows: uint8 [out_features, bytes_per_row]
    qtype: object | None = None            # gguf.GGMLQuantizationType of `raw`

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [out, in]."""
        if self.tensor is not None:
            return self.tensor.float()
        from gguf.quants import dequantize

        w = dequantize(self.raw, self.qtype)
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(self.shape)

    def permute_rows(self, order: torch.Tensor) -> WeightSource:
        """Reorder output rows (used to undo GGUF's Q/K RoPE permutation); exact for packed rows."""
        if self.tensor is not None:
            return WeightSource(self.shape, tensor=self.tensor[order])
        return WeightSource(self.shape, raw=self.raw[order.numpy()], qtype=self.qtype)

    @staticmethod
    def concat(parts: list[WeightSource]) -> WeightSource:
        """Stack several weights along the output dimension (fused QKV, fused gate/up)."""
        ins = {p.shape[1] for p in parts}
        assert len(ins) == 1, "fused weights must share in_features"
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        if all(p.raw is not None for p in parts) and len({p.qtype for p in parts}) == 1:
            return WeightSource(shape, raw=np.concatenate([p.raw for p in parts]), qtype=parts[0].qtype)
        if all(p.tensor is not None for p in parts) and len({p.tensor.dtype for p in parts}) == 1:
            return WeightSource(shape, tensor=torch.cat([p.tensor for p in parts]))
        return WeightSource(shape, tensor=torch.cat([p.dequantize() for p in parts]))


class DenseLinear(nn.Module):
    """y = x W^T (+ b) with W stored in fp32, bf16 or fp16; output always float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype != x.dtype:
            y = torch.nn.functional.linear(x.to(w.dtype), w).float()
            return y if self.bias is None else y + self.bias
        return torch.nn.functional.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, {self.weight.dtype}"


def make_linear(weight: WeightSource, bias: torch.Tensor | None = None,
                weight_format: str = "auto", lookup_only: bool = False) -> nn.Module:
    """Build the Linear variant for `weight` in the requested format.

    "auto" keeps GGUF block quants packed when a quantized kernel supports them, else fp32.
    lookup_only: the packed variant will only serve row lookups (an untied embedding table).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise InvalidRequest(f"unknown weight format {weight_format!r}; choose one of {WEIGHT_FORMATS}",
                             param="weight_format")
    if weight_format in ("auto", "gguf") and weight.raw is not None:
        try:
            from kvserve.model import quant
        except ImportError:
            quant = None
        if quant is not None and quant.supports(weight.qtype):
            return quant.GGUFQuantLinear(weight.raw, weight.qtype, weight.shape[1], weight.shape[0], bias,
                                         lookup_only=lookup_only)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(weight_format, torch.float32)
    return DenseLinear(weight.dequantize().to(dtype), bias)
