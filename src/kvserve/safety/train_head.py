"""`kvserve train moderation --data DIR`: rebuild the shipped moderation head (data/head.npz).

1. datasets.load(DIR): every source's rows with labels and a train/val/test split;
2. each text's embedding with the shipped encoder (cached in DIR/.embeddings.npz, keyed by text);
   a text is trained on as its first 800 characters (head.train_text: a label is the whole text's,
   so not every sentence group of it carries it) and judged, for thresholds, over its windows;
3. the head (head.py) fitted on `train` rows: a one-hidden-layer MLP (numpy, full-batch Adam,
   fixed seed, one BLAS thread: the same data gives the same head bit for bit), then HARD_ROUNDS
   hard-negative rounds: the benign training rows the last fit scored >= 0.5 in a category weigh
   HARD_WEIGHT times more in the next fit (ordinary text that reads like harm: the false positives);
4. each category's threshold: on `val` rows (never `train`, never `test`), the one with the best
   F1 among those that flag at most MAX_VAL_FPR of the benign validation rows.
"""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np

from kvserve.safety import head as head_mod
from kvserve.safety.datasets import HEADS, OUTPUTS, Row, load

HIDDEN = 64
EPOCHS = 400
LR = 3e-3
WEIGHT_DECAY = 1e-4
MAX_VAL_FPR = 0.005
SEED = 0
HARD_ROUNDS = 2
HARD_WEIGHT = 3.0
# sources whose rows weigh more from the first fit: the benign texts that read most like harm
# (forum text, statements about groups, requests with the words of violence) are a small share
# of the benign rows next to the Alpaca instructions
SOURCE_WEIGHTS: dict[str, float] = {}


def _key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def embed(texts: list[str], cache: pathlib.Path | None = None) -> np.ndarray:
    """[n, 384] unit embeddings (the encoder's, batched), cached by text in `cache`."""
    known: dict[str, np.ndarray] = {}
    if cache is not None and cache.exists():
        with np.load(cache) as z:
            known = dict(zip(z["keys"].tolist(), z["vecs"]))
    missing = sorted({t for t in texts if _key(t) not in known}, key=len)
    if missing:
        from kvserve.model.bert import default_encoder

        enc = default_encoder()
        for i in range(0, len(missing), 32):
            vecs, _ = enc.encode(missing[i:i + 32])
            for t, v in zip(missing[i:i + 32], vecs.numpy()):
                known[_key(t)] = v.astype(np.float32)
        if cache is not None:
            np.savez(cache, keys=np.array(list(known)), vecs=np.stack(list(known.values())))
    return np.stack([known[_key(t)] for t in texts]) if texts else np.zeros((0, 384), np.float32)


def row_windows(rows: list[Row], cache: pathlib.Path | None) -> list[np.ndarray]:
    """Per row, its windows' embeddings ([k, 384])."""
    wins = [head_mod.windows(r.text) for r in rows]
    flat = embed([w for ws in wins for w in ws], cache)
    out, i = [], 0
    for ws in wins:
        out.append(flat[i:i + len(ws)])
        i += len(ws)
    return out


def _targets(rows: list[Row]) -> np.ndarray:
    return np.array([[lab in r.labels for lab in OUTPUTS] for r in rows], dtype=np.float32)


def _mask(rows: list[Row]) -> np.ndarray:
    """1 where a row's target counts: the hand-written benign sensitive set holds some unlabelled
    help-seeking texts, so it is no negative for `help`."""
    m = np.ones((len(rows), len(OUTPUTS)), dtype=np.float32)
    m[[i for i, r in enumerate(rows) if r.source == "kvserve_sensitive"], OUTPUTS.index("help")] = 0.0
    return m


def fit_mlp(x: np.ndarray, y: np.ndarray, hidden: int = HIDDEN, epochs: int = EPOCHS, seed: int = SEED,
            mask: np.ndarray | None = None, row_weights: np.ndarray | None = None):
    """(w1, b1, w2, b2): ReLU layer then per-category sigmoids, weighted BCE (a category's positives
    weigh its negatives in total, capped at 20x; `row_weights` on top), full-batch Adam."""
    rng = np.random.default_rng(seed)
    n, d = x.shape
    k = y.shape[1]
    pos = y.sum(0)
    wpos = np.minimum((n - pos) / np.maximum(pos, 1), 20.0).astype(np.float32)
    params = [rng.normal(0, 1 / np.sqrt(d), (hidden, d)).astype(np.float32), np.zeros(hidden, np.float32),
              rng.normal(0, 1 / np.sqrt(hidden), (k, hidden)).astype(np.float32), np.zeros(k, np.float32)]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for step in range(1, epochs + 1):
        w1, b1, w2, b2 = params
        h_pre = x @ w1.T + b1
        h = np.maximum(h_pre, 0)
        p = 1 / (1 + np.exp(-np.clip(h @ w2.T + b2, -30, 30)))
        wt = np.where(y > 0, wpos, 1.0) * (1.0 if mask is None else mask)
        if row_weights is not None:
            wt = wt * row_weights[:, None]
        g = wt * (p - y) / n                           # d loss / d logits
        grads = [None, None, g.T @ h, g.sum(0)]
        gh = (g @ w2) * (h_pre > 0)
        grads[0], grads[1] = gh.T @ x, gh.sum(0)
        for i, (pa, gr) in enumerate(zip(params, grads)):
            if pa.ndim == 2:
                gr = gr + WEIGHT_DECAY * pa
            m[i] = 0.9 * m[i] + 0.1 * gr
            v[i] = 0.999 * v[i] + 0.001 * gr * gr
            pa -= LR * (m[i] / (1 - 0.9 ** step)) / (np.sqrt(v[i] / (1 - 0.999 ** step)) + 1e-8)
    return params


def pick_thresholds(probs: np.ndarray, y: np.ndarray, benign: np.ndarray) -> list[float]:
    """Per category, on validation rows: the best-F1 threshold in [0.3, 0.97] that flags at most
    MAX_VAL_FPR of the benign rows (ties: the higher one); for `help`, that passes at most
    MAX_VAL_FPR of the harmful rows as help-seeking."""
    out = []
    for j in range(y.shape[1]):
        pos = probs[y[:, j] > 0, j]
        neg = probs[y[:, j] == 0, j]
        negb = probs[~benign, j] if OUTPUTS[j] == "help" else probs[benign, j]
        best = (-1.0, 0.9)
        for t in np.arange(0.30, 0.975, 0.01):
            if (negb >= t).mean() > MAX_VAL_FPR:
                continue
            tp = float((pos >= t).sum())
            fp = float((neg >= t).sum())
            f1 = 2 * tp / (2 * tp + fp + len(pos) - tp) if len(pos) else 0.0
            if f1 >= best[0]:
                best = (f1, round(float(t), 2))
        out.append(best[1])
    return out


def train(data_dir: pathlib.Path, out: pathlib.Path | None = None, hidden: int = HIDDEN) -> dict:
    """Fit on one BLAS thread: another thread count sums in another order, and 400 Adam steps
    carry that into different weights and thresholds (so the head is the same on every machine)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:             # scikit-learn's dependency (the `safety` extra): without it, set OPENBLAS_NUM_THREADS=1
        import contextlib

        def threadpool_limits(limits: int):
            return contextlib.nullcontext()
    with threadpool_limits(limits=1):
        return _train(data_dir, out, hidden)


def _train(data_dir: pathlib.Path, out: pathlib.Path | None, hidden: int) -> dict:
    rows = load(data_dir)
    cache = pathlib.Path(data_dir) / ".embeddings.npz"
    tr = [i for i, r in enumerate(rows) if r.split == "train"]
    va = [i for i, r in enumerate(rows) if r.split == "val"]
    vecs = dict(zip(va, row_windows([rows[i] for i in va], cache)))
    x = embed([head_mod.train_text(rows[i].text) for i in tr], cache)
    y = _targets([rows[i] for i in tr])
    mask = _mask([rows[i] for i in tr])
    weights = np.array([SOURCE_WEIGHTS.get(rows[i].source, 1.0) for i in tr], np.float32)
    benign = ~y[:, :len(HEADS)].any(1)
    hard_counts = []
    for rnd in range(HARD_ROUNDS + 1):
        w1, b1, w2, b2 = fit_mlp(x, y, hidden=hidden, mask=mask, row_weights=weights)
        tmp = head_mod.Head({"labels": np.array(OUTPUTS), "w1": w1, "b1": b1, "w2": w2, "b2": b2,
                             "thresholds": np.zeros(len(OUTPUTS))})
        if rnd < HARD_ROUNDS:
            hard = benign & (tmp.probs(x)[:, :len(HEADS)].max(1) >= 0.5)
            weights = np.where(hard, weights * HARD_WEIGHT, weights).astype(np.float32)
            hard_counts.append(int(hard.sum()))
    pv = np.stack([tmp.probs(vecs[i]).max(0) for i in va])
    yv = _targets([rows[i] for i in va])
    thresholds = pick_thresholds(pv, yv, np.array([not rows[i].harmful for i in va]))
    path = out or head_mod.HEAD_PATH
    head_mod.save(path, w1=w1, b1=b1, w2=w2, b2=b2, thresholds=thresholds)
    return {"path": str(path), "rows": len(rows), "train": len(tr), "val": len(va), "hard_negatives": hard_counts,
            "bytes": path.stat().st_size, "thresholds": dict(zip(OUTPUTS, thresholds))}
