"""Structured output's costs, engine only (LLM.generate, the default model), every variant
interleaved so the machine's load hits them alike. Issue 17's numbers in BENCHMARKS.md.

    PYTHONPATH=src python scripts/bench_structured.py [--rounds-ttft 21] [--rounds-decode 6]

- TTFT (max_tokens=1): no schema / a schema seen before / a new schema each time (a typical
  object schema: nested object, array with min/max items, enum, pattern, format);
- decode tok/s, 32 tokens, 1 and 16 requests at once, with and without a schema that cannot
  finish in 32 tokens (an array of >= 500 row objects), alternating;
- every wall time is printed with the process's CPU time for the same work (all its threads,
  `time.process_time`), which a loaded machine inflates far less than wall time;
- the parts alone, one thread, no model: one matcher's bitmask per token along a real output,
  the sampler's apply_bitmask for 1 and 16 rows.
"""

from __future__ import annotations

import argparse
import json
import statistics as st
import time
import uuid

import torch

from kvserve import LLM, SamplingParams
from kvserve.model.loader import load_model
from kvserve.sampling_params import StructuredOutputsParams as SO
from kvserve.structured.backend import GrammarBackend, apply_bitmask
from kvserve.structured.grammar import compiler_for

ROW = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                        "name": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"}},
       "required": ["id", "name", "ok"], "additionalProperties": False}
ROWS = {"type": "object", "properties": {"rows": {"type": "array", "items": ROW, "minItems": 500}},
        "required": ["rows"], "additionalProperties": False}
TYPICAL = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "email": {"type": "string", "format": "email"},
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "street": {"type": "string"}},
                "required": ["city"]}}, "required": ["name", "email", "role", "tags"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds-ttft", type=int, default=21)
    ap.add_argument("--rounds-decode", type=int, default=6)
    args = ap.parse_args()
    lm = load_model(None)
    tok = lm.tokenizer
    llm = LLM(lm.model, tokenizer=tok)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe a user as JSON."}]),
                        add_special_tokens=False)
    llm.generate([prompt], SamplingParams(max_tokens=2, structured_outputs=SO(json=TYPICAL)), use_tqdm=False)

    def ttft(so: SO | None) -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, structured_outputs=so), use_tqdm=False)
        return (time.perf_counter() - t) * 1000, (time.process_time() - c) * 1000

    res: dict[str, list[tuple[float, float]]] = {"none": [], "cached": [], "new": []}
    for _ in range(args.rounds_ttft):
        res["none"].append(ttft(None))
        res["cached"].append(ttft(SO(json=TYPICAL)))
        res["new"].append(ttft(SO(json={**TYPICAL, "title": uuid.uuid4().hex})))
    for j, what in ((0, "wall"), (1, "process CPU")):
        m = {k: st.median(x[j] for x in v) for k, v in res.items()}
        print(f"TTFT medians, {what} (ms):", {k: round(v, 1) for k, v in m.items()},
              f"new - none {m['new'] - m['none']:.1f} ms, cached - none {m['cached'] - m['none']:.1f} ms")
    for batch in (1, 16):
        rates: dict[str, list[float]] = {"none": [], "schema": []}
        cpu: dict[str, list[float]] = {"none": [], "schema": []}     # tokens per CPU-second
        for r in range(args.rounds_decode):
            order = (("none", None), ("schema", SO(json=ROWS)))
            for name, so in order if r % 2 == 0 else order[::-1]:
                t, c = time.perf_counter(), time.process_time()
                outs = llm.generate([prompt] * batch, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                                                     structured_outputs=so), use_tqdm=False)
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                rates[name].append(n / (time.perf_counter() - t))
                cpu[name].append(n / (time.process_time() - c))
        a, b = st.median(rates["none"]), st.median(rates["schema"])
        ca, cb = st.median(cpu["none"]), st.median(cpu["schema"])
        print(f"{batch} at once: tok/s without {a:.1f}, with the schema {b:.1f}, ratio {b / a:.3f}; per round",
              [round(y / x, 2) for x, y in zip(rates["none"], rates["schema"])],
              f"; tokens per CPU-second without {ca:.1f}, with {cb:.1f}, ratio {cb / ca:.3f}")
    parts()


def parts() -> None:
    torch.set_num_threads(1)
    tok = load_model(None).tokenizer
    comp = compiler_for(tok, 49152)
    be = GrammarBackend(comp)
    m = be.submit(comp.prepare(SO(json=ROWS))).result().deep_copy()
    text = json.dumps({"rows": [{"id": i * 37, "name": f"row number {i}", "ok": i % 2 == 0} for i in range(40)]})
    times = []
    for t in tok.encode(text[:-2], add_special_tokens=False)[:300]:
        t0 = time.perf_counter()
        be._fill([m])
        times.append(time.perf_counter() - t0)
        assert m.consume_token(t)
    times.sort()
    print(f"one bitmask per token: median {st.median(times) * 1e6:.0f} us, p90 {times[int(0.9 * len(times))] * 1e6:.0f}"
          f" us over {len(times)} tokens")
    for rows in (1, 16):
        logits, mask = torch.randn(rows, 49152), torch.full((rows, 1536), -1, dtype=torch.int32)
        ts = []
        for _ in range(50):
            t0 = time.perf_counter()
            apply_bitmask(logits, list(range(rows)), mask)
            ts.append(time.perf_counter() - t0)
        print(f"apply_bitmask, {rows} rows: median {st.median(ts) * 1e6:.0f} us")
    be.shutdown()


if __name__ == "__main__":
    main()
