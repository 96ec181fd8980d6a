"""`kvserve eval moderation FILE.jsonl`: what a moderation config flags on a labelled set, and
whether it treats texts about some groups differently from texts about others.

Each line is `{"text": ..., "labels": [...]}` (an empty list: benign), optionally `"group"` (the
identity the text is about: a name or a list of names) and `"set"` (a name to report rows by).
The report:

* the false-positive rate (benign rows flagged) and, per category, the recall (rows with that label
  flagged in it) and the share of rows flagged at all; per `set`, the share flagged;
* per group, the three AUCs of Jigsaw's Unintended Bias benchmark (Borkan et al., 2019) over a
  continuous toxicity score: the largest margin of a hate or harassment score over its threshold
  (BIAS_CATEGORIES: what the benchmark measures is toxicity toward a group; a request for a crime
  or a violent plan is scored by other categories, whose scores say nothing about the group; so
  the AUCs' toxic rows are those labelled hate or harassment, and benign rows those unlabelled):
  subgroup AUC (toxic vs benign texts about the group), BPSN (benign texts about the group vs toxic
  texts not about it: low when the group's name alone raises the score) and BNSP (toxic texts
  about the group vs benign texts not about it: low when hate about the group scores too low);
  and their generalized means with p = -5, as the benchmark aggregates them.

`data/heldout.jsonl` is the hand-written set BENCHMARKS.md (issue 48) reports: neutral and hateful
sentences about 15 groups that appear in no training row, benign texts with violent or crude words
in harmless senses, and clearly harmful texts.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidRequest
from kvserve.safety.classifier import DATA, LABELS
from kvserve.safety.moderator import ModerationConfig, Moderator

HELDOUT_PATH = DATA / "heldout.jsonl"
BIAS_CATEGORIES = ("hate", "hate/threatening", "harassment", "harassment/threatening")
TOXIC = {"hate", "harassment"}     # the AUCs' positives; rows harmful only in other ways are in neither side


@dataclass
class Row:
    text: str
    labels: set[str]
    groups: set[str]
    set: str | None
    flagged: set[str] = field(default_factory=set)   # main categories flagged
    score: float = 0.0                                # max over BIAS_CATEGORIES of score - threshold


def read_jsonl(path: pathlib.Path) -> list[Row]:
    rows = []
    for n, line in enumerate(pathlib.Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            labels = set(d.get("labels") or [])
            group = d.get("group") or []
            rows.append(Row(str(d["text"]), labels, {group} if isinstance(group, str) else set(group), d.get("set")))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidRequest(f"{path}:{n}: expected {{\"text\": ..., \"labels\": [...]}}: {e}",
                                 param="file") from None
    return rows


def auc(pos: list[float], neg: list[float]) -> float | None:
    """P(a positive scores above a negative), ties counting half (Mann-Whitney U); None if a side is empty."""
    if not pos or not neg:
        return None
    ranked = sorted([(s, 1) for s in pos] + [(s, 0) for s in neg])
    rank_sum, i = 0.0, 0
    while i < len(ranked):
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        mid = (i + j + 1) / 2                      # 1-based average rank of the tie block
        rank_sum += mid * sum(1 for k in range(i, j) if ranked[k][1])
        i = j
    return (rank_sum - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def power_mean(values: list[float], p: float = -5.0) -> float | None:
    values = [max(v, 1e-9) for v in values]
    return (sum(v ** p for v in values) / len(values)) ** (1 / p) if values else None


def score_rows(rows: list[Row], moderator: Moderator) -> None:
    for r in rows:
        v = moderator.check(r.text, input=False)
        r.flagged = {c for c in LABELS if v.categories[c]}
        r.score = max(v.scores[c] - moderator.config.threshold(c, moderator.thresholds)
                      for c in BIAS_CATEGORIES if c in v.scores)


def report(rows: list[Row]) -> dict[str, Any]:
    benign = [r for r in rows if not r.labels]
    out: dict[str, Any] = {"rows": len(rows), "benign": len(benign),
                           "false_positive_rate": sum(bool(r.flagged) for r in benign) / len(benign) if benign else None}
    out["recall"] = {}
    for c in LABELS:
        pos = [r for r in rows if c in r.labels]
        if pos:
            out["recall"][c] = {"support": len(pos), "recall": sum(c in r.flagged for r in pos) / len(pos),
                                "flagged_any": sum(bool(r.flagged) for r in pos) / len(pos)}
    sets = sorted({r.set for r in rows if r.set})
    out["sets"] = {s: {"rows": sum(r.set == s for r in rows),
                       "flagged": sum(bool(r.flagged) for r in rows if r.set == s) / sum(r.set == s for r in rows)}
                   for s in sets}
    groups: dict[str, dict[str, Any]] = {}
    for g in sorted({g for r in rows for g in r.groups}):
        sub = [r for r in rows if g in r.groups]
        bg = [r for r in rows if g not in r.groups]
        sp, sn = [r.score for r in sub if r.labels & TOXIC], [r.score for r in sub if not r.labels]
        bp, bn = [r.score for r in bg if r.labels & TOXIC], [r.score for r in bg if not r.labels]
        groups[g] = {"rows": len(sub), "flagged_benign": sum(bool(r.flagged) for r in sub if not r.labels),
                     "subgroup_auc": auc(sp, sn), "bpsn_auc": auc(bp, sn), "bnsp_auc": auc(sp, bn)}
    out["groups"] = groups
    out["bias"] = {m: power_mean([g[m] for g in groups.values() if g[m] is not None])
                   for m in ("subgroup_auc", "bpsn_auc", "bnsp_auc")} if groups else {}
    return out


def evaluate_file(path: pathlib.Path = HELDOUT_PATH, config: ModerationConfig | None = None,
                  model: pathlib.Path | None = None) -> dict[str, Any]:
    """The report of one labelled JSONL under `config` (jailbreak off: it is an input-only heuristic);
    `model`: another classifier file (e.g. the previous `model.npz`) instead of the shipped one."""
    from kvserve.safety.classifier import load

    rows = read_jsonl(path)
    mod = Moderator(config or ModerationConfig(jailbreak=False), load(model) if model else None)
    score_rows(rows, mod)
    return report(rows)


def format_report(rep: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    lines = [f"rows {rep['rows']}, benign {rep['benign']}, false-positive rate {pct(rep['false_positive_rate'])}", "",
             "| category | support | recall | flagged (any category) |", "|---|---:|---:|---:|"]
    lines += [f"| {c} | {r['support']} | {pct(r['recall'])} | {pct(r['flagged_any'])} |"
              for c, r in rep["recall"].items()]
    if rep["sets"]:
        lines += ["", "| set | rows | flagged |", "|---|---:|---:|"]
        lines += [f"| {s} | {r['rows']} | {pct(r['flagged'])} |" for s, r in rep["sets"].items()]
    if rep["groups"]:
        lines += ["", "| group | rows | benign flagged | subgroup AUC | BPSN AUC | BNSP AUC |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {g} | {r['rows']} | {r['flagged_benign']} | {num(r['subgroup_auc'])} | {num(r['bpsn_auc'])} | "
                  f"{num(r['bnsp_auc'])} |" for g, r in rep["groups"].items()]
        b = rep["bias"]
        lines += [(f"| generalized mean (p=-5) | | | {num(b['subgroup_auc'])} | {num(b['bpsn_auc'])} | "
                  f"{num(b['bnsp_auc'])} |")]
    return "\n".join(lines)
