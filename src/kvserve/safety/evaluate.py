"""Precision and recall per category on the held-out labelled set (`data/eval.tsv`).

`python -m kvserve.safety.evaluate` prints the table that docs/safety.md quotes; a text counts as
flagged in a category when the moderator's score reaches the threshold. The last row, `any`, is
flagged vs not flagged over all texts (benign near-misses included). `--profanity-check` adds the
same rows for alt-profanity-check's one score, for comparison; `--blind` the rows on the second
held-out set (`data/eval_blind.tsv`), written in one go before the classifier was run on it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from kvserve.safety.classifier import DATA, LABELS, read_labelled

BLIND_PATH = DATA / "eval_blind.tsv"
from kvserve.safety.moderator import ModerationConfig, Moderator


@dataclass
class Row:
    category: str
    support: int
    tp: int
    fp: int
    fn: int

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0


# eval.tsv labels a violent how-to request illicit/violent too (safety/labelling.py): its own row
REPORTED = (*LABELS, "illicit/violent")


def _rows(labelled, predicted) -> list[Row]:
    rows = []
    for cat in (*REPORTED, "any"):
        def has(labels, cat=cat):
            return bool(labels) if cat == "any" else cat in labels
        tp = sum(1 for (t, _), p in zip(labelled, predicted) if has(t) and has(p))
        fp = sum(1 for (t, _), p in zip(labelled, predicted) if not has(t) and has(p))
        fn = sum(1 for (t, _), p in zip(labelled, predicted) if has(t) and not has(p))
        rows.append(Row(cat, sum(1 for t, _ in labelled if has(t)), tp, fp, fn))
    return rows


def evaluate(config: ModerationConfig | None = None, path=DATA / "eval.tsv") -> list[Row]:
    labelled = read_labelled(path)
    mod = Moderator(config or ModerationConfig(jailbreak=False))
    predicted = []
    for _, text in labelled:
        v = mod.check(text)
        predicted.append({c for c in REPORTED if v.categories[c]})
    return _rows(labelled, predicted)


def evaluate_profanity_check(path=DATA / "eval.tsv", threshold: float = 0.5) -> list[Row]:
    """alt-profanity-check's single offensive-language score, flagging every category at once."""
    from profanity_check import predict_prob

    labelled = read_labelled(path)
    probs = predict_prob([t for _, t in labelled])
    return _rows(labelled, [set(REPORTED) if p >= threshold else set() for p in probs])


def format_table(rows: list[Row]) -> str:
    lines = ["| category | support | precision | recall |", "|---|---:|---:|---:|"]
    lines += [f"| {r.category} | {r.support} | {r.precision:.2f} | {r.recall:.2f} |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(evaluate()))
    if "--profanity-check" in sys.argv:
        print("\nalt-profanity-check (one score for all categories):")
        print(format_table(evaluate_profanity_check()))
    if "--blind" in sys.argv:
        print("\neval_blind.tsv (written before the retrained model was run on it):")
        print(format_table(evaluate(path=BLIND_PATH)))
