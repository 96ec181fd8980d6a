"""How far the moderation thresholds move between two retrains on slightly different data:
`python -m kvserve.safety.threshold_stability DIR` (BENCHMARKS.md, issue 59, "data and thresholds").

Each retrain drops a different 3% of the `train` and `val` rows (by a salted hash of the text);
thresholds are picked the old way (fit on `train`, thresholds on `val` alone) and the current way
(train_head.py: pooled out-of-fold scores over `train` and `val`). It prints both pairs of
thresholds and their differences. 36 fits on one BLAS thread: 10-25 minutes on the shared machine.
"""

from __future__ import annotations

import pathlib
import sys
import zlib

import numpy as np

from kvserve.safety import head as head_mod
from kvserve.safety import train_head as th
from kvserve.safety.datasets import OUTPUTS, load

DROP_PERCENT = 3


def thresholds(data_dir: pathlib.Path, salt: bytes) -> dict[str, list[float]]:
    cache = data_dir / ".embeddings.npz"
    rows = [r for r in load(data_dir) if r.split in ("train", "val")
            and zlib.crc32(salt + r.text.encode()) % 100 >= DROP_PERCENT]
    wins = th.row_windows(rows, cache, th.LAYERS)
    x = th.embed([head_mod.train_text(r.text) for r in rows], cache, th.LAYERS)
    y, mask = th._targets(rows), th._mask(rows)
    wt = np.ones(len(rows), np.float32)
    benign = np.array([not r.harmful for r in rows])
    tr = np.array([r.split == "train" for r in rows])
    va = np.flatnonzero(np.array([r.split == "val" for r in rows]))
    h, _ = th.fit_rounds(x[tr], y[tr], mask[tr], wt[tr])
    out = {"val": th.pick_thresholds(np.stack([h.probs(wins[i]).max(0) for i in va]), y[va], benign[va])}
    can = np.array([th._trainable(r) for r in rows])
    fold = np.array([th.fold_of(r.text) for r in rows])
    oof = np.zeros((len(rows), len(OUTPUTS)), np.float32)
    for k in range(th.FOLDS):
        fit = np.flatnonzero(can & (fold != k))
        h, _ = th.fit_rounds(x[fit], y[fit], mask[fit], wt[fit])
        for i in np.flatnonzero(fold == k):
            oof[i] = h.probs(wins[i]).max(0)
    out["pooled folds"] = th.pick_thresholds(oof, y, benign)
    return out


def main(argv: list[str] | None = None) -> None:
    from threadpoolctl import threadpool_limits

    data_dir = pathlib.Path((argv or sys.argv[1:])[0])
    with threadpool_limits(limits=1):
        a, b = thresholds(data_dir, b"a"), thresholds(data_dir, b"b")
    for rule in a:
        d = np.array(a[rule]) - np.array(b[rule])
        print(f"{rule}: max |diff| {np.abs(d).max():.2f}, mean {np.abs(d).mean():.3f}")
        for lab, t1, t2 in zip(OUTPUTS, a[rule], b[rule]):
            print(f"  {lab:18s} {t1:.2f} {t2:.2f}")


if __name__ == "__main__":
    main()
