"""`kvserve bench kernels`: each Linear variant alone on the default model's weight shapes (kvserve's
int8 kernels, the automatic choice, torch fp32 and bf16), microseconds per call."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

Progress = Callable[[int], None]

# ---- kernels alone --------------------------------------------------------------------------
# The default model's projection shapes (out, in) and formats; qkv and gate/up are fused.
MODEL_SHAPES = [(960, 576, "Q4_1"), (576, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1"),
                (49152, 576, "Q8_0")]


def _time_call(fn: Callable[[], object], budget_s: float = 0.25) -> float:
    """Median seconds per call over a time budget (at least 3 calls)."""
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 500):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.to(torch.bfloat16), w).float()


def kernel_latency(tokens: list[int], shapes=None, threads: int = 2,
                   progress: Progress | None = None) -> list[dict]:
    """Microseconds per call of each Linear variant on random weights of the model's shapes."""
    from dataclasses import replace

    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from kvserve.model.kernels import reference
    from kvserve.model.kernels.backend import KernelBackend
    from kvserve.model.kernels.gguf_linear import GGUFQuantLinear

    torch.set_num_threads(threads)
    backend = KernelBackend.detect()
    int8_only = replace(backend, bf16_min_tokens=None, f32_min_tokens=None)
    rows = []
    rng = np.random.default_rng(0)
    for out_f, in_f, qname in shapes or MODEL_SHAPES:
        qtype = GGMLQuantizationType[qname]
        raw = quantize(rng.standard_normal((out_f, in_f)).astype(np.float32), qtype)
        layer = GGUFQuantLinear(raw, qtype, in_f, out_f, backend=backend)
        int8 = GGUFQuantLinear(raw, qtype, in_f, out_f, backend=int8_only) if backend.lib is not None else None
        w32 = reference.dequantize(raw, qtype, in_f)
        w16 = w32.to(torch.bfloat16)
        for T in tokens:
            x = torch.randn(T, in_f)
            row = {"shape": f"{out_f}x{in_f}", "qtype": qname, "T": T}
            if int8 is not None:
                row["int8_us"] = _time_call(partial(int8, x)) * 1e6
            row["auto_us"] = _time_call(partial(layer, x)) * 1e6
            row["fp32_us"] = _time_call(partial(torch.nn.functional.linear, x, w32)) * 1e6
            row["bf16_us"] = _time_call(partial(_bf16_linear, x, w16)) * 1e6
            row["weight_mb"] = raw.nbytes / 1e6
            rows.append(row)
            if progress:
                progress(1)
    return rows


def kernel_table(rows: list[dict]) -> str:
    lines = [("| weight (out x in) | format | T | kvserve int8 µs | kvserve auto µs | torch fp32 µs | "
              "torch bf16 µs | auto vs fp32 | int8 GB/s of packed weights |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        i8 = r.get("int8_us")
        gbs = "-" if i8 is None else f"{r['weight_mb'] * 1e3 / i8:.1f}"
        lines.append(
            f"| {r['shape']} | {r['qtype']} | {r['T']} | {'-' if i8 is None else f'{i8:.0f}'} | "
            f"{r['auto_us']:.0f} | {r['fp32_us']:.0f} | {r['bf16_us']:.0f} | {r['fp32_us'] / r['auto_us']:.2f}x | "
            f"{gbs} |")
    return "\n".join(lines)
