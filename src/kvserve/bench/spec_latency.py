"""`kvserve bench latency --speculative ngram`: single-stream greedy decode through the whole engine,
with and without speculative decoding, in the same run, interleaved (A, B, A, B, ...).

Two workloads:
  grounded  rewrite, extract from, edit or repeat a ~300-token passage given in the prompt (the
            answers copy runs of the prompt: where prompt lookup pays)
  open      open chat questions (little to copy: speculation must cost next to nothing)
Decode tok/s of a request is (output tokens - 1) / (last token time - first token time), so the
prefill is left out; each cell is the total over the workload's prompts, best of `repeats`. The
greedy answers with and without speculation are compared token for token.

Beside the best-of ratio, each prompt of each repeat gives a paired ratio (its decode rate with
speculation over the rate of the baseline run just before it): their median and range are
reported too. On a machine whose speed drifts from one minute to the next (a shared VM: +-10-20%),
the best-of totals can pair a fast minute of one arm with a slow one of the other, and the paired
median is the steadier number.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

PASSAGE = (
    "The harbour of Kelby was built in 1788, when the fishing families of the bay pooled their savings to pay "
    "for a stone wall against the winter storms. For forty years the wall held, and the village grew from a "
    "dozen cottages to a town of nearly two thousand people, with a church, a school, a rope works and three "
    "inns along the quay. In the great storm of 1829 the northern end of the wall collapsed, and eleven boats "
    "were lost in a single night. The town rebuilt the wall higher and longer, using granite brought by cart "
    "from the quarry at Penmoor, and the new wall has stood ever since. In the second half of the nineteenth "
    "century the railway reached Kelby, and with it came visitors from the cities, who walked along the wall "
    "on summer evenings and bought fresh fish straight from the boats. The fishing fleet shrank after 1950, "
    "but the harbour is still busy: today it holds about sixty small boats, a lifeboat station and a ferry "
    "that crosses to the islands twice a day in summer. The old rope works is now a museum, where visitors "
    "can see how ropes were twisted by hand on a walk two hundred metres long, and the school has become the "
    "town library.")
GROUNDED_TASKS = [
    "Repeat the following passage exactly, word for word.",
    "Rewrite the following passage, replacing the name Kelby with Marlow everywhere. Change nothing else.",
    "Copy every sentence of the following passage that contains a year, in order.",
    "Rewrite the following passage in the present tense.",
]
OPEN_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a ten-year-old.",
    "Give me five ideas for a rainy Sunday afternoon, with one sentence on each.",
    "What are the pros and cons of working from home?",
]

WORKLOADS = {"grounded": [f"{t}\n\n{PASSAGE}" for t in GROUNDED_TASKS], "open": OPEN_PROMPTS}


@dataclass
class SpecBenchRow:
    workload: str
    engine: str              # "baseline" or the proposer
    output_tokens: int
    decode_s: float
    acceptance: float | None = None
    identical: bool | None = None
    paired: list[float] | None = None   # per prompt and repeat: rate with speculation / rate without

    @property
    def decode_tps(self) -> float:
        return self.output_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def paired_median(self) -> float | None:
        return statistics.median(self.paired) if self.paired else None


def _decode_time(llm, prompt: dict, params) -> tuple[int, float, list[int]]:
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    m, ids = out.metrics, out.outputs[0].token_ids
    return len(ids) - 1, (m.last_token_time or 0) - (m.first_token_time or 0), ids


def run_spec_latency(model: str | None, speculative: str, num_speculative_tokens: int | None, decode_tokens: int,
                     repeats: int, threads: int, on_progress: Callable[[], None] | None = None,
                     workloads: list[str] | None = None) -> list[SpecBenchRow]:
    import torch

    from kvserve import LLM, SamplingParams
    from kvserve.model.loader import load_model

    torch.set_num_threads(threads)
    loaded = load_model(model)
    kw = {"tokenizer": loaded.tokenizer, "kv_cache_memory": "256MiB", "enable_prefix_caching": False}
    base = LLM(loaded.model, **kw)
    spec = LLM(loaded.model, speculative=speculative, num_speculative_tokens=num_speculative_tokens, **kw)
    tok = loaded.tokenizer
    chosen = {w: WORKLOADS[w] for w in (workloads or list(WORKLOADS))}
    params = SamplingParams(temperature=0, max_tokens=decode_tokens)
    rows = []
    for name, texts in chosen.items():
        prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True)}
                   for t in texts]
        best = {"baseline": (0, float("inf")), "spec": (0, float("inf"))}
        identical = True
        paired = []
        s0 = spec.stats()
        for _ in range(repeats):
            totals = {"baseline": [0, 0.0], "spec": [0, 0.0]}
            for p in prompts:                              # interleaved: A, B, A, B
                n_a, t_a, ids_a = _decode_time(base, p, params)
                n_b, t_b, ids_b = _decode_time(spec, p, params)
                identical &= ids_a == ids_b
                if min(n_a, n_b, t_a, t_b) > 0:
                    paired.append((n_b / t_b) / (n_a / t_a))
                totals["baseline"][0] += n_a
                totals["baseline"][1] += t_a
                totals["spec"][0] += n_b
                totals["spec"][1] += t_b
                if on_progress:
                    on_progress()
            for k, (n, t) in totals.items():
                if t < best[k][1]:
                    best[k] = (n, t)
        s1 = spec.stats()
        drafted = s1["spec_decode_num_draft_tokens"] - s0["spec_decode_num_draft_tokens"]
        accepted = s1["spec_decode_num_accepted_tokens"] - s0["spec_decode_num_accepted_tokens"]
        rows.append(SpecBenchRow(name, "baseline", *best["baseline"]))
        rows.append(SpecBenchRow(name, speculative, *best["spec"], accepted / drafted if drafted else None, identical,
                                 paired))
    return rows


def spec_markdown_table(rows: list[SpecBenchRow]) -> str:
    lines = [("| workload | engine | output tokens | decode tok/s | speedup | paired speedup, median (range) | "
              "draft acceptance | same tokens |"),
             "|---|---|---:|---:|---:|---:|---:|---|"]
    base = {r.workload: r for r in rows if r.engine == "baseline"}
    for r in rows:
        b = base[r.workload]
        speedup = r.decode_tps / b.decode_tps if b.decode_tps else 0.0
        acc = f"{r.acceptance:.0%}" if r.acceptance is not None else "-"
        same = "-" if r.identical is None else ("yes" if r.identical else "NO")
        pm = r.paired_median
        pair = "-" if pm is None else f"{pm:.2f}x ({min(r.paired):.2f}-{max(r.paired):.2f}, n = {len(r.paired)})"
        lines.append(f"| {r.workload} | {r.engine} | {r.output_tokens} | {r.decode_tps:.1f} | {speedup:.2f}x | "
                     f"{pair} | {acc} | {same} |")
    return "\n".join(lines)


def timestamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
