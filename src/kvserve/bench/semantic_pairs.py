"""A template-generated test set for the semantic cache: stored queries, true paraphrases of them,
and near misses (the same wording about another entity or number).

Each intent has several phrasings and slot values. Values are split into two halves: a query for a
value of the first half is stored in the cache; a *paraphrase* is another phrasing of a stored
query (must hit, and hit that entry); a *near miss* is a phrasing of a value of the second half,
which is never stored ("capital of France" stored, "capital of Spain" asked; "2+2" stored, "2+3"
asked) and must miss. `pairs()` is deterministic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvserve.train.cache_head import fill_question

COUNTRIES = ["France", "Spain", "Germany", "Italy", "Japan", "Brazil", "Canada", "Egypt", "India", "Mexico",
             "Kenya", "Norway", "Chile", "Peru", "Greece", "Turkey", "Poland", "Vietnam", "Sweden", "Argentina"]
PEOPLE = ["Albert Einstein", "Marie Curie", "Isaac Newton", "Ada Lovelace", "Charles Darwin", "Nikola Tesla",
          "Galileo Galilei", "Alan Turing", "Rosalind Franklin", "Leonardo da Vinci", "Jane Austen", "Mozart"]
LANGS = ["Python", "Java", "Rust", "Go", "JavaScript", "Haskell", "Ruby", "Kotlin", "Swift", "Scala"]
UNITS = [("miles", "kilometers"), ("pounds", "kilograms"), ("inches", "centimeters"), ("feet", "meters"),
         ("gallons", "liters"), ("ounces", "grams")]

INTENTS: list[tuple[str, list, list[str]]] = [
    ("capital", COUNTRIES, ["What is the capital of {x}?", "What's the capital city of {x}?",
                            "Which city is the capital of {x}?", "Tell me the capital of {x}.",
                            "what is {x}'s capital city", "Name the capital of {x}."]),
    ("currency", COUNTRIES, ["What currency is used in {x}?", "What is the currency of {x}?",
                             "Which currency does {x} use?", "What money do they use in {x}?",
                             "Tell me the official currency of {x}."]),
    ("population", COUNTRIES, ["What is the population of {x}?", "How many people live in {x}?",
                               "What's the population of {x}?", "How large is the population of {x}?",
                               "Tell me the population of {x}."]),
    ("language", COUNTRIES, ["What language do people speak in {x}?", "What is the official language of {x}?",
                             "Which language is spoken in {x}?", "What languages are spoken in {x}?"]),
    ("flag", COUNTRIES, ["What are the colors of the flag of {x}?", "What colors are on {x}'s flag?",
                         "Which colors does the flag of {x} have?", "What does the flag of {x} look like?",
                         "Describe the colors of the {x} flag."]),
    ("died", PEOPLE, ["When did {x} die?", "What year did {x} die?", "In which year did {x} pass away?",
                      "When was the death of {x}?", "Tell me when {x} died."]),
    ("born", PEOPLE, ["When was {x} born?", "What year was {x} born?", "What is the birth year of {x}?",
                      "In which year was {x} born?", "Tell me when {x} was born."]),
    ("known", PEOPLE, ["What is {x} known for?", "What is {x} famous for?", "Why is {x} famous?",
                       "What made {x} famous?", "Tell me what {x} is known for."]),
    ("reverse", LANGS, ["How do I reverse a list in {x}?", "How can I reverse a list in {x}?",
                        "What's the way to reverse a list in {x}?", "Reverse a list in {x}: how?",
                        "How to reverse a list in {x}?"]),
    ("readfile", LANGS, ["How do I read a file in {x}?", "How can I read a file in {x}?",
                         "How to read a file in {x}?", "What is the way to read a file in {x}?",
                         "Show me how to read a file in {x}."]),
    ("add", [(a, b) for a in range(2, 9) for b in range(2, 9)],
     ["What is {a}+{b}?", "What is {a} plus {b}?", "What's {a} + {b}?", "Calculate {a}+{b}.",
      "How much is {a} plus {b}?"]),
    ("mul", [(a, b) for a in range(3, 10) for b in range(11, 16)],
     ["What is {a}*{b}?", "What is {a} times {b}?", "What's {a} multiplied by {b}?", "Calculate {a} x {b}.",
      "How much is {a} times {b}?"]),
    ("convert", [(n, u) for n in (5, 10, 12, 20, 50) for u in UNITS],
     ["How many {u1} is {n} {u0}?", "Convert {n} {u0} to {u1}.", "What is {n} {u0} in {u1}?",
      "How much is {n} {u0} in {u1}?", "{n} {u0} to {u1}?"]),
]


@dataclass
class Pair:
    stored: str       # the stored query it is paired with
    query: str        # what is asked
    same: bool        # True: a paraphrase (must hit `stored`); False: a near miss (must miss everything)
    intent: str


def pairs(seed: int = 0) -> tuple[list[str], list[Pair]]:
    """(the queries to store, the pairs to ask): every stored query's other phrasings as
    paraphrases, and near misses: the same wording on a value never stored, and another question
    on the same value (when that question is not stored for it)."""
    rng = random.Random(seed)
    stored: list[str] = []
    out: list[Pair] = []
    kept: dict[str, list] = {}
    for intent, values, _ in INTENTS:
        vals = list(values)
        rng.shuffle(vals)
        kept[intent] = vals[:len(vals) // 2]
    for intent, values, phrasings in INTENTS:
        keep = kept[intent]
        other = [v for v in values if v not in keep]
        for i, v in enumerate(keep):
            first = rng.choice(phrasings)
            s = fill_question(first, v)
            stored.append(s)
            for p in phrasings:
                if p != first:
                    out.append(Pair(s, fill_question(p, v), True, intent))
            miss = other[i % len(other)]
            out.append(Pair(s, fill_question(first, miss), False, intent))
            out.append(Pair(s, fill_question(rng.choice(phrasings), miss), False, intent))
            out.append(Pair(s, fill_question(rng.choice(phrasings), other[(i + 1) % len(other)]), False, intent))
            for sib_intent, sib_values, sib_phrasings in INTENTS:   # same entity, another question
                if sib_intent != intent and sib_values is values and v not in kept[sib_intent]:
                    out.append(Pair(s, fill_question(rng.choice(sib_phrasings), v), False, sib_intent))
    return stored, out


def evaluate(threshold: float | list[float] | None = None, seed: int = 0, timed_lookups: int = 50,
             head: str = "default") -> dict:
    """Store every stored query in a fresh SemanticCache (SQLite in a temp dir, the real encoder),
    ask every pair, and count: paraphrase hits on the right entry, wrong-entry hits, false hits.
    The queries are embedded in one batch; `timed_lookups` of them also go through the full
    lookup one at a time, for its time (wall p50, and CPU ms of this process per lookup)."""
    import asyncio
    import statistics
    import tempfile
    import time
    from pathlib import Path

    from kvserve.semantic_text import normalize
    from kvserve.server.protocol import ChatCompletionRequest
    from kvserve.server.routing.embedder import Embedder
    from kvserve.server.routing.semantic_cache import CacheOptions, SemanticCache, SQLiteBackend, make_plan

    stored, asked = pairs(seed)
    thresholds = threshold if isinstance(threshold, list) else [threshold]
    options = CacheOptions(head=head) if thresholds[0] is None else CacheOptions(threshold=thresholds[0], head=head)
    thresholds = [options.threshold if t is None else t for t in thresholds]
    embedder = Embedder()

    def req(text: str) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=[{"role": "user", "content": text}], temperature=0)

    with tempfile.TemporaryDirectory() as d:
        cache = SemanticCache(SQLiteBackend(Path(d) / "c.db"), embedder, options)
        vs, _ = embedder.encode_sync([normalize(s) for s in stored])
        for s, v in zip(stored, vs):
            plan = make_plan(req(s), "m", None, options)
            plan.vector = cache.project(v.numpy())
            cache.store(plan, f"answer to {s}", "stop", 10, 5)
        vq, _ = embedder.encode_sync([normalize(p.query) for p in asked])
        same = sum(p.same for p in asked)
        sweep = []
        for th in thresholds:
            cache.options.threshold = th
            hits = wrong = false = 0
            for p, v in zip(asked, vq):
                hit = cache.match(make_plan(req(p.query), "m", None, options), v.numpy())
                if p.same:
                    hits += hit is not None and hit.entry.answer == f"answer to {p.stored}"
                    wrong += hit is not None and hit.entry.answer != f"answer to {p.stored}"
                else:
                    false += hit is not None
            sweep.append({"threshold": th, "hit_rate": round(hits / same, 4), "wrong_entry": wrong,
                          "false_hit_rate": round(false / (len(asked) - same), 4)})
        cache.options.threshold = thresholds[0]
        walls, cpu0 = [], time.process_time()
        for p in asked[:timed_lookups]:
            t = time.perf_counter()
            asyncio.run(cache.lookup(make_plan(req(p.query), "m", None, options)))
            walls.append(time.perf_counter() - t)
        cpu = time.process_time() - cpu0
        cache.close()
    first = sweep[0]
    return {"pairs": len(asked), "paraphrases": same, "near_misses": len(asked) - same,
            "hit_rate": first["hit_rate"], "wrong_entry": first["wrong_entry"],
            "false_hit_rate": first["false_hit_rate"], "threshold": first["threshold"],
            "lookup_cpu_ms": 1000 * cpu / max(1, len(walls)),
            "lookup_wall_p50_ms": 1000 * statistics.median(walls) if walls else None,
            **({"sweep": sweep} if len(sweep) > 1 else {})}


if __name__ == "__main__":
    import json
    import sys

    # python -m kvserve.bench.semantic_pairs [--head default|none|PATH] [threshold ...]: several
    # thresholds give a sweep
    argv = sys.argv[1:]
    head = "default"
    if argv[:1] == ["--head"] and len(argv) > 1:
        head, argv = argv[1], argv[2:]
    args = [float(a) for a in argv]
    print(json.dumps(evaluate(args if len(args) > 1 else (args[0] if args else None), head=head), indent=2))
