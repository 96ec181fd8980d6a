"""`kvserve train router`: the model router's classifier, a logistic regression over a sentence
feature (all-MiniLM-L6-v2's hidden states after its first `layers` layers, mean-pooled) that
predicts how hard a prompt is.

Why a shallow feature: easy-or-hard is a question of words and shape ("write ... with tests",
"explain in detail" against "hi", "what is 3 + 4"), which the first layers already carry, and a
router alone then runs a third of the encoder. On held-out prompts unlike the templates
(`HELD_OUT`, hand-written) and leaving whole templates out, the first two layers do as
well as the full embedding or better (docs/routing.md gives the measurement).

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


DEFAULT_LAYERS = 2

# Hand-written prompts in none of the templates' shapes: the check that the classifier learned
# easy-or-hard and not the templates.
HELD_OUT = [
    ("hey there", 0), ("Thank you so much!", 0), ("What's 7 plus 5?", 0), ("Who painted the Mona Lisa?", 0),
    ("What is the boiling point of water?", 0), ("What is the largest planet?", 0), ("Is a tomato a fruit?", 0),
    ("How many legs does a spider have?", 0), ("What's the capital of Australia?", 0), ("Good night!", 0),
    ("Spell 'necessary'.", 0), ("What year did World War II end?", 0), ("How many minutes are in an hour?", 0),
    ("Who is the author of Harry Potter?", 0), ("What's the chemical symbol for gold?", 0),
    ("What is 12 divided by 4?", 0), ("Which ocean is the largest?", 0), ("Say hi to my friend Sam.", 0),
    ("What language is spoken in Brazil?", 0), ("Is it spelled 'color' or 'colour' in the US?", 0),
    ("Implement Dijkstra's algorithm in Java and analyze its time complexity.", 1),
    ("Explain how TCP congestion control works, step by step.", 1),
    ("Write a detailed business plan for a small bakery, with costs and risks.", 1),
    ("Why did the Soviet Union collapse? Discuss the economic and political causes.", 1),
    ("Create a Python script that scrapes a website and stores the results in SQLite, with error handling.", 1),
    ("Analyze the themes of Hamlet and compare them with those of Macbeth.", 1),
    ("Design a database schema for a hospital and justify each table and index.", 1),
    ("Walk me through training a neural network from scratch, including backpropagation math.", 1),
    ("Write a short story outline, then critique its pacing and characters.", 1),
    ("Optimize this SQL query that joins five tables and explain the execution plan trade-offs.", 1),
    ("Explain the differences between Keynesian and Austrian economics with historical examples.", 1),
    ("Build a React component for an infinite-scroll feed and explain how it avoids memory leaks.", 1),
    ("Solve this: a tank fills in 6 hours and drains in 9; how long to fill with both open? Explain.", 1),
    ("Describe how a compiler turns source code into machine code, covering each phase in depth.", 1),
    ("Evaluate the pros and cons of nuclear energy for a country's energy policy over 30 years.", 1),
    ("Write a bash script that backs up a directory incrementally, rotates old backups and logs errors.", 1),
    ("Explain the proof of the Pythagorean theorem and two alternative proofs.", 1),
    ("Migrate a monolith to microservices: give a plan, the risks and how to roll back.", 1),
    ("Translate this paragraph into French and explain the grammar choices you made.", 1),
    ("Write unit tests for a date-parsing library covering time zones and leap years.", 1),
]


def train_router(rows: list[tuple[str, int]], encoder=None, seed: int = 0, layers: int | None = DEFAULT_LAYERS) -> dict:
    """Fit the classifier on 80% of `rows`, report accuracy on the other 20% and on `HELD_OUT`,
    refit on all. `layers`: the encoder depth of the feature (None: the full embedding)."""
    from sklearn.linear_model import LogisticRegression

    from kvserve.model.bert import default_encoder

    enc = encoder or default_encoder()
    depth = enc.layers if layers is None else layers
    if not 0 <= depth <= enc.layers:
        raise InvalidRequest(f"layers={layers}: the encoder has {enc.layers} layers (0 = its embedding layer)",
                             param="layers")
    rng = random.Random(seed)
    rows = list(rows)
    rng.shuffle(rows)
    from kvserve.semantic_text import normalize

    def features(prompts: list[str]):
        # The router embeds the normalized text (the semantic cache's, so a request runs one forward).
        vecs, _ = enc.encode_depths([normalize(p) or " " for p in prompts], (depth,))
        return vecs[depth].numpy()

    X = features([p for p, _ in rows])
    y = [label for _, label in rows]
    cut = int(len(rows) * 0.8)
    held = LogisticRegression(C=4.0, max_iter=2000).fit(X[:cut], y[:cut])
    accuracy = float((held.predict(X[cut:]) == y[cut:]).mean()) if cut < len(rows) else None
    clf = LogisticRegression(C=4.0, max_iter=2000).fit(X, y)
    out = {"kind": "logistic_regression", "encoder": "all-minilm-l6-v2", "classes": [int(c) for c in clf.classes_],
           "coef": clf.coef_.tolist(), "intercept": clf.intercept_.tolist(), "heldout_accuracy": accuracy,
           "examples": len(rows), "normalized": True}
    if set(out["classes"]) == {0, 1}:
        hx = features([p for p, _ in HELD_OUT])
        out["handwritten_accuracy"] = float((clf.predict(hx) == [lab for _, lab in HELD_OUT]).mean())
    if layers is not None:
        out["layers"] = depth
    return out
