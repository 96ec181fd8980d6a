"""Safety checks that run on text, offline and in a few milliseconds on a CPU.

* `classifier.py`: a small multi-label text classifier (hashed word and character n-grams,
  one logistic regression per category) trained by `train.py` from `data/train.tsv` and the
  counterfactual identity rows of `augment.py`, shipped as `data/model.npz` with its thresholds;
* `rules.py`: configurable blocklists and regexes per category, and jailbreak heuristics;
* `pii.py`: e-mail, phone, card (Luhn), IBAN (mod 97) and secret detection and redaction in
  linear time, with a streaming redactor that holds back a possible partial match (bounded);
* `moderator.py`: `Moderator.check(text) -> Verdict`: the classifier and the rules combined into
  OpenAI's moderation categories with scores, thresholds per category;
* `evaluate.py`: precision and recall per category on `data/eval.tsv` and `data/eval_blind.tsv`;
* `bias.py` (`kvserve eval moderation`, eval_cli.py): false-positive rate, recall and Jigsaw's bias
  AUCs per identity group on a labelled JSONL (`data/heldout.jsonl` by default).

The server (server/gates/moderation.py, server/stages/output_moderation.py) uses them for
/v1/moderations, the input gate and the output stage.
"""

from kvserve.safety.moderator import CATEGORIES, ModerationConfig, Moderator, Verdict

__all__ = ["CATEGORIES", "ModerationConfig", "Moderator", "Verdict"]
