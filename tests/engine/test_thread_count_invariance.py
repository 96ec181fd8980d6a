"""The same greedy tokens and logprobs whatever thread count the engine runs with (issue 53).

A Ray replica runs its engine on one thread, `kvserve serve` on every core: the kernels' work split
and every reduction's order must not follow the thread count, or a request's answer would depend on
which process served it. Each count runs in its own process (torch's count is process-wide), on a
short prompt, a long one that prefills in several chunks, and a code prompt."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
from kvserve import LLM, SamplingParams
llm = LLM(num_threads=int(sys.argv[1]), kv_cache_memory="128MiB")
prompts = ["Write one sentence about the ocean.", "The history of Rome " * 60, "def fib(n):"]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=2))
print(json.dumps([[o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in d.items())
                                              for d in o.outputs[0].logprobs]] for o in outs]))
"""


def _answers(threads: int) -> list:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(threads)], capture_output=True, text=True,
                         timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_one_and_two_threads_give_the_same_bits():
    one, two = _answers(1), _answers(2)
    for i, (a, b) in enumerate(zip(one, two)):
        assert a[0] == b[0], f"prompt {i}: tokens differ between 1 and 2 threads"
        assert a[1] == b[1], f"prompt {i}: logprobs differ between 1 and 2 threads"
