"""CPU time per decoded token, MoE vs dense (the models of scripts/make_tiny_moe_bench.py), for a
machine too loaded for `kvserve bench latency`'s wall-clock numbers: one thread, both models in
this process, interleaved rounds; a token's cost is the CPU time of generating 1 + N tokens less
that of 1 token after the same 128-token prompt, over N.

    python scripts/bench_moe_cpu.py OUT_DIR [--rounds 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def cpu_per_token(llm, n: int) -> float:
    from kvserve import SamplingParams

    prompt = {"prompt_token_ids": list(range(10, 138))}

    def run(k: int) -> float:
        t = time.process_time()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True), use_tqdm=False)
        return time.process_time() - t

    return (run(1 + n) - run(1)) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from kvserve import LLM

    llms = {m: LLM(os.path.join(a.dir, f"{m}.gguf"), kv_cache_memory="64MiB", enable_prefix_caching=False,
                   num_threads=1) for m in ("moe", "dense")}
    for llm in llms.values():
        cpu_per_token(llm, 8)   # warm up
    ratios = []
    for r in range(a.rounds):
        ms = {m: cpu_per_token(llm, a.tokens) * 1e3 for m, llm in llms.items()}
        ratios.append(ms["moe"] / ms["dense"])
        print(f"round {r + 1}: MoE {ms['moe']:.2f} ms/token, dense {ms['dense']:.2f} ms/token (CPU), "
              f"MoE / dense {ratios[-1]:.2f}x, load {os.getloadavg()[0]:.1f}", flush=True)
    ratios.sort()
    print(f"median MoE / dense {ratios[len(ratios) // 2]:.2f}x")


if __name__ == "__main__":
    main()
