"""TTFT of a long shared system prompt served from the KV disk tier (issue 51), beside its cold prefill.

    python -m kvserve.bench.kv_offload_ttft [--shared 6000] [--kv-cache-dtype fp16] [--dir DIR]

One process, the default model, a KV pool just big enough for one long prompt: for each KV dtype,
(1) cold: the shared prompt + question 1 on an engine without the disk tier (RAM only), and on one
with it (what writing every block costs when cold); (2) evicted: a filler prompt as long evicts the
shared blocks from RAM, then the shared prompt + question 2 (from disk); (3) restart: a new engine
on the same directory, question 2 again (its own last blocks were written too: one or two more). Each TTFT is one request's time to its first token (max_tokens=1,
greedy, the step-time target of `kvserve serve`), and the answers of (2) and (3) are checked against cold runs of the same prompts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

from kvserve import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.step_cost import DEFAULT_MAX_STEP_MS
from kvserve.model.loader import load_model
from kvserve.train.data import load_corpus


def _ttft(llm: LLM, prompt: list[int], max_tokens: int = 1) -> tuple[float, list[int], int]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return time.perf_counter() - t, out.outputs[0].token_ids, out.num_cached_tokens


def run(shared: int, dtype: str, root: str) -> dict:
    lm = load_model(None)
    ids = lm.tokenizer.encode(load_corpus(max_chars=(2 * shared + 400) * 6))
    base, filler = ids[:shared], ids[shared:2 * shared]
    qs = [ids[2 * shared + 50 * i:2 * shared + 50 * i + 30] for i in range(2)]
    per_block = ModelRunner.bytes_per_block(lm.model, 16, EngineConfig(kv_cache_dtype=dtype).torch_kv_dtype)
    pool = (shared + 200) // 16 + 8
    kw = {"tokenizer": lm.tokenizer, "kv_cache_memory": pool * per_block, "kv_cache_dtype": dtype,
          "max_model_len": 8192, "max_step_ms": DEFAULT_MAX_STEP_MS}        # as `kvserve serve` runs
    d = tempfile.mkdtemp(dir=root)
    res: dict = {"dtype": dtype, "shared_tokens": shared, "pool_blocks": pool}
    ram = LLM(lm.model, **kw, enable_prefix_caching=False)
    res["cold_ram_only_s"], cold2, _ = _ttft(ram, base + qs[1])
    del ram
    llm = LLM(lm.model, **kw, kv_offload_dir=d)
    res["cold_with_tier_s"], _, _ = _ttft(llm, base + qs[0])
    _ttft(llm, filler)                                       # evicts the shared prompt's blocks
    llm.engine.core.offload.store.flush()
    res["evicted_s"], out2, res["evicted_cached_tokens"] = _ttft(llm, base + qs[1])
    res["evicted_same_answer"] = out2 == cold2
    res["tier"] = llm.engine.core.offload.stats()
    llm.engine.core.offload.store.close()
    del llm
    again = LLM(lm.model, **kw, kv_offload_dir=d)
    res["restart_s"], out3, res["restart_cached_tokens"] = _ttft(again, base + qs[1])
    res["restart_same_answer"] = out3 == cold2
    res["evicted_vs_cold"] = res["evicted_s"] / res["cold_ram_only_s"]
    res["restart_vs_cold"] = res["restart_s"] / res["cold_ram_only_s"]
    again.engine.core.offload.store.close()
    shutil.rmtree(d, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=int, default=6000)
    ap.add_argument("--kv-cache-dtype", action="append")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    for dtype in a.kv_cache_dtype or ["fp16", "int8"]:
        print(json.dumps(run(a.shared, dtype, a.dir)), flush=True)


if __name__ == "__main__":
    main()
