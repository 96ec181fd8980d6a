"""The same greedy tokens and logprobs whatever thread count the engine runs with (issue 53), and
whenever that count changes (issue 61).

A Ray replica runs its engine on one thread, `kvserve serve` on every core: the kernels' work split
and every reduction's order must not follow the thread count, or a request's answer would depend on
which process served it. On a busy machine the kernels also change their team between steps
(cpu/kvserve_team.cpp: one thread fewer while another process holds a core, probing back now and
then, and a late thread leaving a long step's team between two of its phases), so a request's steps
run on different counts: its answer must not notice. Each case runs in
its own process (torch's count is process-wide), on a short prompt, a long one that prefills in
several chunks, and a code prompt."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys, threading, time
from kvserve import LLM, SamplingParams
threads, mode = int(sys.argv[1]), sys.argv[2]
llm = LLM(num_threads=threads, kv_cache_memory="128MiB")
backend = llm.engine.core._backend
done = threading.Event()
if mode == "switching":      # the team forced to 1 and back to all, every ~millisecond, mid-step too;
    def flip():              # and every third period a forward's late thread leaves its team mid-step
        n = 0
        while not done.is_set():
            backend.lib.kvs_team_force(n % 2)
            backend.lib.kvs_team_shed_at(5 + n % 40 if n % 3 == 0 else 0)
            n += 1
            time.sleep(0.001)
    threading.Thread(target=flip, daemon=True).start()
busy = None
if mode == "busy":           # a real neighbour spinning beside the engine: the team follows the machine
    from kvserve.bench.busy import BusyCores
    busy = BusyCores(1).__enter__()
prompts = ["Write one sentence about the ocean.", "The history of Rome " * 60, "def fib(n):"]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, logprobs=2))
done.set()
if busy is not None:
    busy.__exit__(None, None, None)
import ctypes
stats = (ctypes.c_double * 9)()
backend.lib.kvs_team_stats(stats)
print(json.dumps({"sheds": stats[8], "answers": [[o.outputs[0].token_ids,
                  [sorted((k, v.logprob) for k, v in d.items()) for d in o.outputs[0].logprobs]] for o in outs]}))
"""


def _run(threads: int, mode: str = "fixed") -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(threads), mode], capture_output=True, text=True,
                         timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _answers(threads: int, mode: str = "fixed") -> list:
    return _run(threads, mode)["answers"]


def _same(a: list, b: list, what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert x[0] == y[0], f"prompt {i}: tokens differ between {what}"
        assert x[1] == y[1], f"prompt {i}: logprobs differ between {what}"


def test_one_and_two_threads_give_the_same_bits():
    _same(_answers(1), _answers(2), "1 and 2 threads")


def test_a_team_that_changes_between_and_within_steps_gives_the_same_bits():
    """The team flipped between 1 thread and all of them every millisecond while the engine runs
    (between steps and inside one: a forward, then the LM head on another count), then a run
    beside a spinning process: the same bits as a fixed team of 2."""
    fixed = _answers(2)
    switching = _run(2, "switching")
    assert switching["sheds"] > 0, "no thread left a step's team mid-step: the test did not exercise it"
    _same(fixed, switching["answers"], "a fixed team of 2 and a switching team")
    _same(fixed, _answers(2, "busy"), "a quiet machine and one with a busy core")
