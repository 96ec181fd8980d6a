"""Issue 61: the kernels' adaptive team against a fixed one, quiet and beside a spinning process,
interleaved in one process (best of REPS=2 runs each).

    PYTHONPATH=src python scripts/bench_issue61_team.py [PROMPT_TOKENS [DECODE_TOKENS [MODEL]]]
"""
import ctypes
import os
import sys

import torch

from kvserve.bench.busy import BusyCores
from kvserve.bench.latency import KvserveRunner, LatencyConfig, prompt_ids

torch.set_num_threads(2)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 128
M = int(sys.argv[2]) if len(sys.argv) > 2 else 64
model = sys.argv[3] if len(sys.argv) > 3 else None
r = KvserveRunner(LatencyConfig(model=model, prompt_tokens=N, decode_tokens=M))
lib = r.model.backend.lib
st = (ctypes.c_double*9)()   # kvs_team_stats writes 9 (cpu/kvserve_team.cpp)
ids = prompt_ids(r.vocab_size, N, 0)
res = {}
for rep in range(int(os.environ.get("REPS", "2"))):
    for adaptive in (1, 0):
        for busy in (0, 1):
            lib.kvs_set_adaptive_threads(adaptive)
            with BusyCores(busy):
                p, d = r.run(ids, M)
            lib.kvs_team_stats(st)
            k = (adaptive, busy)
            res.setdefault(k, []).append((N/p, M/d))
            print(f"adaptive={adaptive} busy={busy} prefill {N/p:7.1f} decode {M/d:6.1f} stats {[round(x,2) for x in st]} load {os.getloadavg()[0]:.2f}", flush=True)
for k, v in res.items():
    print(k, f"best prefill {max(a for a, _ in v):.1f} decode {max(b for _, b in v):.1f}")
