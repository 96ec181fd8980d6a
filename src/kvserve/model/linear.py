"""Linear layers: one protocol, several weight formats.

Every projection in the model is built by `make_linear(weight, bias, weight_format, backend=...)`
and follows the `Linear` protocol: called as `layer(x)` with `x` of shape [T, in_features], it
returns [T, out_features] in float32. The variants are DenseLinear (fp32/bf16/fp16 weights, here)
and GGUFQuantLinear (GGUF block quants kept packed, kernels/gguf_linear.py), which also declares
row lookups (`supports_rows`), so a packed embedding table needs no fp32 copy.
A `WeightSource` is the weight as a loader found it: a dense tensor (fp32/fp16/bf16 from
safetensors or GGUF) or the packed bytes of a GGUF block quantization, kept packed so that
quantized variants can multiply without a round trip through fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import torch
from torch import nn

from kvserve.errors import InvalidRequest
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kernels.gguf_linear import GGUFQuantLinear, supports

WEIGHT_FORMATS = ("auto", "fp32", "bf16", "fp16", "gguf", "q8_0", "q4_1")
PACKED_FORMATS = ("q8_0", "q4_1")     # dense weights are packed into these GGUF block types at load


@dataclass
class WeightSource:
    shape: tuple[int, int]                 # (out_features, in_features)
    tensor: torch.Tensor | None = None     # dense weight, any float dtype
    raw: np.ndarray | None = None          # GGUF packed rows: uint8 [out_features, bytes_per_row]
    qtype: object | None = None            # gguf.GGMLQuantizationType of `raw`
    parts: list[WeightSource] | None = None   # a mixed-type concat's members, each kept as it is

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [out, in]."""
        if self.tensor is not None:
            return self.tensor.float()
        if self.parts is not None:
            return torch.cat([p.dequantize() for p in self.parts])
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
        if all(p.raw is not None and supports(p.qtype) for p in parts):   # Q4_K q/k beside a Q6_K v:
            return WeightSource(shape, parts=parts)                      # segments, none requantized
        if all(p.tensor is not None for p in parts) and len({p.tensor.dtype for p in parts}) == 1:
            return WeightSource(shape, tensor=torch.cat([p.tensor for p in parts]))
        return WeightSource(shape, tensor=torch.cat([p.dequantize() for p in parts]))


class Linear(Protocol):
    """What the model asks of a projection, whatever its weight format."""

    in_features: int
    out_features: int
    supports_rows: ClassVar[bool]   # True: rows(ids) returns rows of W (embedding lookups)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] (or [..., in_features]) -> float32 [..., out_features]."""
        ...


class RowLookup(Linear, Protocol):
    """A Linear that also serves embedding lookups from its own (packed) weights."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of W as float32 [*ids.shape, in_features]."""
        ...


class DenseLinear(nn.Module):
    """y = x W^T (+ b) with W stored in fp32, bf16 or fp16; output always float32.

    fp32 weights call torch (MKL) directly. Half-precision weights compute in their own dtype
    (oneDNN accumulates in fp32; AMX tiles where present) and cast the result back to fp32.
    """

    supports_rows: ClassVar[bool] = False

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


def make_linear(weight: WeightSource, bias: torch.Tensor | None = None, weight_format: str = "auto",
                lookup_only: bool = False, *, backend: KernelBackend | None = None) -> Linear:
    """Build the Linear variant for `weight` in the requested format.

    "auto" keeps GGUF block quants packed when a packed variant supports them, else fp32.
    "q8_0" does the same, and packs dense weights (safetensors) into Q8_0 blocks at load, so a
    Hugging Face model runs on the int8 kernels too (rows of a width not divisible by 32 stay fp32);
    "q4_1" packs them into Q4_1 blocks (gguf-py's rounding, as `kvserve quantize --type q4_1`): 0.63
    of Q8_0's bytes, for what reads its weights from memory every call (a speculative draft).
    lookup_only: the packed variant will only serve row lookups (an untied embedding table).
    backend: the kernel choices of the model being built (default: PyTorch only).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise InvalidRequest(f"unknown weight format {weight_format!r}; choose one of {WEIGHT_FORMATS}",
                             param="weight_format")
    if weight_format in PACKED_FORMATS and weight.raw is None and weight.parts is None and weight.shape[1] % 32 == 0:
        import gguf
        import gguf.quants

        qtype = gguf.GGMLQuantizationType[weight_format.upper()]
        raw = gguf.quants.quantize(weight.dequantize().numpy(), qtype)
        weight = WeightSource(weight.shape, raw=raw, qtype=qtype)
    if weight_format in ("auto", "gguf", *PACKED_FORMATS) and weight.parts is not None:
        from kvserve.model.kernels.fused_linear import SegmentedQuantLinear

        return SegmentedQuantLinear([(p.raw, p.qtype, p.shape[0]) for p in weight.parts], weight.shape[1], bias,
                                    backend=backend or KernelBackend.pytorch())
    if weight_format in ("auto", "gguf", *PACKED_FORMATS) and weight.raw is not None and supports(weight.qtype):
        return GGUFQuantLinear(weight.raw, weight.qtype, weight.shape[1], weight.shape[0], bias,
                               backend=backend or KernelBackend.pytorch(), lookup_only=lookup_only)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(weight_format, torch.float32)
    return DenseLinear(weight.dequantize().to(dtype), bias)
