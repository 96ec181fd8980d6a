"""Issue 52's A/B measurements on a loaded machine: CPU time per token, one thread, so two
checkouts (PYTHONPATH=<checkout>/src) can be compared in the same minutes.

    python scripts/bench_issue52_shapes.py model FILE.gguf     # prefill 128 + 16 greedy decodes
    python scripts/bench_issue52_shapes.py attention           # C decode attention, head_dim 64-128

FILE: a random-weight file of a real shape, e.g. `python -m kvserve.bench.gguf_random FILE.gguf
--shape qwen2-3b --type Q4_K_M` (shapes llama-1b, llama-3b, qwen2-3b; types Q4_0 Q4_1 Q4_K Q5_K Q6_K
Q8_0 and the Q4_K_M / Q5_K_M mixes).
"""

from __future__ import annotations

import sys
import time

import torch


def _best_cpu(f, n: int = 20) -> float:
    f()
    best = 1e9
    for _ in range(n):
        t0 = time.process_time()
        f()
        best = min(best, time.process_time() - t0)
    return best


def model(path: str, prompt: int = 128, decode: int = 16) -> str:
    from kvserve.model.attention import AttentionMetadata
    from kvserve.model.kv_quant import cache_shape
    from kvserve.model.loader import load_model

    m = load_model(path).model
    cfg, block = m.config, 16
    blocks = (prompt + decode) // block + 1
    table = list(range(blocks))
    kv = [torch.zeros(cache_shape(blocks, block, cfg.num_key_value_heads, cfg.head_dim, torch.float16),
                      dtype=torch.float16) for _ in range(cfg.num_hidden_layers)]
    ids = torch.randint(3, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        c0 = time.process_time()
        h = m(ids, torch.arange(prompt), AttentionMetadata.build([prompt], [prompt], [table], block), kv)
        tok = int(m.compute_logits(h[-1:]).argmax())
        c1, head = time.process_time(), 0.0
        for i in range(decode):
            meta = AttentionMetadata.build([1], [prompt + i + 1], [table], block)
            h = m(torch.tensor([tok]), torch.tensor([prompt + i]), meta, kv)
            ch = time.process_time()
            tok = int(m.compute_logits(h).argmax())
            head += time.process_time() - ch
        c2 = time.process_time()
    return (f"prefill {prompt}: {1e3 * (c1 - c0) / prompt:.2f} CPU ms/token | decode: "
            f"{1e3 * (c2 - c1) / decode:.1f} CPU ms/token, LM head {1e3 * head / decode:.1f}")


def attention(L: int = 4096, hq: int = 32, hkv: int = 8) -> str:
    from kvserve.model.kernels.backend import KernelBackend
    from kvserve.model.kernels.cpu_ops import paged_decode_attention

    b = KernelBackend.detect()
    out = [f"isa {b.isa}"]
    for d in (64, 72, 80, 96, 128):
        nb = L // 16
        kv = torch.randn(2, nb, 16, hkv, d).to(torch.float16)
        q = torch.randn(1, hq, d)
        tables = torch.arange(nb)[None]
        t = _best_cpu(lambda: paged_decode_attention(b.lib, q, kv, tables, [L], d ** -0.5))  # noqa: B023
        out.append(f"head_dim {d}: {t * 1e3:.2f} ms")
    return " | ".join(out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    import kvserve

    where = kvserve.__file__.split("/src/")[0]
    print(where, model(sys.argv[2]) if sys.argv[1] == "model" else attention())
