"""A fused projection whose members keep their own GGUF types (row segments).

kvserve fuses q/k/v into one projection and gate/up into another (one activation quantization,
one kernel call, one barrier per fusion in the fused forward). llama.cpp's K-quant mixes give the
members different types: a Q4_K_M file has Q4_K attn_q/attn_k beside a Q6_K attn_v in about half
its layers (a Q5_K_M file Q5_K beside Q6_K). One layout cannot hold both, so such a projection
used to be requantized whole to Q8_0: 8.5 bits a weight where the file has 4.5-6.6, which a decode
step reads every token (the 3B shape's Q4_K_M: 223 MB for the 135 MB of those 14 layers' q/k/v),
and a second rounding of every weight.

SegmentedQuantLinear keeps each member packed in its own layout (one GGUFQuantLinear per member,
repacked and pack-cached as a lone projection would be) and gives the kernels one descriptor of
kernel qtype 5 (KVS_QTYPE_SEGMENTS): `kvs_weight.seg` lists the members' descriptors, and the
kernels run each member's own tiles over its rows, writing its slice of the output row
(cpu/kvserve_kernels.cpp, linear_rows), on every path that takes a descriptor: kvs_linear, the
fused forward, the fp32 dequantization for large calls and the row lookups. The activations are
quantized once for all members, so the result equals the members run one by one and concatenated,
bit for bit (tests/model/test_fused_segments.py).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType

from kvserve.model.kernels import reference
from kvserve.model.kernels.build import KvsWeight
from kvserve.model.kernels.gguf_linear import Bf16Weight, GGUFQuantLinear, _tensor, linear_state

if TYPE_CHECKING:
    from kvserve.model.kernels.backend import KernelBackend

SEGMENTS_LAYOUT = 5     # kvs_weight.qtype of a segment list (KVS_QTYPE_SEGMENTS)


class SegmentedQuantLinear(GGUFQuantLinear):
    """y = x @ [W_0; W_1; ...]^T (+ bias) with each W_i packed in its own GGUF type.

    parts: (raw rows uint8 [rows_i, bytes per row], GGUF type, rows_i) per member, in output
    order; all members share in_features. `qtype` is None (there is no one type); `qtypes` names
    the members'. Follows model/linear.py's Linear protocol, with row lookups, as GGUFQuantLinear.
    """

    def __init__(self, parts: list[tuple[np.ndarray, GGMLQuantizationType, int]], in_features: int,
                 bias: torch.Tensor | None = None, *, backend: KernelBackend) -> None:
        torch.nn.Module.__init__(self)
        self.qtype = None
        self.qtypes = tuple(GGMLQuantizationType(q) for _, q, _ in parts)
        linear_state(self, in_features, sum(rows for _, _, rows in parts), bias, backend)
        self.segments = torch.nn.ModuleList()
        if self.lib is None:
            self.weight_f32 = torch.cat([reference.dequantize(_tensor(np.ascontiguousarray(raw)), qt, in_features)
                                         for raw, qt, _ in parts])
            return
        off = 0
        for raw, qt, rows in parts:     # in build order: each member takes or records its pack-cache entry
            b = None if self.bias is None else self.bias[off:off + rows]
            self.segments.append(GGUFQuantLinear(raw, qt, in_features, rows, b, backend=backend, lookup_only=True))
            off += rows
        self._segs = (KvsWeight * len(self.segments))(*(s.desc for s in self.segments))
        self.desc = KvsWeight(SEGMENTS_LAYOUT, self.out_features, in_features, backend.gemm_isa, 0,
                              None, None, None, None if self.bias is None else self.bias.data_ptr(),
                              len(self.segments), ctypes.cast(self._segs, ctypes.POINTER(KvsWeight)))
        self._desc_ptr = ctypes.addressof(self.desc)
        self._linear = self.lib.kvs_linear
        for i, s in enumerate(self.segments):   # a segment's later adopt_packed updates the kernels' copy too
            s.desc = self._segs[i]
            s._desc_ptr = ctypes.addressof(s.desc)
        if backend.bf16_min_tokens is not None:
            self.weight_bf16 = Bf16Weight(self.dequantized_weight(), backend.bf16_prepack)

    def block_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError("a segmented projection has no one layout: ask its segments")

    def extra_repr(self) -> str:
        path = "torch-fallback" if self.lib is None else ("avx512-vnni-int8" if self.desc.isa else "avx2-int8")
        return (f"in={self.in_features}, out={self.out_features}, "
                f"segments={'+'.join(q.name for q in self.qtypes)}, {path}")
