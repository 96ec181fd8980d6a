"""The most any proposer right a share P of the time can gain here: an oracle that costs nothing.

    PYTHONPATH=src python scripts/spec_oracle_bound.py P [K] [ROUNDS]

The oracle proposes the target's own greedy continuation (recorded by a baseline engine first),
each draft token right with probability P and otherwise wrong (which ends the draft), at most K
tokens a step (the adaptive k and the cost gate still decide how many). It runs in the real
engine, verification and all, on `bench latency`'s open prompts, alternated with a baseline
engine in the same process, the first round left out; the answers must equal the baseline's.
A real draft pays its own step on top of this (BENCHMARKS.md, issue 16).
"""

import random
import statistics
import sys
import time

from kvserve import LLM, SamplingParams
from kvserve.bench.spec_latency import OPEN_PROMPTS

P = float(sys.argv[1])
K = int(sys.argv[2]) if len(sys.argv) > 2 else 1
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 4
greedy = SamplingParams(temperature=0.0, max_tokens=128)


def chat(llm, prompt, params=greedy):
    return llm.chat([{"role": "user", "content": prompt}], params)[0]


class Oracle:
    """The Proposer interface (spec_decode/proposer.py) over recorded answers, keyed by prompt ids."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], p: float, vocab: int):
        self.answers, self.p, self.vocab, self.rng = answers, p, vocab, random.Random(0)

    def propose(self, batch):
        drafts = []
        for req, k in batch:
            ref, j = self.answers[tuple(req.prompt_token_ids)], len(req.output_token_ids)
            d: list[int] = []
            for tok in ref[j:j + k]:
                if self.rng.random() >= self.p:
                    d.append((tok + 1) % self.vocab)   # a wrong guess ends the draft
                    break
                d.append(tok)
            drafts.append(d)
        return drafts


base = LLM()
spec = LLM(speculative="ngram", num_speculative_tokens=K)
answers, expected = {}, {}
for prompt in OPEN_PROMPTS:
    out = chat(base, prompt)
    expected[prompt] = out.outputs[0].token_ids
    answers[tuple(out.prompt_token_ids)] = expected[prompt]
scheduler = spec.engine.core.scheduler
scheduler.spec.proposer = Oracle(answers, P, spec.engine.core.runner.model.config.vocab_size)

per_token: dict[str, list[float]] = {"baseline": [], "oracle": []}
for rnd in range(ROUNDS):
    for name, llm in (("baseline", base), ("oracle", spec)):
        t0, n = time.perf_counter(), 0
        for prompt in OPEN_PROMPTS:
            ids = chat(llm, prompt).outputs[0].token_ids
            assert ids == expected[prompt], "speculation changed a greedy answer"
            n += len(ids)
        if rnd:
            per_token[name].append((time.perf_counter() - t0) / n)
b, o = (statistics.median(per_token[k]) for k in ("baseline", "oracle"))
st = spec.stats()
print(f"P = {P}, K = {K}: baseline {1000 * b:.3f} ms a token, oracle {1000 * o:.3f}: {b / o:.3f}x "
      f"(rounds {[round(x / y, 3) for x, y in zip(per_token['baseline'], per_token['oracle'])]}); "
      f"{st.get('spec_decode_num_drafts')} drafts, {st.get('spec_decode_num_draft_tokens')} draft tokens, "
      f"{st.get('spec_decode_num_accepted_tokens')} accepted")
