"""K-quant and Q5 rows as Q8_0 blocks: decoded exactly, then requantized (Q5_0: converted exactly).

Q6_K and Q5_K have their own layouts in the kernels now (kernel qtypes 3 and 4, at about the
file's bits, cpu/kvserve_kernels.cpp); what this module says of them below is the numpy
reference the C decoder is tested against (q8_0_rows). Q5_0 and Q5_1 always take this road.

llama.cpp's Q4_K_M files store the output head and, in about half the layers, attn_v and
ffn_down as Q6_K; Q5_K_M files use Q5_K and Q6_K. The kernels' two layouts (cpu/kvserve_kernels.cpp)
cannot hold either type as it is: Q6_K has 6-bit values under a scale per 16 values, Q5_K 5-bit
values under a scale and a minimum per 32, and the layouts have 4-bit values with a scale and a
minimum per 32 (Q4) or int8 values with a scale per 32 (Q8_0). So at load the rows are decoded
exactly (as llama.cpp's dequantize_row_q6_K / dequantize_row_q5_K, same float operations in the
same order) and requantized per 32 values to int8 with a float16 scale amax / 127, which the
Q8_0 repack then lays out. That is a second rounding: each value moves by at most half a step,
amax / 254 of its block (Q6_K's own step is about amax / 32), measured in tests/model/
test_kquants_q6k.py. The pack cache keeps the result, so a file pays the decoding once.

Q5_0 and Q5_1 (llama.cpp writes them into some K-quant mixes, e.g. attn_v of Q4_K_M files whose
width is not a multiple of 256) take the same road: a Q5_0 value is d * (q - 16), exactly a Q8_0
block with the same d (`q5_0_as_q8_0`, no second rounding); Q5_1's d * q + m has a minimum the
Q8_0 layout cannot hold, so its rows are decoded and requantized as Q6_K's are.

A fused projection whose parts have different types (Q4_K q/k beside a Q6_K v in a Q4_K_M file)
is not requantized: each part keeps its own layout (kernels/fused_linear.py, row segments).

    Q6_K  256 values, 210 bytes: ql[128] low 4 bits, qh[64] high 2 bits, scales int8[16] (one per
          16 values), d fp16.   x = d * sc * (q - 32), q in 0..63
    Q5_K  256 values, 176 bytes: d fp16, dmin fp16, scales[12] (6-bit scale and min of 8 blocks
          of 32, Q4_K's packing), qh[32] the 5th bits, qs[128] low nibbles.   x = d*sc*q - dmin*m
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

QK_K = 256
Q8_0_BYTES = 34
ROWS_PER_CHUNK_VALUES = 1 << 22     # decode this many values at a time (a 128k-row head is 1 GB in fp32)
# Laid out as Q8_0 rows at load (Q6_K and Q5_K have their own layouts, kernel qtypes 3 and 4).
REQUANTIZED = (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)   # [n, 1]


def dequantize_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q6_K blocks (any shape of uint8 whose size is a multiple of 210) -> float32 [n_blocks, 256]."""
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, 210)
    n = b.shape[0]
    ql, qh = b[:, :128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    low = np.concatenate([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32).reshape(n, 16, 16)
    scale = _f16(b, 208) * sc                                   # d * sc: exact in float32
    return (scale[:, :, None] * q).reshape(n, QK_K)


def dequantize_q5_k(raw: np.ndarray) -> np.ndarray:
    """Q5_K blocks (uint8, a multiple of 176 bytes) -> float32 [n_blocks, 256]."""
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, 176)
    n = b.shape[0]
    sc, mn = gguf_quants.Q4_K.get_scale_min(b[:, 4:16].copy())       # the 6-bit packing Q4_K shares
    d1 = _f16(b, 0) * sc.reshape(n, 8).astype(np.float32)
    m1 = _f16(b, 2) * mn.reshape(n, 8).astype(np.float32)
    qh, qs = b[:, 16:48], b[:, 48:176].reshape(n, 4, 32)
    q = np.empty((n, 8, 32), dtype=np.uint8)
    for j in range(4):      # 64 values: block 2j the low nibbles + bit 2j, block 2j+1 the high + bit 2j+1
        q[:, 2 * j] = (qs[:, j] & 0x0F) | (((qh >> (2 * j)) & 1) << 4)
        q[:, 2 * j + 1] = (qs[:, j] >> 4) | (((qh >> (2 * j + 1)) & 1) << 4)
    return (d1[:, :, None] * q.astype(np.float32) - m1[:, :, None]).reshape(n, QK_K)


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, cols: int) -> np.ndarray:
    """raw uint8 [rows, bytes_per_row] of any type this module or gguf-py decodes -> float32 [rows, cols]."""
    rows = raw.shape[0]
    if qtype == GGMLQuantizationType.Q6_K:
        return dequantize_q6_k(raw).reshape(rows, cols)
    if qtype == GGMLQuantizationType.Q5_K:
        return dequantize_q5_k(raw).reshape(rows, cols)
    return np.asarray(gguf_quants.dequantize(np.asarray(raw), qtype), dtype=np.float32).reshape(rows, cols)


def q5_0_as_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 rows (blocks of 22 bytes: fp16 d, 32 fifth bits, 16 bytes of nibbles; x = d * (q - 16))
    -> Q8_0 rows with the same d and the int8 values q - 16: exact, no second rounding."""
    rows = raw.shape[0]
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, 22)
    qh = b[:, 2:6].copy().view("<u4")                                   # [n, 1]
    bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n, 32]
    qs = b[:, 6:22]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1) | (bits << 4)
    out = np.empty((b.shape[0], Q8_0_BYTES), dtype=np.uint8)
    out[:, :2] = b[:, :2]
    out[:, 2:] = (q.astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> Q8_0 rows uint8 [rows, cols / 32 * 34]: per 32 values a float16
    scale d, amax / 127 rounded up to a float16 (so no value is clipped, even where d is a
    float16 subnormal), and int8 round(x / d): every value within d / 2 of the original. A scale
    past float16's range is clipped to its largest value (no real weight is that large)."""
    rows, cols = w.shape
    x = w.reshape(rows, cols // 32, 32)
    want = np.minimum(np.abs(x).max(axis=-1) / np.float32(127.0), np.float32(65504.0))
    d16 = want.astype(np.float16)
    low = d16.astype(np.float32) < want
    d16[low] = np.nextafter(d16[low], np.float16(np.inf))
    d = d16.astype(np.float32)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int8)
    out = np.empty((rows, cols // 32, Q8_0_BYTES), dtype=np.uint8)
    out[:, :, :2] = d16.view(np.uint8).reshape(rows, -1, 2)
    out[:, :, 2:] = q.view(np.uint8)
    return out.reshape(rows, -1)


NATIVE = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)


def q8_0_rows(raw: np.ndarray, qtype: GGMLQuantizationType, cols: int, lib=None, native: bool = True) -> np.ndarray:
    """Rows of any decodable type as Q8_0 rows (Q8_0 itself unchanged), a chunk of rows at a time.
    lib: the kernel library, whose kvs_q8_0_rows does the same for the K-quants in C, with the
    same bytes (cpu/kvserve_repack_kquant.cpp; ~50x faster); default: one already loaded.
    native=False: numpy only (the reference the C code is tested against)."""
    if qtype == GGMLQuantizationType.Q8_0:
        return np.asarray(raw, dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q5_0:
        return q5_0_as_q8_0(raw)
    rows = raw.shape[0]
    out = np.empty((rows, cols // 32 * Q8_0_BYTES), dtype=np.uint8)
    if lib is None and native:
        from kvserve.model.kernels import build

        lib = build.any_loaded()
    if lib is not None and qtype in NATIVE and rows:
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        if lib.kvs_q8_0_rows(int(qtype), raw.ctypes.data, rows, cols, out.ctypes.data) == 0:
            return out
    step = max(1, ROWS_PER_CHUNK_VALUES // cols)
    for r in range(0, rows, step):
        out[r:r + step] = quantize_q8_0(dequantize(raw[r:r + step], qtype, cols))
    return out
