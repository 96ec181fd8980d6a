"""Linear layers over GGUF block-quantized weights, kept packed (Q4_0, Q4_1, Q8_0; Q4_K, Q5_K and
Q6_K with their own super-block scales, at about the file's size; Q5_0 and Q5_1 laid out as Q8_0
blocks at load, kquants.py).

GGUFQuantLinear follows model/linear.py's Linear protocol and adds row lookups (`rows`), so a
packed embedding table needs no fp32 copy. Which path a call takes is the KernelBackend's choice.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from kvserve.errors import ModelLoadError
from kvserve.model.kernels import kquants, pack_cache, reference
from kvserve.model.kernels.build import KvsWeight

if TYPE_CHECKING:
    from kvserve.model.kernels.backend import KernelBackend

_KERNEL_QTYPE = {
    GGMLQuantizationType.Q4_0: 0,
    GGMLQuantizationType.Q4_1: 0,
    GGMLQuantizationType.Q8_0: 1,
    GGMLQuantizationType.Q4_K: 2,   # Q4 codes, the file's scales per super-block (148 bytes per 256 values)
    GGMLQuantizationType.Q6_K: 3,   # 6-bit codes, fp16 d and int8 scales per 16 values (6.56 bits, as the file)
    GGMLQuantizationType.Q5_K: 4,   # Q4_K's layout plus a plane of fifth bits (5.63 bits a weight)
    GGMLQuantizationType.Q5_0: 1,   # exactly Q8_0 blocks (kquants.q5_0_as_q8_0)
    GGMLQuantizationType.Q5_1: 1,   # decoded and requantized, as Q6_K
}


Q8_0 = GGMLQuantizationType.Q8_0
Q4K_LAYOUT = 2       # the kernels' qtype of Q4_K kept with its super-block scales (kvs_weight.qtype)
Q6K_LAYOUT = 3       # ... of Q6_K kept at its 6 bits
Q5K_LAYOUT = 4       # ... of Q5_K (Q4_K's scales, a fifth bit per code)
SDTYPE_KSUPER = 2    # kvs_weight.sdtype of all three: d holds the super-block scale bytes, m is empty
_SUPER = {GGMLQuantizationType.Q4_K: Q4K_LAYOUT, GGMLQuantizationType.Q6_K: Q6K_LAYOUT,
          GGMLQuantizationType.Q5_K: Q5K_LAYOUT}


def supports(qtype: GGMLQuantizationType) -> bool:
    """True if GGUFQuantLinear can hold weights of this type packed."""
    return qtype in _KERNEL_QTYPE


class Bf16Weight:
    """A bf16 weight for torch's oneDNN matmul, prepacked once into oneDNN's blocked layout when
    the backend says torch and the CPU can (halves the time of small and medium calls: no
    per-call weight reorder); otherwise a plain bf16 matmul."""

    def __init__(self, w: torch.Tensor, prepack: bool) -> None:
        w = w.to(torch.bfloat16).contiguous()
        self.prepacked = prepack
        self.w = torch.ops.mkldnn._reorder_linear_weight(w, None) if self.prepacked else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.w, None, "none", [], "").float()
        return torch.nn.functional.linear(x, self.w).float()


def _tensor(raw: np.ndarray) -> torch.Tensor:
    """A torch tensor of raw bytes; a read-only mapping is copied (torch tensors are writable)."""
    return torch.from_numpy(raw if raw.flags.writeable else raw.copy())


def _mapped_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(n) in its own anonymous mapping (unmapped when the tensor is freed)."""
    if n == 0:
        return torch.empty(0, dtype=dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, n * itemsize), dtype=dtype, count=n)


def unpack_q4_k(raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks (256 values: fp16 d, dmin, 6-bit scales/mins of 8 sub-blocks, 128 bytes of
    nibbles) -> plain values q [rows, cols] (0..15) and per-32-value block scale d*sc and minimum
    -dmin*m [rows, cols/32] (exact in fp32): Q4 blocks for the kernels' layout (kvs_pack_q4)."""
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K][1])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = gguf_quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scale = d * sc.astype(np.float32)
    minimum = -(dmin * mn.astype(np.float32))
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)    # 64-value chunks: sub-block 2c low nibbles, 2c+1 high
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
    return (np.ascontiguousarray(q).reshape(rows, -1), np.ascontiguousarray(scale).reshape(rows, -1),
            np.ascontiguousarray(minimum).reshape(rows, -1))


class GGUFQuantLinear(torch.nn.Module):
    """y = x @ W^T (+ bias) with W in GGUF block-quantized form.

    The weights stay 4- or 8-bit: at load they are repacked into 16-row groups with float32 block
    scales (cpu/kvserve_kernels.cpp draws the layout) and every call quantizes x to int8 per
    32-block and runs integer dot products (AVX2, or AVX-512 VNNI where the backend has it, with
    identical results), for one token or five hundred: the same arithmetic for every call size is
    what makes inference batch-invariant. Only with batch invariance off do large calls go to a
    bf16 copy and oneDNN, or to an fp32 dequantization and MKL, from the token counts the backend
    sets. With a backend without the C library (another device, no compiler), the layer holds the
    dequantized fp32 weights and calls torch.
    """

    supports_rows: ClassVar[bool] = True

    def __init__(
        self,
        raw: np.ndarray,
        qtype: GGMLQuantizationType,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        *,
        backend: KernelBackend,
        lookup_only: bool = False,
    ) -> None:
        """lookup_only: the weight serves only `rows()` (an untied embedding table), so no bf16
        copy for large matmuls is made."""
        super().__init__()
        qtype = GGMLQuantizationType(qtype)
        if not supports(qtype):
            raise ModelLoadError(f"GGUF weight type {qtype.name} has no packed kernel; dequantize it instead")
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if in_features % block:
            raise ModelLoadError(f"in_features={in_features} is not a multiple of the {qtype.name} block size {block}")
        session = pack_cache.current()
        cached = None
        if session is not None and session.hit and backend.lib is not None:
            lib, kq = backend.lib, _KERNEL_QTYPE[qtype]
            n_scales = (lib.kvs_packed_kscale_bytes(kq, out_features, in_features) if qtype in _SUPER
                        else lib.kvs_packed_scales(out_features, in_features))
            expect = (lib.kvs_packed_qs_bytes(kq, out_features, in_features), n_scales, kq == 0)
            cached = session.take(qtype, out_features, in_features, expect)
        raw = np.ascontiguousarray(raw, dtype=np.uint8)     # a view of the mapped file: no copy
        expect = (out_features, in_features // block * block_bytes)
        if cached is None and tuple(raw.shape) != expect:
            raise ModelLoadError(
                f"GGUF {qtype.name} tensor has byte shape {tuple(raw.shape)}, expected {expect}"
            )
        self.qtype = qtype
        linear_state(self, in_features, out_features, bias, backend)
        if self.lib is None:
            self.weight_f32 = reference.dequantize(_tensor(raw), qtype, in_features)
            return
        q4 = _KERNEL_QTYPE[qtype] in (0, Q4K_LAYOUT, Q5K_LAYOUT)
        if cached is not None:          # repacked by an earlier load (pack_cache.py)
            self.qs, self.d, self.m, sdtype = cached
        else:
            sdtype = self._repack(raw, q4, mapped=session is not None)
            if session is not None:
                session.record(self)
        self.desc = KvsWeight(
            _KERNEL_QTYPE[qtype], out_features, in_features, backend.gemm_isa, sdtype,
            self.qs.data_ptr(), self.d.data_ptr(), self.m.data_ptr() if self.m.numel() else None,
            None if self.bias is None else self.bias.data_ptr(),
        )  # fmt: skip
        self._desc_ptr = ctypes.addressof(self.desc)
        self._drop_q4_0_minima()
        self._linear = self.lib.kvs_linear
        if backend.bf16_min_tokens is not None and not lookup_only:
            self.weight_bf16 = Bf16Weight(reference.dequantize(_tensor(raw), qtype, in_features),
                                          backend.bf16_prepack)

    def _repack(self, raw: np.ndarray, q4: bool, mapped: bool = False) -> int:
        """The GGUF rows into the kernels' layout (self.qs, self.d, self.m); returns the scales' dtype
        code. Block scales stay float16 where GGUF stores them so (fewer bytes per decode step),
        float32 for Q4_K's products d * sc (and a Q4_0 whose minimum -8 d does not fit a float16).
        mapped: the buffers are temporary (the pack cache's file replaces them), so they are
        anonymous mappings that go back to the system when freed, not heap that stays in RSS."""
        lib, qtype, rows, cols = self.lib, self.qtype, self.out_features, self.in_features
        ggml_type = int(qtype)
        if qtype in kquants.REQUANTIZED:
            raw, ggml_type = kquants.q8_0_rows(raw, qtype, cols, lib), int(GGMLQuantizationType.Q8_0)
        empty = _mapped_empty if mapped else torch.empty
        self.qs = empty(lib.kvs_packed_qs_bytes(_KERNEL_QTYPE[qtype], rows, cols), dtype=torch.uint8)
        if qtype in _SUPER:     # the codes and the file's own super-block scales: nothing rounded
            self.d = empty(lib.kvs_packed_kscale_bytes(_SUPER[qtype], rows, cols), dtype=torch.uint8)
            self.m = torch.empty(0, dtype=torch.uint8)
            repack = {Q4K_LAYOUT: lib.kvs_repack_q4_k_super, Q6K_LAYOUT: lib.kvs_repack_q6_k,
                      Q5K_LAYOUT: lib.kvs_repack_q5_k_super}[_SUPER[qtype]]
            repack(raw.ctypes.data, rows, cols, self.qs.data_ptr(), self.d.data_ptr())
            return SDTYPE_KSUPER
        n_scales = lib.kvs_packed_scales(rows, cols)
        for sdtype in (1, 0):
            dt = torch.float16 if sdtype else torch.float32
            self.d = empty(n_scales, dtype=dt)
            self.m = empty(n_scales if q4 else 0, dtype=dt)
            if ggml_type == int(Q8_0):     # kvs_repack's bytes, in 4-byte runs
                lib.kvs_repack_q8_0(raw.ctypes.data, rows, cols, self.qs.data_ptr(), self.d.data_ptr(), sdtype)
                rc = 0
            elif ggml_type in (int(GGMLQuantizationType.Q4_0), int(GGMLQuantizationType.Q4_1)):
                rc = lib.kvs_repack_q4(ggml_type, raw.ctypes.data, rows, cols, self.qs.data_ptr(), self.d.data_ptr(),
                                       self.m.data_ptr(), sdtype)    # kvs_repack's bytes, all threads
            else:
                rc = lib.kvs_repack(ggml_type, raw.ctypes.data, rows, cols, self.qs.data_ptr(), self.d.data_ptr(),
                                    self.m.data_ptr() if q4 else None, sdtype)
            if rc != 1:
                break
        if rc != 0:
            raise ModelLoadError(f"kernel repack failed for {qtype.name}")
        return sdtype

    def adopt_packed(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        """Hold the same packed bytes from elsewhere (the pack cache's mapping); the descriptor is
        updated in place, so C descriptors that point at it stay valid."""
        assert qs.numel() == self.qs.numel() and d.numel() == self.d.numel() and d.dtype == self.d.dtype
        self.qs, self.d, self.m = qs, d, m
        self.desc.qs, self.desc.d = qs.data_ptr(), d.data_ptr()
        self.desc.m = m.data_ptr() if m.numel() else None
        self._drop_q4_0_minima()

    def _drop_q4_0_minima(self) -> None:
        """A Q4_0 weight's minima are -8 d: where the tiles run (AVX2) form them from float16 d
        (kvs_weight.m NULL), they are not kept, and a decode step reads 18 bytes per 32 weights,
        the file's, instead of 20. The AVX-512 and AMX tiles still read them."""
        if (self.qtype == GGMLQuantizationType.Q4_0 and self.desc.sdtype == 1 and self.desc.isa == 0
                and self.m.numel()):
            self.m = torch.empty(0, dtype=self.d.dtype)
            self.desc.m = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.dim() != 2:
            x = x.reshape(-1, self.in_features)
        if x.dtype != torch.float32:
            x = x.float()
        T = x.shape[0]
        b = self.backend
        if self.weight_f32 is not None:
            y = torch.nn.functional.linear(x, self.weight_f32, self.bias)
        elif self.weight_bf16 is not None and T >= b.bf16_min_tokens:
            y = self.weight_bf16(x)
            if self.bias is not None:
                y += self.bias
        elif b.f32_min_tokens is not None and T >= b.f32_min_tokens:
            with b.f32_scratch(self.out_features * self.in_features) as w:
                w = w.view(self.out_features, self.in_features)
                self.lib.kvs_dequantize(self._desc_ptr, w.data_ptr())
                y = torch.nn.functional.linear(x, w, self.bias)
        else:
            if not x.is_contiguous():
                x = x.contiguous()
            y = torch.empty(T, self.out_features, dtype=torch.float32)
            self._linear(self._desc_ptr, x.data_ptr(), T, y.data_ptr())
        return y if len(shape) == 2 else y.reshape(*shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of W as float32 [*ids.shape, in_features]: an embedding lookup
        straight from the packed weights (a tied embedding needs no fp32 table of its own)."""
        flat = ids.reshape(-1).to(torch.int64)
        if self.weight_f32 is not None:
            out = self.weight_f32[flat]
        else:
            flat = flat.contiguous()
            out = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
            if self.lib.kvs_dequantize_rows(self._desc_ptr, flat.data_ptr(), flat.numel(), out.data_ptr()) != 0:
                raise IndexError(f"token id out of range [0, {self.out_features})")
        return out.view(*ids.shape, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [out, in], for tests and tools."""
        if self.weight_f32 is not None:
            return self.weight_f32
        w = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        self.lib.kvs_dequantize(self._desc_ptr, w.data_ptr())
        return w

    def block_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The per-32-value block scale d and minimum m (None for Q8_0) of every row as float32
        [out, in / 32], as the kernels form them from whatever layout holds them (for tests and
        tools: w = d * q + m)."""
        rows, nb = self.out_features, self.in_features // 32
        if self.desc.qtype == Q6K_LAYOUT:
            raise NotImplementedError("Q6_K has a scale per 16 values, not per block of 32")
        if self.desc.sdtype == SDTYPE_KSUPER:      # [group][super-block] {d[16], dmin[16], sc[8][16], mn[8][16]}
            ks = self.d.view(-1, nb // 8, 320)
            ds = ks[:, :, 0:32].contiguous().view(torch.float16).float()          # [groups, nsb, 16]
            dm = ks[:, :, 32:64].contiguous().view(torch.float16).float()
            sc = ks[:, :, 64:192].reshape(ks.shape[0], nb // 8, 8, 16).float()
            mn = ks[:, :, 192:320].reshape(ks.shape[0], nb // 8, 8, 16).float()
            d, m = ds[:, :, None, :] * sc, -(dm[:, :, None, :] * mn)           # exact products
            return tuple(t.reshape(-1, nb, 16).transpose(1, 2).reshape(-1, nb)[:rows] for t in (d, m))
        def per_row(t: torch.Tensor) -> torch.Tensor:
            return t.float().view(-1, nb, 16).transpose(1, 2).reshape(-1, nb)[:rows]
        if self.desc.qtype == 0 and not self.m.numel():     # Q4_0 without minima: -8 d, formed exactly
            return per_row(self.d), per_row(self.d) * -8.0
        return per_row(self.d), per_row(self.m) if self.m.numel() else None

    def extra_repr(self) -> str:
        path = "torch-fallback" if self.lib is None else ("avx512-vnni-int8" if self.desc.isa else "avx2-int8")
        if self.lib is not None and self.qtype in kquants.REQUANTIZED:
            path += ", requantized to Q8_0"
        if self.weight_bf16 is not None:
            path += f", bf16 for T>={self.backend.bf16_min_tokens}"
        elif self.backend.f32_min_tokens is not None and self.lib is not None:
            path += f", fp32 GEMM for T>={self.backend.f32_min_tokens}"
        return f"in={self.in_features}, out={self.out_features}, qtype={self.qtype.name}, {path}"


def linear_state(m: torch.nn.Module, in_features: int, out_features: int, bias: torch.Tensor | None,
                 backend: KernelBackend) -> None:
    """The attributes every quantized linear here starts with (GGUFQuantLinear, fused_linear's
    SegmentedQuantLinear): shapes, backend, and bias / fp32 weight as buffers, so that a model moved
    to another device (PyTorch path) takes them along; `desc` is what the C kernels read (None on
    the PyTorch path)."""
    m.in_features, m.out_features = in_features, out_features
    m.backend, m.lib = backend, backend.lib
    m.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).contiguous(),
                      persistent=False)
    m.register_buffer("weight_f32", None, persistent=False)
    m.weight_bf16 = None
    m.desc = None
