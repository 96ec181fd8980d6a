"""Settle torch's math libraries once, on one thread, before other threads compute.

torch sends several float functions (exp, log, tanh, erf, sqrt, tan, atan, ... on contiguous
tensors) to MKL's vector math, which picks its code path on first use; matmuls go to MKL's BLAS or
oneDNN, which do the same. A first use made by two threads at once (the model loading beside the
sentence encoder's warm-up) has been seen to run one thread's part of a result at reduced accuracy
for the whole process (BENCHMARKS.md, issue 53: the RoPE table's cos, now computed by numpy).
`init_math_libraries` makes that first use here, before `kvserve serve` starts its loading threads
and before any engine is built, so every later call takes the settled path whatever runs beside it.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_done = False


def init_math_libraries() -> None:
    """Idempotent and thread-safe; the first call costs a few milliseconds."""
    global _done
    with _lock:
        if _done:
            return
        import torch

        # above ATen's parallel grain (32768 elements), so the OpenMP workers make their first use too
        x = torch.linspace(-4.0, 4.0, 1 << 16)
        pos = x.abs() + 0.5
        for y in (x.exp(), x.expm1(), pos.log(), pos.log1p(), pos.log2(), pos.log10(), x.tanh(), x.erf(),
                  x.erfc(), pos.sqrt(), x.tan(), x.atan(), x.sin(), x.cos(), x.sigmoid(), x.softmax(0)):
            float(y[0])
        a = x[:4096].view(64, 64)
        float((a @ a)[0, 0])                                    # BLAS / oneDNN, float32
        float((a.bfloat16() @ a.bfloat16())[0, 0])
        _done = True
