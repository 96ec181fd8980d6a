"""GGUF block quantizers in numpy: rows of fp32 weights -> packed GGUF rows, and back.

gguf-py quantizes Q8_0, Q4_0, Q4_1 and Q5_0 itself (`gguf.quants.quantize`, the reference
rounding of llama.cpp); it has no quantizer for the K-quants, so Q4_K and Q6_K are written here,
bit-compatible with `gguf.quants.dequantize` (and so with llama.cpp):

    Q4_K  super-blocks of 256 = 8 sub-blocks of 32; x = d*sc[j]*q - dmin*m[j], q in 0..15,
          sc/m 6-bit, packed into 12 bytes; d, dmin fp16.                 144 bytes / 256
    Q6_K  16 sub-blocks of 16; x = d*sc[j]*(q - 32), q in 0..63 (4 low bits in ql, 2 high
          bits in qh), sc int8; d fp16.                                   210 bytes / 256

A K-quant needs rows that are a multiple of 256 wide; for other widths we fall back as
llama.cpp's quantizer does (Q4_K -> Q5_0, Q6_K -> Q8_0), and report the type actually used.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
TYPES = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def ggml_type(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name.upper()]


def storage_type(type_name: str, cols: int) -> str:
    """The GGUF type a [rows, cols] matrix gets when `type_name` is asked for."""
    t = type_name.upper()
    if t in FALLBACK and cols % QK_K:
        return FALLBACK[t]
    return t


def quantize_rows(w: np.ndarray, type_name: str) -> tuple[np.ndarray, str]:
    """fp32 [rows, cols] -> (uint8 [rows, bytes_per_row], the GGUF type name used)."""
    import gguf.quants

    w = np.ascontiguousarray(w, dtype=np.float32)
    t = storage_type(type_name, w.shape[1])
    if t == "Q4_K":
        return _q4_k(w.reshape(-1, QK_K)).reshape(w.shape[0], -1), t
    if t == "Q6_K":
        return _q6_k(w.reshape(-1, QK_K)).reshape(w.shape[0], -1), t
    return gguf.quants.quantize(w, ggml_type(t)), t


def dequantize_rows(raw: np.ndarray, type_name: str) -> np.ndarray:
    import gguf.quants

    return np.asarray(gguf.quants.dequantize(raw, ggml_type(type_name)), dtype=np.float32)


def fake_quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """The fp32 weights a reader of the quantized rows sees (quantize, then dequantize)."""
    raw, t = quantize_rows(w, type_name)
    return dequantize_rows(raw, t).reshape(w.shape)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b)).astype(np.float32)


def _f16_at_least(x: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """fp16(x), one fp16 step up where rounding went below x (so x / d never exceeds `limit`)."""
    d = _f16(x)
    low = d.astype(np.float32) < x
    d[low] = np.nextafter(d[low], np.float16(np.inf))
    return d


def _q4_k(x: np.ndarray) -> np.ndarray:
    # Scales and offsets are rounded *up* to their 6-bit grids, so every sub-block's range stays
    # covered (no clipping): the error is at most half a step of the effective scale.
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    mins = -np.minimum(sub.min(axis=-1), 0.0)                      # offsets are subtracted: x >= -min
    dmin = _f16_at_least(mins.max(axis=-1) / 63.0, 63)
    m = np.clip(np.ceil(_safe_div(mins, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    eff_m = dmin.astype(np.float32)[:, None] * m.astype(np.float32)
    scale = (sub.max(axis=-1) + eff_m) / 15.0                      # [n, 8]: 15 steps cover [-eff_m, max]
    d = _f16_at_least(scale.max(axis=-1) / 63.0, 63)
    sc = np.clip(np.ceil(_safe_div(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    eff_d = d.astype(np.float32)[:, None] * sc.astype(np.float32)            # what the reader multiplies
    q = np.clip(np.rint(_safe_div(sub + eff_m[..., None], eff_d[..., None])), 0, 15).astype(np.uint8)
    scales = np.empty((n, 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    q = q.reshape(n, 4, 2, 32)                                    # chunk c: sub-blocks 2c (low), 2c+1 (high)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    idx = np.abs(sub).argmax(axis=-1)
    vmax = np.take_along_axis(sub, idx[..., None], axis=-1)[..., 0]      # signed value of largest magnitude
    # vmax maps to q - 32 = -32; the other sign has only 31 steps, so the scale also covers its largest
    opposite = np.max(np.where(np.sign(sub) == -np.sign(vmax)[..., None], np.abs(sub), 0.0), axis=-1)
    scale = -np.sign(vmax) * np.maximum(np.abs(vmax) / 32.0, opposite / 31.0)
    d = _f16_at_least(np.abs(scale).max(axis=-1) / 127.0, 127)
    mag = np.clip(np.ceil(_safe_div(np.abs(scale), d.astype(np.float32)[:, None])), 0, 127)   # up: no clipping
    sc = (np.sign(scale) * mag).astype(np.int8)
    eff = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    q = (np.clip(np.rint(_safe_div(sub, eff[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(n, 128)
    h = high.reshape(n, 2, 4, 32)
    qh = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
