"""`kvserve bench serve --scenario repeat`: speculative decoding on a workload that repeats itself
across requests (issue 63), single stream, greedy, through the whole engine in this process.

Two workloads, each a sequence of chat requests sent one at a time:

  repeat   an agent-like loop: a few task templates with changing arguments, each asking for the same
           kind of JSON plan, and the same few questions asked by many users;
  open     open chat prompts, none alike (what speculation must not slow down).

Four engines on one loaded model (speculation off, `ngram`, `suffix`, `ngram+suffix`), each request
sent to all four in turn (the order rotates per request) so a busy machine's load falls on all of them
alike. Each engine keeps its own history (the suffix tries fill from its own answers, which are the
same). Reported per workload and engine: output tokens, decode tokens/s (output tokens after the
first over the time from the first to the last), its ratio to speculation off, draft acceptance,
and whether every answer is token for token the one without speculation. The load average at start
and end goes beside the numbers.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

VARIANTS = ("off", "ngram", "suffix", "ngram+suffix")

_TASKS = [
    ("Plan the steps to {} for {}. Answer only with JSON: "
     '{{"goal": ..., "steps": [{{"tool": ..., "args": ...}}], "done_when": ...}}.'),
    ("You are an agent with tools search, read_file, write_file. Make a JSON plan to {} in the repository of "
     "{}. Reply with a JSON object with keys goal, steps (tool, args), risks."),
    "Produce a JSON list of the next three actions to {} for customer {}, each with fields action and reason.",
]
_ARGS = [("fix the failing login test", "Alice"), ("add a dark mode setting", "Bob"),
         ("update the README install section", "Chen"), ("rename the config file", "Dana"),
         ("speed up the search page", "Emil"), ("remove an unused dependency", "Fatima")]
_FAQ = ["How do I reset my password?", "What are your opening hours?", "How can I cancel my subscription?"]
_OPEN = ["Write a short poem about the sea at night.", "Why is the sky blue? Explain simply.",
         "Give me three ideas for a birthday party for a ten-year-old.", "What is the capital of Australia and why?",
         "Describe how a bicycle works.", "Tell me a fun fact about octopuses.",
         "How should I start learning to play the guitar?", "What makes a good cup of coffee?"]


def repeat_prompts(n: int) -> list[str]:
    """n requests of the repeat workload: templates with changing arguments, and FAQs from many users."""
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append(f"I am user {1000 + 37 * i}. {_FAQ[(i // 3) % len(_FAQ)]}")
        else:
            task, args = _TASKS[i % len(_TASKS)], _ARGS[(i * 5) % len(_ARGS)]
            out.append(task.format(*args))
    return out


@dataclass
class RepeatRow:
    workload: str
    engine: str
    output_tokens: int
    decode_s: float
    acceptance: float | None
    identical: bool

    @property
    def decode_tps(self) -> float:
        return self.output_tokens / self.decode_s if self.decode_s > 0 else 0.0


def run_repeat(model: str | None, num_prompts: int, output_len: int, threads: int, k: int = 8,
               on_progress=None) -> tuple[list[RepeatRow], tuple[float, float]]:
    import torch

    from kvserve import LLM, SamplingParams
    from kvserve.model.loader import load_model

    torch.set_num_threads(threads)
    loaded = load_model(model)
    tok = loaded.tokenizer
    kw = {"tokenizer": tok, "kv_cache_memory": "256MiB", "enable_prefix_caching": False}
    params = SamplingParams(temperature=0, max_tokens=output_len)
    load0 = os.getloadavg()[0]
    rows = []
    for name, texts in (("repeat", repeat_prompts(num_prompts)), ("open", _OPEN[:max(1, min(num_prompts, len(_OPEN)))])):
        llms = {v: LLM(loaded.model, **kw) if v == "off" else
                LLM(loaded.model, speculative=v, num_speculative_tokens=k, **kw) for v in VARIANTS}
        tot = {v: [0, 0.0] for v in VARIANTS}
        same = dict.fromkeys(VARIANTS, True)
        for i, text in enumerate(texts):
            ids = {"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)}
            order = VARIANTS[i % 4:] + VARIANTS[:i % 4]
            got = {}
            for v in order:
                out = llms[v].generate(ids, params, use_tqdm=False)[0]
                m = out.metrics
                got[v] = out.outputs[0].token_ids
                tot[v][0] += len(got[v]) - 1
                tot[v][1] += (m.last_token_time or 0) - (m.first_token_time or 0)
            for v in VARIANTS:
                same[v] &= got[v] == got["off"]
            if on_progress:
                on_progress()
        for v in VARIANTS:
            st = llms[v].stats()
            drafted = st.get("spec_decode_num_draft_tokens", 0)
            acc = st["spec_decode_num_accepted_tokens"] / drafted if drafted else None
            rows.append(RepeatRow(name, v, tot[v][0], tot[v][1], acc, same[v]))
    return rows, (load0, os.getloadavg()[0])


def proposer_cost(budget: int = 10_000, depth: int = 24, calls: int = 2000) -> dict[str, float]:
    """Microseconds per suffix-proposer call (sync of one new token + longest match + walk) on a trie
    filled to its budget with Zipf-distributed tokens, and per token inserted / evicted."""
    import random

    from kvserve.engine.request import Request
    from kvserve.engine.spec_decode.suffix import SuffixDrafter
    from kvserve.sampling_params import SamplingParams

    rng = random.Random(0)
    weights = [1 / (i + 1) for i in range(4000)]
    d = SuffixDrafter(8, budget, depth, 0.3, None)
    t0, n = time.perf_counter(), 0
    i = 0
    while n < 2 * budget:                   # twice the budget: eviction runs too
        r = Request(f"fill{i}", rng.choices(range(4000), weights, k=64), SamplingParams(temperature=0), i)
        r.output_token_ids = rng.choices(range(4000), weights, k=200)
        d.index.sync(r)
        d.finish(r, r.request_id)
        n, i = n + 264, i + 1
    fill_us = (time.perf_counter() - t0) / n * 1e6
    r = Request("probe", rng.choices(range(4000), weights, k=64), SamplingParams(temperature=0), i)
    d.draft(r, 8, 0.0)
    t0 = time.perf_counter()
    for _ in range(calls):
        r.output_token_ids.append(rng.choices(range(4000), weights)[0])
        d.draft(r, 8, 0.0)
    return {"call_us": (time.perf_counter() - t0) / calls * 1e6, "insert_evict_us_per_token": fill_us,
            "nodes": d.index.num_nodes, "tokens": d.index.num_tokens}


def repeat_table(rows: list[RepeatRow]) -> str:
    lines = ["| workload | speculation | output tokens | decode tok/s | vs off | vs ngram | acceptance | same tokens |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    ref = {(r.workload, r.engine): r.decode_tps for r in rows}
    for r in rows:
        off, ng = ref[(r.workload, "off")], ref[(r.workload, "ngram")]
        acc = f"{r.acceptance:.0%}" if r.acceptance is not None else "-"
        lines.append(f"| {r.workload} | {r.engine} | {r.output_tokens} | {r.decode_tps:.1f} | "
                     f"{r.decode_tps / off:.2f}x | {r.decode_tps / ng:.2f}x | {acc} | {'yes' if r.identical else 'NO'} |")
    return "\n".join(lines)


def repeat_command(model: str | None, num_prompts: int, output_len: int, threads: int, out_dir: Path) -> None:
    from kvserve.bench.common import progress

    with progress() as prog:
        task = prog.add_task("repeat", total=num_prompts + min(num_prompts, len(_OPEN)))
        rows, (l0, l1) = run_repeat(model, num_prompts, output_len, threads,
                                    on_progress=lambda: prog.advance(task))
    table = repeat_table(rows)
    cost = proposer_cost()
    table += ("\n\nsuffix proposer, pure Python, trie filled past its default 10,000-token budget (depth 24): "
              f"{cost['call_us']:.0f} us per request per step, {cost['insert_evict_us_per_token']:.0f} us per token "
              f"inserted and evicted, {cost['nodes']:,} nodes")
    note = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {threads} threads, load average (1 min) "
            f"{l0:.1f} at start, {l1:.1f} at end")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "repeat.md").write_text(table + "\n\n" + note + "\n")
    (out_dir / "repeat.json").write_text(json.dumps({"rows": [asdict(r) | {"decode_tps": r.decode_tps} for r in rows],
                                                     "loadavg": [l0, l1]}, indent=1))
    print(table)
    print(note)
