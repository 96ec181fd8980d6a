"""TTFT of a long shared system prompt served from the KV disk tier (issue 51), beside its cold prefill.

    python -m kvserve.bench.kv_offload_ttft [--shared 6000] [--kv-cache-dtype fp16] [--dir DIR]

One process, the default model, a KV pool just big enough for one long prompt: for each KV dtype,
(1) cold: the shared prompt + question 0 on an engine with the tier (writing every block);
(2) restart: a new engine on the same directory, the shared prompt + question 1 (from disk);
(3) evicted: a filler prompt as long evicts the shared blocks from RAM, then question 0 again
(from disk, its answer checked against (1)); (4) cold on an engine without the tier (RAM only),
question 1 (its answer checked against (2)). Each TTFT is one request's time to its first token
(max_tokens=1, greedy, the step-time target of `kvserve serve`).
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


def run(shared: int, dtype: str, root: str) -> None:
    """Prints one JSON line per measurement as it is made (a slow machine may be stopped early)."""
    lm = load_model(None)
    ids = lm.tokenizer.encode(load_corpus(max_chars=(2 * shared + 400) * 6))
    base, filler = ids[:shared], ids[shared:2 * shared]
    qs = [ids[2 * shared + 50 * i:2 * shared + 50 * i + 30] for i in range(2)]
    per_block = ModelRunner.bytes_per_block(lm.model, 16, EngineConfig(kv_cache_dtype=dtype).torch_kv_dtype)
    pool = (shared + 200) // 16 + 8
    kw = {"tokenizer": lm.tokenizer, "kv_cache_memory": pool * per_block, "kv_cache_dtype": dtype,
          "max_model_len": 8192, "max_step_ms": DEFAULT_MAX_STEP_MS}        # as `kvserve serve` runs
    d = tempfile.mkdtemp(dir=root)
    head = {"dtype": dtype, "shared_tokens": shared, "pool_blocks": pool}

    def say(**kv) -> None:
        print(json.dumps(head | kv), flush=True)

    llm = LLM(lm.model, **kw, kv_offload_dir=d)
    s, cold0, _ = _ttft(llm, base + qs[0])
    say(step="cold prefill, every block written to the tier", ttft_s=s)
    llm.engine.core.offload.store.close()
    again = LLM(lm.model, **kw, kv_offload_dir=d)                    # a restart on the same directory
    s, out, cached = _ttft(again, base + qs[1])
    say(step="restart: from disk", ttft_s=s, cached_tokens=cached, tier=again.engine.core.offload.stats())
    _ttft(again, filler)                                             # evicts the shared prompt's blocks
    again.engine.core.offload.store.flush()
    s, out2, cached = _ttft(again, base + qs[0])
    say(step="evicted: from disk", ttft_s=s, cached_tokens=cached, same_answer_as_cold=out2 == cold0)
    again.engine.core.offload.store.close()
    ram = LLM(lm.model, **kw, enable_prefix_caching=False)
    s, out3, _ = _ttft(ram, base + qs[1])
    say(step="cold prefill, RAM only", ttft_s=s, restart_answer_same=out3 == out)
    shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=int, default=6000)
    ap.add_argument("--kv-cache-dtype", action="append")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    for dtype in a.kv_cache_dtype or ["fp16", "int8"]:
        run(a.shared, dtype, a.dir)


if __name__ == "__main__":
    main()
