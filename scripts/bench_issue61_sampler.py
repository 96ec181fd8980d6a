"""Issue 61: the engine alone, 32 greedy ignore_eos streams (16-token prompts, 48 tokens), one thread: CPU time
of a generate() with the sampler as it is and as it was before the NumPy argmax and the ban-only greedy path,
alternated in one process, and the tokens of both compared.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/bench_issue61_sampler.py
"""
import time

import torch

import kvserve.engine.sampler as S
from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

torch.set_num_threads(1)
llm = LLM()
new_greedy, new_only = S.greedy_ids, S.Sampler._only_bans
def old_greedy(x): return x.max(dim=-1).indices
def set_old(old):
    S.greedy_ids = old_greedy if old else new_greedy
    S.Sampler._only_bans = (lambda self, r: not self._needs_processing(r)) if old else new_only
prompts = [[100 + i + j for j in range(16)] for i in range(32)]
sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=48)
llm.generate(prompts, sp, use_tqdm=False)
res = {True: [], False: []}
toks = {}
for rep in range(3):
    for old in (False, True):
        set_old(old)
        c = time.process_time(); w = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        cpu = time.process_time() - c
        toks[old] = [o.outputs[0].token_ids for o in out]
        res[old].append(cpu)
        print(f"{'old' if old else 'new'} cpu {cpu:.2f}s wall {time.perf_counter()-w:.2f}s", flush=True)
print("same tokens:", toks[True] == toks[False])
for old in (False, True):
    print("old" if old else "new", "best cpu s", min(res[old]), "ms per step (48 steps)", min(res[old]) / 48 * 1e3)
