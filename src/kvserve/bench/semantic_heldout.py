"""Held-out sets for the semantic cache (issue 47), written by hand and never used to tune it:

- `DOCUMENTS`: shared documents (a letter, code, a passage, meeting notes, retrieved passages),
  each asked several *different* questions. No question may be answered with another's answer.
- `NEAR_MISSES`: short questions one fact apart (arithmetic, entities, units, antonyms). The
  second of each pair must not get the first's answer.
- `PARAPHRASES`: short standalone questions and a true paraphrase of each: the second should hit.

`run(base_url, ...)` sends each set to a live `kvserve serve` (greedy, a fresh `cache_salt` per
run so earlier entries do not count) and reports, per set, how many requests came from the cache
(`x-kvserve-cache`), how many of those the model verified whole, and the *false hits*: answers
that differ from the model's own answer to the same request with `"cache": false`.

`calibrate(llm, ...)` chooses the sampled requests' likelihood threshold (the cache's
`sampled_min_logprob`, spec_decode/rejection.py): offline, with the model, it samples a stored answer
for each question and scores, token by token, how likely the model finds a stored answer under
another request's prompt (raw logprobs, one prefill each). Pairs are *other* (a question about the
same document given another question's answer; the second of a near miss given the first's) or
*same* (a paraphrase given the first wording's answer; a question given another sample of its own
answer). The keys never let an *other* pair become a candidate; the threshold is measured as if they
had, a second guard. A stored answer is served whole at threshold t when its least likely token's
logprob is >= t.
"""

from __future__ import annotations

import statistics
import time
import uuid

LETTER = ("Dear Ms. Alvarez,\n\nThank you for your letter of 3 March. We have looked into your booking from "
          "Lisbon to Porto and then on to Madrid. The train from Lisbon was cancelled, so we refunded 45 euros "
          "to your card on 12 March. The hotel in Porto has agreed to move your stay to April.\n\n"
          "Kind regards,\nTomas Berg, Customer Care")
CODE = ("```python\ndef summarize(orders):\n    totals = {}\n    for order in orders:\n"
        "        totals[order.customer] = totals.get(order.customer, 0) + order.amount\n"
        "    return sorted(totals.items(), key=lambda kv: kv[1], reverse=True)\n```")
PASSAGE = ("The river town of Lowbridge was founded in 1821 by millers who needed the fast water of the Fenn. "
           "By 1900 it had a railway station, two schools and a small hospital. The last mill closed in 1962; "
           "its building now holds the town library and a museum of milling.\n\nToday about 8,000 people "
           "live in Lowbridge, and its market is held every Saturday in the square by the bridge.")
NOTES = ("Meeting notes, project Atlas, Tuesday:\n\n- Priya will finish the database migration by Friday.\n"
         "- The launch moves from May 2 to May 16 because the payment provider needs two more weeks.\n"
         "- Budget: 12,000 dollars left; Sam asked for 3,000 of it for load testing.\n"
         "- Open question: who owns the support rota after launch?")
RETRIEVED = ("[1] Vitamin C is found in citrus fruit, peppers and broccoli; adults need about 90 mg a day.\n\n"
             "[2] Vitamin D is made in the skin in sunlight; in winter many people take 10 micrograms a day.\n\n"
             "[3] Iron from meat is absorbed better than iron from plants; vitamin C helps the body absorb it.")

DOCUMENTS: list[tuple[str, list[str]]] = [
    (LETTER, ["List every city named in this letter.", "How much money was refunded, according to this letter?",
              "Who wrote this letter?", "Why was the refund made?"]),
    (CODE, ["Repeat the following code exactly, adding a docstring.",
            "Rename the variable `totals` to `per_customer` in this code.",
            "What does this function return?", "Explain this code in one sentence."]),
    (PASSAGE, ["When was Lowbridge founded?", "What is in the old mill building today?",
               "How many people live in Lowbridge?", "On which day is the market held?"]),
    (NOTES, ["When is the launch now?", "What is Priya doing?", "How much budget is left?",
             "Summarize these notes in two sentences."]),
    (RETRIEVED, ["How much vitamin C do adults need?", "Where does vitamin D come from?",
                 "Which vitamin helps the body absorb iron?"]),
]

NEAR_MISSES: list[tuple[str, str]] = [
    ("What is 17 times 23?", "What is 17 times 24?"), ("What is 144 divided by 12?", "What is 144 divided by 6?"),
    ("What is 15 plus 27?", "What is 15 minus 27?"), ("What is 9 squared?", "What is 9 cubed?"),
    ("What is the capital of Spain?", "What is the capital of Portugal?"),
    ("Who wrote Hamlet?", "Who wrote Macbeth?"), ("How many legs does a spider have?", "How many legs does an ant have?"),
    ("What is the boiling point of water in Celsius?", "What is the boiling point of water in Fahrenheit?"),
    ("What is the largest planet in the solar system?", "What is the smallest planet in the solar system?"),
    ("Convert 10 miles to kilometers.", "Convert 10 kilometers to miles."),
    ("What year did World War II end?", "What year did World War I end?"),
    ("Is a tomato a fruit?", "Is a tomato not a fruit?"),
]

PARAPHRASES: list[tuple[str, str]] = [
    ("What is the capital of Italy?", "What's the capital of Italy?"),
    ("How many days are in a leap year?", "how many days are there in a leap year"),
    ("What is the chemical symbol for gold?", "What's the chemical symbol of gold?"),
    ("Who painted the Mona Lisa?", "Who painted the Mona Lisa?"),
    ("What is the speed of light?", "what is the speed of light"),
    ("How many continents are there?", "How many continents are there on Earth?"),
    ("What is the freezing point of water?", "What's the freezing point of water?"),
    ("What is photosynthesis?", "Can you tell me what photosynthesis is?"),
    ("What is the tallest mountain in the world?", "Which mountain is the tallest in the world?"),
    ("What language is spoken in Brazil?", "Which language do people speak in Brazil?"),
]


def doc_message(doc: str, question: str) -> str:
    return f"{doc}\n\n{question}"


def _ask(client, base_url: str, content: str, salt: str, max_tokens: int, cache: bool = True) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "cache_salt": salt, "kvserve_trace": True, **({} if cache else {"cache": False})}
    t0 = time.perf_counter()
    r = client.post(base_url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    body = r.json()
    sc = (body.get("kvserve_trace") or {}).get("semantic_cache") or {}
    return {"text": body["choices"][0]["message"]["content"], "hit": r.headers.get("x-kvserve-cache") == "semantic",
            "verified": sc.get("verification", {}).get("result", "served" if sc else None),
            "ms": (time.perf_counter() - t0) * 1000, "tokens": body["usage"]["completion_tokens"]}


def run(base_url: str, max_tokens: int = 48, limit: int = 100) -> dict:
    """Per set: asked (the second and later requests), hits, verified-whole hits, false hits; and the
    latency of served hits against the same requests decoded in full (p50, ms). `limit`: at most
    this many documents (and questions each) or pairs per set."""
    import httpx

    salt = uuid.uuid4().hex
    sets = {"documents": [[doc_message(d, q) for q in qs[:limit]] for d, qs in DOCUMENTS[:limit]],
            "near_misses": [list(p) for p in NEAR_MISSES[:2 * limit]],
            "paraphrases": [list(p) for p in PARAPHRASES[:2 * limit]]}
    report: dict = {"records": []}
    hit_ms, full_ms = [], []
    with httpx.Client() as client:
        for name, groups in sets.items():
            asked = hits = verified = false = 0
            for group in groups:
                for i, content in enumerate(group):
                    got = _ask(client, base_url, content, salt, max_tokens)
                    own = got if i == 0 else _ask(client, base_url, content, salt, max_tokens, cache=False)
                    report["records"].append({"set": name, "group": groups.index(group), "content": content,
                                              "answer": got["text"], "own": own["text"], "hit": got["hit"],
                                              "verified": got["verified"]})
                    if i == 0:
                        continue
                    asked += 1
                    hits += got["hit"]
                    verified += got["verified"] in ("verified", "served") and got["text"] == own["text"]
                    false += got["text"] != own["text"]
                    if got["hit"] and got["verified"] in ("verified", "served"):
                        hit_ms.append(got["ms"])
                        full_ms.append(own["ms"])
            report[name] = {"asked": asked, "hits": hits, "served_whole": verified, "false_hits": false}
    report["latency_ms"] = {"hits": len(hit_ms), "hit_p50": round(statistics.median(hit_ms), 1) if hit_ms else None,
                            "full_decode_p50": round(statistics.median(full_ms), 1) if full_ms else None}
    return report


THRESHOLDS = (-0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -5.0, -6.0, -8.0, -10.0)


def _pairs() -> tuple[list[str], list[tuple[int, int, str]]]:
    """Every question once, and (asker, owner of the stored answer, "other"|"same") index pairs."""
    questions: list[str] = []
    pairs: list[tuple[int, int, str]] = []
    for doc, qs in DOCUMENTS:
        ids = list(range(len(questions), len(questions) + len(qs)))
        questions += [doc_message(doc, q) for q in qs]
        pairs += [(a, b, "other") for a in ids for b in ids if a != b]
    for first, second in NEAR_MISSES:
        questions += [first, second]
        pairs.append((len(questions) - 1, len(questions) - 2, "other"))
    for first, second in PARAPHRASES:
        questions += [first, second]
        pairs += [(len(questions) - 1, len(questions) - 2, "same"), (len(questions) - 2, len(questions) - 2, "same")]
    return questions, pairs


def _score(llm, seqs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """The raw logprob of each answer token after its prompt, as the cache's check computes it: the
    answer rides as the request's own draft, every token kept (threshold -1e9), one forward each
    (prompt logprobs would put every prompt position through the lm head). A token whose
    probability underflows is not kept: it and the rest score -100."""
    import time as _time

    from kvserve import SamplingParams
    from kvserve.engine.messages import EngineCoreRequest

    core = llm.engine.core
    got: dict[str, list] = {}
    for i, (prompt, ans) in enumerate(seqs):
        params = SamplingParams(temperature=1.0, max_tokens=len(ans) + 1, logprobs=0, ignore_eos=True)
        core.add_request(EngineCoreRequest(request_id=f"score{i}", prompt_token_ids=prompt, sampling_params=params,
                                           arrival_time=_time.monotonic(), draft_token_ids=ans,
                                           draft_min_logprob=-1e9))
        got[f"score{i}"] = []
    left = set(got)
    while left:
        for o in core.step().outputs:
            got[o.request_id] += list(zip(o.new_token_ids, o.new_logprobs or []))
            if o.finish_reason:
                left.discard(o.request_id)
    out = []
    for i, (_, ans) in enumerate(seqs):
        row = []
        for j, t in enumerate(ans):
            tok, lp = got[f"score{i}"][j] if j < len(got[f"score{i}"]) else (None, None)
            if tok != t:
                row += [-100.0] * (len(ans) - j)
                break
            row.append(lp.logprob)
        out.append(row)
    return out


def calibrate(llm, temperature: float = 0.7, max_tokens: int = 32, seed: int = 0) -> dict:
    """Per threshold: the share of *other* and *same* pairs whose stored answer would be served whole,
    and the mean share of the answer's tokens kept. Also each pair's least likely token (module docstring)."""
    from kvserve import SamplingParams

    tok = llm.get_tokenizer()
    questions, pairs = _pairs()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for q in questions]
    sample = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i) for i in range(len(prompts))]
    stored = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sample,
                                                            use_tqdm=False)]
    # a second sample of each question's own answer (seeded apart): the "same" pair (a, a) scores it
    again = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=10_000 + seed + i)
             for i in range(len(prompts))]
    second = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], again,
                                                            use_tqdm=False)]
    seqs = [(prompts[a], list(second[a] if a == b else stored[b])) for a, b, _ in pairs]
    lps = _score(llm, seqs)
    report: dict = {"temperature": temperature, "max_tokens": max_tokens, "pairs": {}, "thresholds": {}}
    for kind in ("other", "same"):
        mine = [lp for lp, (_, _, k) in zip(lps, pairs) if k == kind and lp]
        report["pairs"][kind] = {"n": len(mine), "min_logprob_p50": round(statistics.median(min(x) for x in mine), 2),
                                 "mean_logprob_p50": round(statistics.median(sum(x) / len(x) for x in mine), 2)}
        for t in THRESHOLDS:
            kept = [next((j for j, v in enumerate(x) if v < t), len(x)) / len(x) for x in mine]
            report["thresholds"].setdefault(str(t), {})[kind] = {
                "served_whole": round(sum(k == 1.0 for k in kept) / len(mine), 3),
                "tokens_kept": round(sum(kept) / len(mine), 3)}
    report["records"] = [{"asker": questions[a][-60:], "answer_of": questions[b][-60:], "kind": k,
                          "answer": tok.decode(ans), "min_logprob": round(min(x), 2) if x else None}
                         for (a, b, k), (_, ans), x in zip(pairs, seqs, lps)]
    return report


if __name__ == "__main__":
    import json
    import sys

    # python -m kvserve.bench.semantic_heldout URL [max_tokens] [limit]
    # python -m kvserve.bench.semantic_heldout --calibrate [temperature] [max_tokens]
    if sys.argv[1] == "--calibrate":
        from kvserve import LLM

        print(json.dumps(calibrate(LLM(), *(float(a) for a in sys.argv[2:3]), *(int(a) for a in sys.argv[3:4])),
                         indent=1))
    else:
        print(json.dumps(run(sys.argv[1], *(int(a) for a in sys.argv[2:])), indent=1))
