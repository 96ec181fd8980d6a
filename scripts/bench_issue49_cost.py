"""Issue 49's per-token costs, measured on the functions alone (no server): stop strings in the
streaming detokenizer and logit_bias in the sampler. Run it against another tree to compare:

    PYTHONPATH=src python scripts/bench_issue49_cost.py            # this tree
    PYTHONPATH=/path/to/main/src python scripts/bench_issue49_cost.py   # before

stops: 1,000 output tokens of the default model's tokenizer streamed one at a time through
IncrementalDetokenizer with sixteen random 60 KB stop strings (none matches), per choice.
logit_bias: Sampler.process_logits on n=8 rows sharing a vocabulary-wide logit_bias (49,152
entries), per step, after one warm-up step.
"""

from __future__ import annotations

import argparse
import random
import string
import time


def bench_stops(tokens: int, stops: int, stop_chars: int) -> float:
    import gguf

    from kvserve.model.registry import resolve
    from kvserve.tokenizer import Tokenizer
    from kvserve.tokenizer.detokenizer import IncrementalDetokenizer

    tok = Tokenizer.from_gguf(gguf.GGUFReader(resolve(None).path))
    rng = random.Random(0)
    words = ["the", "model", "answers", "every", "question", "with", "care,", "and", "then", "stops."]
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tok.encode(" ".join(rng.choice(words) for _ in range(200)), add_special_tokens=False)
    ids = ids[:tokens]
    stop = ["".join(rng.choice(string.ascii_letters) for _ in range(stop_chars)) for _ in range(stops)]
    t0 = time.perf_counter()
    detok = IncrementalDetokenizer(tok, [], stop=stop)
    for t in ids:
        detok.add_tokens([t])
    detok.flush()
    return time.perf_counter() - t0


def bench_logit_bias(n: int, vocab: int, steps: int) -> float:
    import torch

    from kvserve.engine.sampler import Sampler, SamplingRequest
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(logit_bias={t: -1.0 for t in range(vocab)}, temperature=0.0, max_tokens=16)
    sampler = Sampler([2])
    logits = torch.randn(n, vocab)
    reqs = [SamplingRequest(params, [1, 2, 3], [4]) for _ in range(n)]
    sampler.process_logits(logits, reqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        sampler.process_logits(logits, reqs)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--stops", type=int, default=16)
    ap.add_argument("--stop-chars", type=int, default=60_000)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    s = bench_stops(a.tokens, a.stops, a.stop_chars)
    print(f"stops: {a.tokens} tokens vs {a.stops} x {a.stop_chars}-char stops: {s:.3f} s per choice")
    b = bench_logit_bias(a.n, a.vocab, a.steps)
    print(f"logit_bias: n={a.n}, {a.vocab} entries: {b * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
