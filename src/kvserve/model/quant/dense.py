"""Dense (unquantized) Linear: fp32, bf16 or fp16 weights, float32 in and out."""

from __future__ import annotations

import torch


class DenseLinear(torch.nn.Module):
    """y = x @ W^T (+ bias) for fp32 / bf16 / fp16 weights, with the same call signature as the
    quantized variants: x [T, in] float32 -> [T, out] float32.

    fp32 weights call torch (MKL) directly. Half-precision weights compute in their own dtype
    (oneDNN accumulates in fp32; AMX tiles where present) and cast the result back to fp32.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            weight = weight.float()
        self.weight = torch.nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == torch.float32:
            return torch.nn.functional.linear(x.float(), w, self.bias)
        y = torch.nn.functional.linear(x.to(w.dtype), w).float()
        if self.bias is not None:
            y += self.bias
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, dtype={self.weight.dtype}"
