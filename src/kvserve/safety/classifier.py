"""The moderation classifier: hashed n-gram features and one logistic regression per category.

Features are word unigrams and bigrams plus character 2-5-grams inside word boundaries, each
hashed (CRC-32 for words, a polynomial hash in numpy for character grams), counted and l2-normalised, so there is no vocabulary to maintain and an
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
_PRIME = 1_000_003
_MIX = 0xBF58476D1CE4E5B9


def feature_counts(text: str):
    """(hashes, counts) of one text's features (lowercased): unique uint32 hashes and their counts.

    Words and word bigrams are hashed with CRC-32 in Python (a few hundred per paragraph); the
    character 2-5-grams, most of the features, in numpy: each word padded with a space on either
    side, the code points of all of them in one array, a polynomial hash of every k-gram that stays
    inside its padded word, mixed with k and scrambled (a 2,000-character message in well under a
    millisecond, where hashing each gram in Python took about 10 ms)."""
    import numpy as np

    words = _WORD.findall(text.lower())
    named = ["w " + w for w in words] + ["b " + a + " " + b for a, b in itertools.pairwise(words)]
    parts = [np.fromiter((zlib.crc32(g.encode()) for g in named), dtype=np.uint64, count=len(named))]
    if words:
        padded = "".join(" " + w + " " for w in words)
        codes = np.frombuffer(padded.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
        seg = np.repeat(np.arange(len(words)), [len(w) + 2 for w in words])
        n = len(codes)
        for k in (2, 3, 4, 5):
            if n < k:
                break
            h = np.zeros(n - k + 1, dtype=np.uint64)
            for j in range(k):
                h = h * _PRIME + codes[j:n - k + 1 + j]
            h = h[seg[:n - k + 1] == seg[k - 1:]] ^ np.uint64(k * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF)
            h ^= h >> np.uint64(33)
            h *= _MIX
            h ^= h >> np.uint64(29)
            parts.append(h & np.uint64(0xFFFFFFFF))
    hashes, counts = np.unique(np.concatenate(parts).astype(np.uint32), return_counts=True)
    return hashes, counts


def features(text: str) -> Counter[int]:
    """Hashed feature counts of one text (lowercased): words, word bigrams, char 2-5-grams."""
    hashes, counts = feature_counts(text)
    return Counter(dict(zip(hashes.tolist(), counts.tolist())))


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

    def __init__(self, hashes, weights, bias, thresholds=None):
        import numpy as np

        order = np.argsort(np.asarray(hashes, dtype=np.uint32), kind="stable")
        self.hashes = np.asarray(hashes, dtype=np.uint32)[order]        # sorted: looked up by searchsorted
        self.weights = np.asarray(weights, dtype=np.float32)[order]    # (n_features, n_labels)
        self.bias = np.asarray(bias, dtype=np.float32)
        # each category's default threshold, chosen on a dev split by train.py (0.5 for an older model)
        self.thresholds = dict(zip(LABELS, map(float, thresholds))) if thresholds is not None else \
            dict.fromkeys(LABELS, 0.5)

    def scores(self, text: str) -> dict[str, float]:
        import numpy as np

        hashes, counts = feature_counts(text)
        counts = counts.astype(np.float32)
        norm = float(np.sqrt(np.dot(counts, counts))) or 1.0
        logits = self.bias.copy()
        if len(hashes) and len(self.hashes):
            pos = np.minimum(np.searchsorted(self.hashes, hashes), len(self.hashes) - 1)
            known = self.hashes[pos] == hashes
            if known.any():
                logits += (counts[known] / norm) @ self.weights[pos[known]]
        probs = 1.0 / (1.0 + np.exp(-logits))
        return {label: round(float(p), 6) for label, p in zip(LABELS, probs)}


_lock = threading.Lock()
_model: TextClassifier | None = None


def default_classifier() -> TextClassifier:
    """The shipped model (`data/model.npz`), loaded once per process."""
    global _model
    with _lock:
        if _model is None:

            _model = load(MODEL_PATH)
        return _model


def load(path: pathlib.Path) -> TextClassifier:
    import numpy as np

    z = np.load(path)
    return TextClassifier(z["hashes"], z["weights"], z["bias"], z.get("thresholds", None))
