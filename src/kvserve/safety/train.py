"""Train the moderation classifier: `python -m kvserve.safety.train [--check]`.

Reads `data/train.tsv` (and the benign sentences of `data/benign_docs.txt`), fits one logistic regression per category (scikit-learn, liblinear) on
the hashed features of classifier.py restricted to the columns the data uses, and writes
`data/model.npz` (feature hashes, weights, biases). `--check` prints precision and recall on the
held-out `data/eval.tsv` afterwards.
"""

from __future__ import annotations

import sys

from kvserve.safety.classifier import DATA, LABELS, MODEL_PATH, features, read_labelled


def training_rows() -> list[tuple[set[str], str]]:
    """`data/train.tsv` plus `data/benign_docs.txt` (sentences of kvserve's docs, all benign)."""
    docs = [line for line in (DATA / "benign_docs.txt").read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")]
    return read_labelled(DATA / "train.tsv") + [(set(), line) for line in docs]


def fit(rows: list[tuple[set[str], str]], c: float = 300.0):
    """(hashes, weights (n_features, n_labels), bias) fitted on `rows`."""
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
        model = LogisticRegression(C=c, solver="liblinear", max_iter=1000)
        model.fit(x, y)
        weights[:, j] = model.coef_[0]
        bias[j] = model.intercept_[0]
    return np.asarray(hashes, dtype=np.uint32), weights, bias


def main(argv: list[str] | None = None) -> None:
    import numpy as np

    argv = sys.argv[1:] if argv is None else argv
    hashes, weights, bias = fit(training_rows())
    np.savez_compressed(MODEL_PATH, hashes=hashes, weights=weights.astype(np.float16),
                        bias=bias)
    print(f"wrote {MODEL_PATH} ({len(hashes)} features)")
    if "--check" in argv:
        from kvserve.safety.evaluate import evaluate, format_table

        print(format_table(evaluate()))


if __name__ == "__main__":
    main()
