"""A synthetic web corpus with planted near-duplicates, for the cleaning tests and benchmark."""

from __future__ import annotations

import json
import random
from pathlib import Path

SYLLABLES = ["ka", "lo", "mi", "ter", "san", "vo", "rin", "du", "pel", "cor", "nia", "bra", "fen", "tos", "lur",
             "gai", "mon", "esh", "qui", "dal"]
TEMPLATES = ["The {a} {n} of the {n} {v} to the {n}.", "A {n} and that {n} {v} with the {a} {n}.",
             "They have {v} the {n} of {n} in the {a} {n}.", "It is the {n} that {v} with a {a} {n} to be {a}."]


def _vocab(rng: random.Random, n: int) -> list[str]:
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))))
    return sorted(words)


def make_document(rng: random.Random, nouns: list[str], verbs: list[str], adjs: list[str]) -> str:
    sentences = []
    for _ in range(rng.randint(14, 26)):
        t = rng.choice(TEMPLATES)
        out = []
        for part in t.split(" "):
            out.append(part.replace("{a}", rng.choice(adjs)).replace("{n}", rng.choice(nouns))
                       .replace("{v}", rng.choice(verbs)))
        sentences.append(" ".join(out))
    paras = [" ".join(sentences[i:i + 5]) for i in range(0, len(sentences), 5)]
    return "\n".join(paras)


def light_edit(rng: random.Random, text: str, vocab: list[str], rate: float = 0.03) -> str:
    """Replace, delete or insert about `rate` of the words (a near-duplicate)."""
    words = text.split(" ")
    out = []
    for w in words:
        r = rng.random()
        if r < rate / 3:
            out.append(rng.choice(vocab))
        elif r < 2 * rate / 3:
            continue
        elif r < rate:
            out.extend([w, rng.choice(vocab)])
        else:
            out.append(w)
    return " ".join(out)


def planted_corpus(n_unique: int, dup_fraction: float = 0.1, seed: int = 0) -> tuple[list[dict], dict[str, int]]:
    """(rows {"text", "source"} in shuffled order, source -> group id). Each group is one unique
    document and its light-edited near-duplicates; about `dup_fraction` of the rows are planted copies."""
    rng = random.Random(seed)
    vocab = _vocab(rng, 6000)
    nouns, verbs, adjs = vocab[:3000], vocab[3000:4500], vocab[4500:]
    rows, group = [], {}
    for g in range(n_unique):
        src = f"https://example.org/doc/{g}"
        text = make_document(rng, nouns, verbs, adjs)
        rows.append({"text": text, "source": src})
        group[src] = g
    n_dups = round(n_unique * dup_fraction / (1 - dup_fraction))
    for k in range(n_dups):
        g = rng.randrange(n_unique)
        src = f"https://mirror.example.net/copy/{k}"
        rows.append({"text": light_edit(rng, rows[g]["text"], vocab), "source": src})
        group[src] = g
    rng.shuffle(rows)
    return rows, group


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
