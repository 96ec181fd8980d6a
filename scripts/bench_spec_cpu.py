"""A/B CPU time per decoded token on the grounded workload (process_time; single stream, greedy)."""
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.spec_latency import GROUNDED_TASKS, PASSAGE
from kvserve.model.loader import load_model

torch.set_num_threads(2)
lm = load_model(None)
kw = {"tokenizer": lm.tokenizer, "kv_cache_memory": "256MiB"}
base = LLM(lm.model, **kw); spec = LLM(lm.model, speculative="ngram", **kw)
tok = lm.tokenizer
params = SamplingParams(temperature=0, max_tokens=150)
tot = {"base": [0, 0.0], "spec": [0, 0.0]}
for t in GROUNDED_TASKS[:3]:
    p = {"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": f"{t}\n\n{PASSAGE}"}], tokenize=True)}
    for name, llm in (("base", base), ("spec", spec)):
        llm.generate(p, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)   # prefill alone
        c0 = time.process_time()
        out = llm.generate(p, params, use_tqdm=False)[0]
        c1 = time.process_time()
        tot[name][0] += len(out.outputs[0].token_ids); tot[name][1] += c1 - c0
for k, (n, s) in tot.items():
    print(k, n, "tokens", round(s, 1), "cpu s", round(n / s, 1), "tok per cpu-s")
print("speedup (cpu)", round((tot["spec"][0] / tot["spec"][1]) / (tot["base"][0] / tot["base"][1]), 2))
