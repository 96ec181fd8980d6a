"""Per source and per category: precision, recall, F1 and the benign false-positive rate of a
moderation scorer on a split of datasets.py's sources (`kvserve eval moderation --data DIR`).

Harmful-vs-benign: a row is harmful when it has any label, flagged when any category is flagged.
`flagged(rows) -> list[set[str]]` is the scorer; `new_flags` (the head) and `old_flags` (the
hashed n-gram classifier it replaced) are the two this repository has.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

from kvserve.safety.datasets import HEADS, Row, load

Scorer = Callable[[list[Row]], list[set[str]]]


def new_flags(data_dir: pathlib.Path, head_path: pathlib.Path | None = None) -> Scorer:
    from kvserve.safety import head as head_mod
    from kvserve.safety.train_head import row_windows

    h = head_mod.load(head_path)

    def run(rows: list[Row]) -> list[set[str]]:
        if h.top:           # the head judges its tuned top layers' vectors (safety/finetune.py)
            from kvserve.safety.finetune import tuned_vectors

            wins = [head_mod.windows(r.text) for r in rows]
            flat = tuned_vectors([w for ws in wins for w in ws], h, pathlib.Path(data_dir))
            vecs, i = [], 0
            for ws in wins:
                vecs.append(flat[i:i + len(ws)])
                i += len(ws)
        else:
            vecs = row_windows(rows, pathlib.Path(data_dir) / ".embeddings.npz", h.layers)
        out = []
        for v in vecs:
            s = h.scores(v)
            flagged = {c for c in HEADS if s[c] >= h.thresholds[c]}
            out.append(flagged if s.get("help", 0.0) < h.thresholds.get("help", 2.0) else set())
        return out
    return run


def old_flags() -> Scorer:
    from kvserve.safety.classifier import LABELS
    from kvserve.safety.moderator import ModerationConfig, Moderator

    mod = Moderator(ModerationConfig(jailbreak=False), engine="ngram")

    def run(rows: list[Row]) -> list[set[str]]:
        out = []
        for r in rows:
            v = mod.check(r.text, input=False)
            flagged = {c for c in LABELS if v.categories.get(c)}
            flagged |= {c for c in ("sexual/minors", "violence/graphic", "illicit/violent") if v.categories.get(c)}
            out.append(flagged)
        return out
    return run


def _prf(tp: int, fp: int, fn: int) -> dict[str, float | None]:
    p = tp / (tp + fp) if tp + fp else None
    r = tp / (tp + fn) if tp + fn else None
    f = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else None
    return {"precision": p, "recall": r, "f1": f}


def report(rows: list[Row], flags: list[set[str]]) -> dict[str, Any]:
    out: dict[str, Any] = {"sources": {}, "categories": {}}
    for src in sorted({r.source for r in rows}) + ["all"]:
        idx = [i for i, r in enumerate(rows) if src in ("all", r.source)]
        harm = [i for i in idx if rows[i].harmful]
        ben = [i for i in idx if not rows[i].harmful]
        tp = sum(bool(flags[i]) for i in harm)
        fp = sum(bool(flags[i]) for i in ben)
        out["sources"][src] = {"harmful": len(harm), "benign": len(ben), **_prf(tp, fp, len(harm) - tp),
                               "benign_fpr": fp / len(ben) if ben else None}
    for c in HEADS:
        tp = sum(c in f and c in r.labels for r, f in zip(rows, flags))
        fp = sum(c in f and c not in r.labels for r, f in zip(rows, flags))
        fn = sum(c not in f and c in r.labels for r, f in zip(rows, flags))
        out["categories"][c] = {"support": tp + fn, **_prf(tp, fp, fn)}
    return out


def evaluate(data_dir: pathlib.Path, split: str = "test", scorers: dict[str, Scorer] | None = None) -> dict[str, Any]:
    rows = [r for r in load(data_dir) if r.split == split]
    scorers = scorers or {"new": new_flags(data_dir), "old": old_flags()}
    return {name: report(rows, fn(rows)) for name, fn in scorers.items()}


def format_report(rep: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    names = list(rep)
    lines = ["| source | harmful | benign | " + " | ".join(f"{n} P / R / F1 / benign FP" for n in names) + " |",
             "|---|---:|---:|" + "---|" * len(names)]
    for src, s in rep[names[0]]["sources"].items():
        cells = [f"{f(rep[n]['sources'][src]['precision'])} / {f(rep[n]['sources'][src]['recall'])} / "
                 f"{f(rep[n]['sources'][src]['f1'])} / {f(rep[n]['sources'][src]['benign_fpr'])}" for n in names]
        lines.append(f"| {src} | {s['harmful']} | {s['benign']} | " + " | ".join(cells) + " |")
    lines += ["", "| category | support | " + " | ".join(f"{n} P / R / F1" for n in names) + " |",
              "|---|---:|" + "---|" * len(names)]
    for c, s in rep[names[0]]["categories"].items():
        cells = [f"{f(rep[n]['categories'][c]['precision'])} / {f(rep[n]['categories'][c]['recall'])} / "
                 f"{f(rep[n]['categories'][c]['f1'])}" for n in names]
        lines.append(f"| {c} | {s['support']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
