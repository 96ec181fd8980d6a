"""JSON-schema requests with and without speculative decoding (ngram prompt lookup), engine only
(LLM.generate, the default model), one process, the two engines alternating round by round so the
machine's load hits them alike. Issue 17's "grammar + speculation" numbers in BENCHMARKS.md.

    PYTHONPATH=src python scripts/bench_structured_spec.py [--rounds 5] [--k 5]

Each request asks for JSON that copies text from its prompt (where prompt lookup drafts well) under
a schema; greedy. Checked every round: the speculative answer is token for token the one without
speculation, and a complete one parses and validates against the schema (`jsonschema`).
"""

from __future__ import annotations

import argparse
import json
import statistics as st
import time

import jsonschema

from kvserve import LLM, SamplingParams
from kvserve.model.loader import load_model
from kvserve.sampling_params import StructuredOutputsParams as SO

PASSAGE = ("The river town of Lowbridge was founded in 1821 by a group of millers who needed the fast water of "
           "the Fenn to turn their wheels. Over the next century the town grew around three mills, a stone bridge "
           "and a market square, and by 1900 it had a railway station, two schools and a small hospital. The "
           "last mill closed in 1962; its building now holds the town library and a museum of milling.")
CASES = [
    ("Reply in JSON with the town, the year it was founded and a summary that copies the first sentence of "
     "this passage:\n\n" + PASSAGE,
     {"type": "object", "properties": {"town": {"type": "string"}, "founded": {"type": "integer"},
                                       "summary": {"type": "string"}},
      "required": ["town", "founded", "summary"], "additionalProperties": False}),
    ("Return the sentences of this passage as a JSON list under \"sentences\":\n\n" + PASSAGE,
     {"type": "object", "properties": {"sentences": {"type": "array", "items": {"type": "string"},
                                                     "minItems": 1, "maxItems": 6}},
      "required": ["sentences"], "additionalProperties": False}),
    ("Give this passage as JSON: {\"text\": <the passage, word for word>}\n\n" + PASSAGE,
     {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
      "additionalProperties": False}),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    lm = load_model(None)
    tok = lm.tokenizer
    base = LLM(lm.model, tokenizer=tok, kv_cache_memory="256MiB")
    spec = LLM(lm.model, tokenizer=tok, kv_cache_memory="256MiB", speculative="ngram",
               num_speculative_tokens=args.k)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p, _ in CASES]
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=SO(json=s))
              for _, s in CASES]
    for llm in (base, spec):                     # compile the grammars, warm both engines
        llm.generate(prompts[:1], params[:1], use_tqdm=False)
    rates: dict[str, list[float]] = {"without": [], "with": []}
    s0 = spec.stats()
    valid = 0
    for r in range(args.rounds):
        outs = {}
        for name, llm in (("without", base), ("with", spec)) if r % 2 == 0 else (("with", spec), ("without", base)):
            n = t = 0.0
            got = []
            for p, sp in zip(prompts, params):        # single stream: one request at a time
                t0 = time.perf_counter()
                o = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
                t += time.perf_counter() - t0
                n += len(o.token_ids)
                got.append(o)
            rates[name].append(n / t)
            outs[name] = got
        for (_, schema), a, b in zip(CASES, outs["without"], outs["with"]):
            assert a.token_ids == b.token_ids, "speculation changed a greedy answer"
            if b.finish_reason == "stop":          # complete: parses and validates
                jsonschema.validate(json.loads(b.text), schema)
                valid += 1
    s1 = spec.stats()
    drafted = s1["spec_decode_num_draft_tokens"] - s0["spec_decode_num_draft_tokens"]
    accepted = s1["spec_decode_num_accepted_tokens"] - s0["spec_decode_num_accepted_tokens"]
    a, b = st.median(rates["without"]), st.median(rates["with"])
    print(f"single stream, {len(CASES)} schema requests per round, {args.rounds} rounds: tok/s without "
          f"speculation {a:.1f}, with ngram k={args.k} {b:.1f}, speedup {b / a:.2f}x; per round",
          [round(y / x, 2) for x, y in zip(rates["without"], rates["with"])],
          f"; drafted {drafted}, accepted {accepted} ({accepted / max(drafted, 1):.0%})")
    print("finish reasons (last round):", [o.finish_reason for o in outs["with"]],
          f"; greedy outputs identical with and without speculation; {valid} complete answers validated "
          "(a 'length' answer is a grammar-valid prefix: the matcher accepted every token)")


if __name__ == "__main__":
    main()
