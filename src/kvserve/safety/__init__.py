"""Safety checks that run on text, offline and in a few milliseconds on a CPU.

* `classifier.py`: a small multi-label text classifier (hashed word and character n-grams,
  one logistic regression per category) trained at first use from `data/train.tsv`;
* `rules.py`: configurable blocklists and regexes per category, and jailbreak heuristics;
* `pii.py`: e-mail, phone, card (Luhn), IBAN (mod 97) and secret detection and redaction, with a
  streaming redactor that holds back a possible partial match;
* `moderator.py`: `Moderator.check(text) -> Verdict`: the classifier and the rules combined into
  OpenAI's moderation categories with scores, thresholds per category;
* `evaluate.py`: precision and recall per category on the held-out `data/eval.tsv`.

The server (server/moderation.py) uses them for /v1/moderations, the input gate and the output stage.
"""

from kvserve.safety.moderator import CATEGORIES, ModerationConfig, Moderator, Verdict

__all__ = ["CATEGORIES", "ModerationConfig", "Moderator", "Verdict"]
