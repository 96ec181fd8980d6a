"""A/B CPU time per decoded token on open chat prompts with a draft model (process_time; single
stream, greedy, 1 thread so a busy machine's spinning threads do not count).

    PYTHONPATH=src python scripts/bench_spec_draft_cpu.py DRAFT_DIR [K] [TOKENS] [PROMPTS] [nogate]
"""
import sys
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.spec_latency import OPEN_PROMPTS
from kvserve.model.loader import load_model

draft = sys.argv[1]
k = int(sys.argv[2]) if len(sys.argv) > 2 else 3
n_tok = int(sys.argv[3]) if len(sys.argv) > 3 else 64
n_prompts = int(sys.argv[4]) if len(sys.argv) > 4 else len(OPEN_PROMPTS)
torch.set_num_threads(1)
lm = load_model(None)
kw = {"tokenizer": lm.tokenizer, "kv_cache_memory": "256MiB"}
base = LLM(lm.model, **kw)
gate = len(sys.argv) <= 5 or sys.argv[5] != "nogate"    # "nogate": no cost switch (acceptance)
spec = LLM(lm.model, speculative={"method": "draft", "draft_path": draft, **({} if gate else {"max_batch_rows": 0})},
           num_speculative_tokens=k, **kw)
tok = lm.tokenizer
params = SamplingParams(temperature=0, max_tokens=n_tok)
tot = {"base": [0, 0.0], "spec": [0, 0.0]}
same = True
for t in OPEN_PROMPTS[:n_prompts]:
    p = {"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True)}
    ids = {}
    for name, llm in (("base", base), ("spec", spec)):
        llm.generate(p, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)   # prefill alone
        c0 = time.process_time()
        out = llm.generate(p, params, use_tqdm=False)[0]
        c1 = time.process_time()
        ids[name] = out.outputs[0].token_ids
        tot[name][0] += len(ids[name])
        tot[name][1] += c1 - c0
    same &= ids["base"] == ids["spec"]
for name, (n, s) in tot.items():
    print(name, n, "tokens", round(s, 1), "cpu s", round(n / s, 1), "tok per cpu-s")
st = spec.stats()
print("acceptance", round(st["spec_decode_num_accepted_tokens"] / max(1, st["spec_decode_num_draft_tokens"]), 3),
      "drafts", st["spec_decode_num_draft_tokens"], "same tokens", same)
print("speedup (cpu)", round((tot["spec"][0] / tot["spec"][1]) / (tot["base"][0] / tot["base"][1]), 2))
