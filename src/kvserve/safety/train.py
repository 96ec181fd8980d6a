"""Train the moderation classifier: `python -m kvserve.safety.train [--check]`.

Reads `data/train.tsv` and the benign negatives (`data/benign_docs.txt`,
`data/benign_generated.txt`), fits one logistic regression per category (scikit-learn, liblinear)
on the hashed features of classifier.py restricted to the columns the data uses, and writes
`data/model.npz` (feature hashes, weights, biases, and each category's threshold, picked on the dev
split: `data/eval.tsv` and augment.py's dev rows, never on training rows). `--check` prints
precision and recall on `data/eval.tsv` afterwards.
"""

from __future__ import annotations

import sys

from kvserve.safety import augment
from kvserve.safety.classifier import DATA, LABELS, MODEL_PATH, TextClassifier, features, read_labelled

# A category's positives weigh 3 negatives: the 2,160 generated benign windows would otherwise pull
# recall down (held-out recall 0.81 at weight 1, 0.85 at 3; no generated dev window flagged at either).
POSITIVE_WEIGHT = 3.0
MAX_DEV_FPR = 0.01     # a threshold may flag at most this share of a category's dev negatives


def _lines(name: str) -> list[str]:
    path = DATA / name
    if not path.exists():
        return []
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip() and not line.startswith("#")]


def training_rows() -> list[tuple[set[str], str]]:
    """`data/train.tsv`, the counterfactual rows of augment.py, and two benign sets, negatives for
    every category: `benign_docs.txt` (sentences of kvserve's docs) and `benign_generated.txt`
    (windows of the default model's own answers as output moderation checks them;
    safety/generations.py writes it)."""
    benign = _lines("benign_docs.txt") + _lines("benign_generated.txt")
    return read_labelled(DATA / "train.tsv") + augment.rows("train") + [(set(), line) for line in benign]


def dev_rows() -> list[tuple[set[str], str]]:
    """The split thresholds are chosen on (never trained on): `data/eval.tsv` and augment.py's dev rows."""
    return read_labelled(DATA / "eval.tsv") + augment.rows("dev")


def pick_thresholds(model, rows: list[tuple[set[str], str]]) -> list[float]:
    """Per category, the threshold in [0.5, 0.95] with the best F1 on `rows` among those that flag
    at most MAX_DEV_FPR of the rows without that label (ties: the higher threshold). Never below
    0.5: the dev split is small, and lower thresholds it allowed flagged short benign prompts
    ("Describe a picnic.") that it does not contain."""
    scores = [model.scores(t) for _, t in rows]
    out = []
    for label in LABELS:
        pos = [s[label] for (ls, _), s in zip(rows, scores) if label in ls]
        neg = [s[label] for (ls, _), s in zip(rows, scores) if label not in ls]
        best = (-1.0, 0.5)
        for k in range(50, 96):
            t = k / 100
            fp = sum(x >= t for x in neg)
            if fp > MAX_DEV_FPR * len(neg):
                continue
            tp = sum(x >= t for x in pos)
            f1 = 2 * tp / (2 * tp + fp + len(pos) - tp) if pos else 0.0
            if f1 >= best[0]:
                best = (f1, t)
        out.append(best[1])
    return out


def fit(rows: list[tuple[set[str], str]], c: float = 300.0, positive_weight: float = 1.0,
        sample_weight: list[float] | None = None):
    """(hashes, weights (n_features, n_labels), bias) fitted on `rows`; a category's positives
    weigh `positive_weight` times a negative (times each row's `sample_weight`)."""
    import numpy as np
    from scipy.sparse import csr_matrix
    from sklearn.linear_model import LogisticRegression

    feats = [features(t) for _, t in rows]
    hashes = sorted({h for f in feats for h in f})
    col = {h: i for i, h in enumerate(hashes)}
    data, indices, indptr = [], [], [0]
    for f in feats:
        norm = sum(v * v for v in f.values()) ** 0.5 or 1.0
        for h, v in f.items():
            indices.append(col[h])
            data.append(v / norm)
        indptr.append(len(indices))
    x = csr_matrix((data, indices, indptr), shape=(len(rows), len(hashes)), dtype=np.float64)
    weights = np.zeros((len(hashes), len(LABELS)), dtype=np.float32)
    bias = np.zeros(len(LABELS), dtype=np.float32)
    for j, label in enumerate(LABELS):
        y = np.array([label in labels for labels, _ in rows], dtype=np.int8)
        model = LogisticRegression(C=c, solver="liblinear", max_iter=1000, class_weight={0: 1.0, 1: positive_weight})
        model.fit(x, y, sample_weight=None if sample_weight is None else np.asarray(sample_weight))
        weights[:, j] = model.coef_[0]
        bias[j] = model.intercept_[0]
    return np.asarray(hashes, dtype=np.uint32), weights, bias


def main(argv: list[str] | None = None) -> None:
    import numpy as np

    argv = sys.argv[1:] if argv is None else argv
    hashes, weights, bias = fit(training_rows(), positive_weight=POSITIVE_WEIGHT)
    weights = weights.astype(np.float16)
    thresholds = np.asarray(pick_thresholds(TextClassifier(hashes, weights, bias), dev_rows()), dtype=np.float32)
    np.savez_compressed(MODEL_PATH, hashes=hashes, weights=weights, bias=bias, thresholds=thresholds)
    print(f"wrote {MODEL_PATH} ({len(hashes)} features); thresholds "
          + ", ".join(f"{label} {t:.2f}" for label, t in zip(LABELS, thresholds)))
    if "--check" in argv:
        from kvserve.safety.evaluate import evaluate, format_table

        print(format_table(evaluate()))


if __name__ == "__main__":
    main()
