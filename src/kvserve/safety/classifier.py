"""The moderation classifier: hashed n-gram features and one logistic regression per category.

Features are word unigrams and bigrams plus character 2-5-grams inside word boundaries, each
hashed with CRC-32, counted and l2-normalised, so there is no vocabulary to maintain and an
unseen word still shares character n-grams with known ones. Each category is a binary logistic
regression trained (`python -m kvserve.safety.train`, scikit-learn, about a second) on
`data/train.tsv`: a few hundred labelled lines with benign near-misses ("kill the process",
"shoot a photo") among the negatives. Only features seen in training have weights, so the
shipped model (`data/model.npz`) is small, and a check needs numpy alone: featurise in Python,
then a sum of weight rows, well under a millisecond for a paragraph.
"""

from __future__ import annotations

import itertools
import pathlib
import re
import threading
import zlib
from collections import Counter

LABELS = ("harassment", "hate", "self-harm", "sexual", "violence", "illicit")
DATA = pathlib.Path(__file__).with_name("data")
MODEL_PATH = DATA / "model.npz"
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def features(text: str) -> Counter[int]:
    """Hashed feature counts of one text (lowercased): words, word bigrams, char 2-5-grams."""
    words = _WORD.findall(text.lower())
    grams: list[str] = ["w " + w for w in words]
    grams += ["b " + a + " " + b for a, b in itertools.pairwise(words)]
    for w in words:
        p = " " + w + " "
        n = len(p)
        for k in (2, 3, 4, 5):
            grams += [p[i:i + k] for i in range(n - k + 1)]
    return Counter(zlib.crc32(g.encode()) for g in grams)


def read_labelled(path: pathlib.Path) -> list[tuple[set[str], str]]:
    """(labels, text) per line of a `labels<TAB>text` file; "benign" is the empty set."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        labels, text = line.split("\t", 1)
        out.append(({x for x in labels.split(",") if x != "benign"}, text))
    return out


class TextClassifier:
    """Per-category probabilities: sigmoid(normalised feature counts . weights + bias)."""

    def __init__(self, hashes, weights, bias):
        import numpy as np

        self.index = {int(h): i for i, h in enumerate(hashes)}
        self.weights = np.asarray(weights, dtype=np.float32)   # (n_features, n_labels)
        self.bias = np.asarray(bias, dtype=np.float32)

    def scores(self, text: str) -> dict[str, float]:
        import numpy as np

        counts = features(text)
        norm = float(sum(c * c for c in counts.values())) ** 0.5 or 1.0
        rows, vals = [], []
        for h, c in counts.items():
            i = self.index.get(h)
            if i is not None:
                rows.append(i)
                vals.append(c / norm)
        logits = self.bias.copy()
        if rows:
            logits += np.asarray(vals, dtype=np.float32) @ self.weights[rows]
        probs = 1.0 / (1.0 + np.exp(-logits))
        return {label: round(float(p), 6) for label, p in zip(LABELS, probs)}


_lock = threading.Lock()
_model: TextClassifier | None = None


def default_classifier() -> TextClassifier:
    """The shipped model (`data/model.npz`), loaded once per process."""
    global _model
    with _lock:
        if _model is None:
            import numpy as np

            z = np.load(MODEL_PATH)
            _model = TextClassifier(z["hashes"], z["weights"], z["bias"])
        return _model
