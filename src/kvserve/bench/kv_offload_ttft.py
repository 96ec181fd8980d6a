"""TTFT of a long shared system prompt served from the KV disk tier (issue 51), beside its cold prefill.

    python -m kvserve.bench.kv_offload_ttft [--shared 6000] [--kv-cache-dtype fp16 ...] [--dir DIR]

One process, the default model, `max_step_ms` as `kvserve serve` runs, a KV pool just big enough for
one long prompt. For each KV dtype (fp16 and int8 unless named), in this order:

1. cold: the shared prompt + question 0 on an engine with the tier (writing every block);
2. restart: a new engine on the same directory, the shared prompt + question 1 (from disk);
3. evicted: a filler prompt as long evicts the shared blocks from RAM, then question 0 again (from
   disk; its answer must be (1)'s);
4. cold, RAM only: an engine without the tier and without prefix caching, question 1 (its answer
   must be (2)'s).

Each engine first serves a short unrelated prompt (its first step's one-time costs are not a
prefill's). TTFT is the time from a request's arrival to its first token; each answer is
`--answer-tokens` greedy tokens. A ratio compares a disk-tier TTFT with the faster of the two cold
prefills of the same dtype in the same run; `ok` when it is at most `--target` and the answers are
the cold ones token for token. One JSON line per measurement, then one summary line per dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from kvserve import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.step_cost import DEFAULT_MAX_STEP_MS
from kvserve.model.loader import load_model
from kvserve.train.data import load_corpus


def serve(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT in seconds, the greedy answer, cached prompt tokens) of one request alone."""
    eng = llm.engine
    rid = f"b{eng.core.num_steps}-{time.monotonic_ns()}"
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    eng.add_request(rid, {"prompt_token_ids": prompt}, sp)
    ttft, final = None, None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id != rid:
                continue
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t
            if out.finished:
                final = out
    assert final is not None and ttft is not None
    return ttft, list(final.outputs[0].token_ids), final.num_cached_tokens


def run(shared: int, dtype: str, root: str, answer_tokens: int, target: float) -> dict:
    """Prints one JSON line per measurement as it is made (a slow machine may be stopped early)."""
    lm = load_model(None)
    ids = lm.tokenizer.encode(load_corpus(max_chars=(2 * shared + 400) * 6))
    base, filler = ids[:shared], ids[shared:2 * shared]
    qs = [ids[2 * shared + 50 * i:2 * shared + 50 * i + 30] for i in range(3)]
    per_block = ModelRunner.bytes_per_block(lm.model, 16, EngineConfig(kv_cache_dtype=dtype).torch_kv_dtype)
    pool = (shared + 200) // 16 + 8
    kw = {"tokenizer": lm.tokenizer, "kv_cache_memory": pool * per_block, "kv_cache_dtype": dtype,
          "max_model_len": 8192, "max_step_ms": DEFAULT_MAX_STEP_MS}        # as `kvserve serve` runs
    d = tempfile.mkdtemp(dir=root)
    head = {"dtype": dtype, "shared_tokens": shared, "pool_blocks": pool, "load": os.getloadavg()[0]}

    def engine(**more) -> LLM:
        llm = LLM(lm.model, **kw, **more)
        serve(llm, qs[2], 1)                                        # warm: not a prefill's cost
        return llm

    def say(**kv) -> None:
        head["load"] = round(os.getloadavg()[0], 1)
        print(json.dumps(head | kv), flush=True)

    llm = engine(kv_offload_dir=d)
    cold_tier, cold0, _ = serve(llm, base + qs[0], answer_tokens)
    say(step="cold prefill, every block written to the tier", ttft_s=round(cold_tier, 3))
    llm.engine.core.offload.store.close()
    again = engine(kv_offload_dir=d)                                # a restart on the same directory
    restart, out1, cached_r = serve(again, base + qs[1], answer_tokens)
    say(step="restart: from disk", ttft_s=round(restart, 3), cached_tokens=cached_r,
        tier=again.engine.core.offload.stats())
    serve(again, filler, 1)                                         # evicts the shared prompt's blocks
    again.engine.core.offload.store.flush()
    evicted, out0, cached_e = serve(again, base + qs[0], answer_tokens)
    say(step="evicted: from disk", ttft_s=round(evicted, 3), cached_tokens=cached_e)
    again.engine.core.offload.store.close()
    ram = engine(enable_prefix_caching=False)
    cold_ram, ram1, _ = serve(ram, base + qs[1], answer_tokens)
    say(step="cold prefill, RAM only", ttft_s=round(cold_ram, 3))
    shutil.rmtree(d, ignore_errors=True)
    cold = min(cold_tier, cold_ram)
    summary = {"restart_ratio": round(restart / cold, 4), "evicted_ratio": round(evicted / cold, 4),
               "restart_same_answer": out1 == ram1, "evicted_same_answer": out0 == cold0,
               "restart_cached": cached_r, "evicted_cached": cached_e}
    summary["ok"] = (max(summary["restart_ratio"], summary["evicted_ratio"]) <= target
                     and summary["restart_same_answer"] and summary["evicted_same_answer"]
                     and min(cached_r, cached_e) >= shared // 16 * 16)
    say(step="summary", cold_s=round(cold, 3), **summary)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=int, default=6000)
    ap.add_argument("--kv-cache-dtype", action="append")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--target", type=float, default=0.15, help="most TTFT from disk / cold prefill")
    a = ap.parse_args()
    results = [run(a.shared, dtype, a.dir, a.answer_tokens, a.target) for dtype in a.kv_cache_dtype or ["fp16", "int8"]]
    raise SystemExit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
