"""`Moderator.check(text) -> Verdict`: the classifier and the rules as OpenAI's moderation result.

Scores per category: the six main categories take the larger of the classifier's probability
and 1.0 on a rule hit; the subcategories are derived (`harassment/threatening` = min(harassment,
violence), `self-harm/intent` needs a first-person text, `violence/graphic` gory words, ...) or
come from rules (`sexual/minors`). `jailbreak` (a kvserve addition) is the heuristics' score and
is only checked on input. Operator categories (a blocklist or regex under a new name) appear too.
Texts of fewer than three words get half the classifier's scores (a fragment such as "Write to"
at the start of an answer carries too little evidence). A category is flagged when its score
reaches its threshold (`ModerationConfig.thresholds`, else the classifier's own per category, chosen on
a dev split by train.py); the text is flagged when any category is.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

from kvserve.safety.classifier import LABELS, TextClassifier, default_classifier
from kvserve.safety.head import Head, default_head, features, normalize, windows
from kvserve.safety.rules import Rules

CATEGORIES = ("harassment", "harassment/threatening", "hate", "hate/threatening", "illicit", "illicit/violent",
              "self-harm", "self-harm/intent", "self-harm/instructions", "sexual", "sexual/minors", "violence",
              "violence/graphic")
MODES = {"input,output": (True, True), "output,input": (True, True), "input": (True, False),
         "output": (False, True), "off": (False, False)}
MIN_WORDS = 3       # below it the classifier's scores are halved (the rules still count in full)
_WORDS = re.compile(r"\w+")
_FIRST_PERSON = re.compile(r"\b(i|i'm|im|me|my|myself)\b", re.IGNORECASE)
_INSTRUCTIONS = re.compile(r"\b(how|ways?|best|easiest|steps?|tell me|instructions|what dose|which)\b", re.IGNORECASE)
_GRAPHIC = re.compile(r"\b(blood\w*|gore|gory|guts|graphic|disembowel\w*|mutilat\w*|dismember\w*|severed)\b",
                      re.IGNORECASE)


@dataclass
class ModerationConfig:
    """What to check and how strictly. `kvserve serve --moderation` sets `input`/`output`;
    per key or tier, `kvserve keys moderation` stores overrides (`merged`)."""

    input: bool = True
    output: bool = True
    thresholds: dict[str, float] = field(default_factory=dict)   # category -> score that flags (0.5)
    blocklist: dict[str, list[str]] = field(default_factory=dict)
    regexes: dict[str, list[str]] = field(default_factory=dict)
    jailbreak: bool = True              # score jailbreak attempts on input
    pii_input: str = "off"              # off | flag (400) | redact (the model sees [EMAIL] ...)
    pii_output: str = "off"             # off | redact (docs/safety.md: why off by default)
    action: str = "block"               # block (400 / content_filter) | annotate (verdicts logged and traced only)
    request_overrides: bool = True      # a request's `kvserve_moderation` may set action and pii_output
    check_every: int = 16               # output: check a window every this many tokens
    window_chars: int = 256             # output: the window's size in characters
    support_message: str = ""           # added before an answer whose input showed self-harm (docs/safety.md)

    def threshold(self, category: str, defaults: dict[str, float] | None = None) -> float:
        """The configured threshold of a category (or of its parent), else `defaults` (the
        classifier's own, chosen on a dev split), else 0.5 (0.6 for jailbreak)."""
        if category in self.thresholds:
            return self.thresholds[category]
        parent = category.split("/")[0]
        if parent in self.thresholds:
            return self.thresholds[parent]
        if category == "jailbreak":
            return 0.6
        defaults = defaults or {}
        return defaults.get(category, defaults.get(parent, 0.5))

    def merged(self, overrides: dict[str, Any] | None) -> ModerationConfig:
        """This config with a stored policy's fields on top (thresholds and lists merged)."""
        if not overrides:
            return self
        o = dict(overrides)
        if "mode" in o:
            o["input"], o["output"] = MODES[o.pop("mode")]
        for k in ("thresholds", "blocklist", "regexes"):
            if k in o:
                o[k] = {**getattr(self, k), **o[k]}
        return replace(self, **{k: v for k, v in o.items() if k in self.__dataclass_fields__})


@dataclass
class Verdict:
    flagged: bool
    categories: dict[str, bool]
    scores: dict[str, float]
    elapsed_ms: float = 0.0
    rule_hits: list[str] = field(default_factory=list)
    help_seeking: bool = False      # asks for help for oneself or someone else: never refused on input

    @property
    def self_harm(self) -> bool:
        """A self-harm category is flagged: shown and logged, never a refusal of the input."""
        return any(v for c, v in self.categories.items() if c.startswith("self-harm"))

    @property
    def blocking(self) -> bool:
        """Flagged by a category that refuses an input: any but self-harm's, and none when the text
        asks for help (someone in distress who writes to a chat service is answered; docs/safety.md)."""
        return not self.help_seeking and any(v for c, v in self.categories.items() if not c.startswith("self-harm"))

    @property
    def top(self) -> str | None:
        """The flagged category with the highest score."""
        flagged = [c for c, v in self.categories.items() if v]
        return max(flagged, key=lambda c: self.scores[c]) if flagged else None

    def to_openai(self) -> dict[str, Any]:
        return {"flagged": self.flagged, "categories": self.categories, "category_scores": self.scores,
                "category_applied_input_types": {c: ["text"] for c in self.categories}}

    def summary(self) -> dict[str, Any]:
        """For traces and logs: the verdict, the flagged categories, the time it took."""
        out = {"flagged": self.flagged, "categories": [c for c, v in self.categories.items() if v],
               "ms": round(self.elapsed_ms, 3)}
        if self.help_seeking:
            out["help_seeking"] = True
        return out


def head_depths(encoder, head: Head, full=None) -> tuple:
    """What `head` reads from a forward of `encoder`, as depths to ask `encode_depths` for: its tuned
    top layers' branch (safety/tuned.py), or its layers (`Head.depths`; the whole depth as `full`)."""
    from kvserve.safety.tuned import attach

    branch = attach(encoder, head)
    return (branch,) if branch is not None else head.depths(encoder.layers, full)


def head_encoder(head: Head):
    """texts -> the vectors `head` judges (`head_depths`, joined by `features`), from one forward
    of the shared encoder."""
    def encode(texts: list[str]):
        from kvserve.model.bert import default_encoder

        enc = default_encoder()
        depths = head_depths(enc, head, full=enc.layers)
        return features(enc.encode_depths(texts, depths)[0], depths)
    return encode


class Moderator:
    """Checks text against one configuration; cheap to make (rules compile, the model is shared).
    `engine`: "head" (the trained head over the sentence embedding, the default) or "ngram" (the
    hashed n-gram classifier it replaced, kept for `kvserve eval moderation`'s comparison)."""

    def __init__(self, config: ModerationConfig | None = None, classifier: TextClassifier | None = None,
                 engine: str = "head", head: Head | None = None, encode=None):
        self.config = config or ModerationConfig()
        c = self.config
        self.rules = Rules(blocklist=c.blocklist, regexes=c.regexes)
        self.engine = "ngram" if classifier is not None else engine
        if self.engine == "ngram":
            self.classifier = classifier or default_classifier()
            self.thresholds = self.classifier.thresholds
        else:
            self.head = head or default_head()
            self.thresholds = self.head.thresholds
            self.encode = encode or head_encoder(self.head)

    @staticmethod
    def windows(text: str) -> list[str]:
        """The texts a check embeds: the normalized text, in windows when long (head.windows)."""
        return windows(normalize(text) or " ")

    def check(self, text: str, *, input: bool = True, vectors=None) -> Verdict:
        """The verdict on `text`; `vectors`: its windows' embeddings (`windows(text)`) when the
        caller has them already (the request's shared embedding), else they are computed here."""
        t0 = time.perf_counter()
        if self.engine == "ngram":
            base = dict(self.classifier.scores(text))
        else:
            base = self.head.scores(self.encode(self.windows(text)) if vectors is None else vectors)
        if len(_WORDS.findall(text)) < MIN_WORDS:     # too little evidence: a fragment, not a statement
            base = {k: v * 0.5 for k, v in base.items()}
        hits = self.rules.hits(text)
        s = {lab: 1.0 if lab in hits else base.get(lab, 0.0) for lab in LABELS}
        first_person = bool(_FIRST_PERSON.search(text))
        scores = {
            "harassment": s["harassment"], "harassment/threatening": min(s["harassment"], s["violence"]),
            "hate": s["hate"], "hate/threatening": min(s["hate"], s["violence"]),
            "illicit": s["illicit"],
            "illicit/violent": base["illicit/violent"] if "illicit/violent" in base
            else min(s["illicit"], max(s["violence"], 0.5 * s["illicit"])),
            "self-harm": s["self-harm"],
            "self-harm/intent": s["self-harm"] if first_person else 0.5 * s["self-harm"],
            "self-harm/instructions": s["self-harm"] if _INSTRUCTIONS.search(text) else 0.5 * s["self-harm"],
            "sexual": s["sexual"],
            "sexual/minors": 1.0 if "sexual/minors" in hits else base.get("sexual/minors", 0.0),
            "violence": s["violence"],
            "violence/graphic": base["violence/graphic"] if "violence/graphic" in base
            else (s["violence"] if _GRAPHIC.search(text) else 0.3 * s["violence"]),
        }
        for cat in hits - set(scores):          # operator categories
            scores[cat] = 1.0
        if input and self.config.jailbreak:
            scores["jailbreak"] = self.rules.jailbreak_score(text)
        scores = {k: float(f"{v:.6g}") for k, v in scores.items()}     # significant digits: a tiny score keeps its rank
        categories = {k: v >= self.config.threshold(k, self.thresholds) for k, v in scores.items()}
        help_seeking = "help" in base and base["help"] >= self.thresholds.get("help", 2.0) and not hits
        return Verdict(any(categories.values()), categories, scores, (time.perf_counter() - t0) * 1000,
                       sorted(hits), help_seeking=help_seeking)
