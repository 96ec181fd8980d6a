"""Weight-format Linear variants: GGUF block quants kept packed, and dense fp32/bf16/fp16.

All share one call signature: layer(x) with x [T, in_features] float32 -> [T, out_features] float32.
"""

from kvserve.model.quant.build import load_kernels, unavailable_reason
from kvserve.model.quant.dense import DenseLinear
from kvserve.model.quant.gguf_linear import (
    GGUFQuantLinear,
    QuantLinearConfig,
    get_config,
    set_config,
    supports,
)

__all__ = [
    "DenseLinear",
    "GGUFQuantLinear",
    "QuantLinearConfig",
    "get_config",
    "load_kernels",
    "set_config",
    "supports",
    "unavailable_reason",
]
