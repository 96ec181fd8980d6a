"""`kvserve train router`: the model router's classifier, a logistic regression over sentence
embeddings (all-MiniLM-L6-v2) that predicts how hard a prompt is.

Labels are difficulty levels: 0 "easy" (greetings, one-fact lookups, small arithmetic, yes/no),
1 "hard" (multi-step reasoning, code to write, long explanations, analysis). The router
(server/router.py) sends a prompt to the cheapest model whose level covers the predicted one.
`labelled_prompts()` generates the built-in labelled set from templates; `--data` takes your
own JSONL (`{"prompt": ..., "label": 0 | 1 | "easy" | "hard"}` per line). The result is a small
JSON file (classes, weights, bias, held-out accuracy): no pickle.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvserve.errors import InvalidRequest

LEVELS = {"easy": 0, "hard": 1}

_TOPICS = ["photosynthesis", "inflation", "black holes", "the French Revolution", "vaccines", "climate change",
           "blockchains", "the immune system", "supply and demand", "neural networks", "plate tectonics",
           "the Roman Empire", "compound interest", "quantum entanglement", "evolution", "the stock market"]
_THINGS = ["a linked list", "a binary search tree", "an LRU cache", "a rate limiter", "a JSON parser",
           "a thread pool", "a web scraper", "a tokenizer", "a priority queue", "a REST API", "a chess engine",
           "a matrix library", "a bloom filter", "a job scheduler"]
_LANGS = ["Python", "Rust", "Go", "C++", "Java", "TypeScript"]
_COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Norway", "Mexico", "Egypt", "Chile"]
_WORDS = ["ephemeral", "ubiquitous", "serendipity", "pragmatic", "benevolent", "resilient", "candid", "frugal"]

EASY = ["Hi!", "Hello, how are you?", "Thanks!", "Good morning.", "What is the capital of {c}?",
        "What currency does {c} use?", "What is {a} + {b}?", "What is {a} times {b}?", "Translate 'hello' to French.",
        "What does '{w}' mean?", "Give me a synonym for '{w}'.", "Is {c} in Europe?", "What time zone is {c} in?",
        "How do you spell '{w}'?", "What is the opposite of '{w}'?", "Name a fruit that is red.",
        "What day comes after Monday?", "How many days are in a week?", "What color is the sky?",
        "Convert {a} kilometers to meters.", "Who wrote Romeo and Juliet?", "What is {a} squared?"]
HARD = ["Explain {t} in detail, with its causes, consequences and an example.",
        "Write {x} in {l} with tests and explain the design choices.",
        "Compare {t} and {t2}: similarities, differences, and which matters more for policy, step by step.",
        "Prove that the square root of {a} is irrational, or explain why it is not.",
        "Debug this {l} code and explain the root cause: a function that leaks memory when {x} grows.",
        "Design {x} for a system with a million users; discuss trade-offs, failure modes and scaling.",
        ("A train leaves at {a} am at {b}0 km/h and another at {b} am at {a}0 km/h; when do they meet? Show "
        "the reasoning."), "Write an essay outline on {t} with arguments for and against.",
        "Refactor {x} in {l} to be thread-safe and explain every change.",
        "Summarize the history of {t} and analyze its impact on modern {c}.",
        "Derive the formula for {t} from first principles and explain each step.",
        "Plan a {a}-week study schedule to learn {l} well enough to implement {x}."]


def labelled_prompts(n_per_template: int = 12, seed: int = 0) -> list[tuple[str, int]]:
    """The built-in labelled set: (prompt, level) from the templates above, deterministic."""
    rng = random.Random(seed)
    out = []
    for level, templates in ((0, EASY), (1, HARD)):
        for t in templates:
            for _ in range(n_per_template if "{" in t else 1):
                topic, topic2 = rng.sample(_TOPICS, 2)
                out.append((t.format(c=rng.choice(_COUNTRIES), a=rng.randint(2, 9), b=rng.randint(2, 9),
                                     w=rng.choice(_WORDS), t=topic, t2=topic2, x=rng.choice(_THINGS),
                                     l=rng.choice(_LANGS)), level))
    return sorted(set(out))


def read_labelled(path: str | Path) -> list[tuple[str, int]]:
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            label = LEVELS.get(d["label"], d["label"]) if isinstance(d["label"], str) else int(d["label"])
            rows.append((str(d["prompt"]), int(label)))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidRequest(f"{path}:{i}: expected {{\"prompt\": ..., \"label\": 0|1|\"easy\"|\"hard\"}} "
                                 f"({e})", param="data") from None
    if len({label for _, label in rows}) < 2:
        raise InvalidRequest(f"{path}: needs prompts of at least two labels", param="data")
    return rows


def train_router(rows: list[tuple[str, int]], encoder=None, seed: int = 0) -> dict:
    """Fit the classifier on 80% of `rows`, report accuracy on the other 20%, refit on all."""
    from sklearn.linear_model import LogisticRegression

    from kvserve.model.bert import default_encoder

    enc = encoder or default_encoder()
    rng = random.Random(seed)
    rows = list(rows)
    rng.shuffle(rows)
    from kvserve.semantic_text import normalize

    # The router embeds the normalized text (the semantic cache's, so a request embeds once).
    X, _ = enc.encode([normalize(p) or " " for p, _ in rows])
    X = X.numpy()
    y = [label for _, label in rows]
    cut = int(len(rows) * 0.8)
    held = LogisticRegression(C=4.0, max_iter=2000).fit(X[:cut], y[:cut])
    accuracy = float((held.predict(X[cut:]) == y[cut:]).mean()) if cut < len(rows) else None
    clf = LogisticRegression(C=4.0, max_iter=2000).fit(X, y)
    return {"kind": "logistic_regression", "encoder": "all-minilm-l6-v2", "classes": [int(c) for c in clf.classes_],
            "coef": clf.coef_.tolist(), "intercept": clf.intercept_.tolist(), "heldout_accuracy": accuracy,
            "examples": len(rows), "normalized": True}
