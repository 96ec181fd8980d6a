"""CPU time of one prompt's prefill, one thread: an A/B of two trees that stays fair on a busy machine.

    OMP_NUM_THREADS=1 PYTHONPATH=TREE/src python scripts/prefill_cpu_time.py 8000 LABEL

Loads the default model with `LLM`, warms up, then times `generate` with `max_tokens=1` over a
random prompt of N tokens (the same tokens for the same N) by `time.process_time`, and prints the
prompt tokens per CPU-second. Run it for each tree in turn (or side by side: CPU time barely
depends on what else runs).
"""

import random
import sys
import time

import torch

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

torch.set_num_threads(1)
n = int(sys.argv[1])
label = sys.argv[2] if len(sys.argv) > 2 else ""
llm = LLM(None)
llm.generate([[100 + i for i in range(16)]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
rng = random.Random(n)
prompt = [rng.randrange(100, 40000) for _ in range(n)]
t0, w0 = time.process_time(), time.perf_counter()
llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
cpu, wall = time.process_time() - t0, time.perf_counter() - w0
print(f"{label} n={n} cpu {cpu:.2f}s -> {n / cpu:.1f} tok/s per CPU-second (wall {wall:.1f}s)", flush=True)
