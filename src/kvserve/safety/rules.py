"""The rule layer of moderation: phrases and regexes per category, and jailbreak heuristics.

The classifier generalises; rules are exact. Built-in patterns catch first-person and targeted
forms the classifier may score low ("kill myself", "stab him", "make a pipe bomb") while leaving
near-misses alone ("kill the process", "a bath bomb"). Operators add their own: a blocklist
(phrases, matched case-insensitively on word boundaries) and regexes, each under a category
(one of OpenAI's or a name of their own, which then appears in the result as well).
A rule hit scores 1.0 in its category.

Jailbreak heuristics score prompts that try to switch the model's instructions off ("ignore all
previous instructions", "you are DAN", "developer mode", "no restrictions"): each strong cue
adds 0.6, each weak one 0.25, capped at 1; the score is the `jailbreak` category (input only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_I = re.IGNORECASE
BUILTIN: dict[str, list[str]] = {
    "self-harm": [
        r"\b(kill|hang|hurt|cut|burn|starve|drown|poison)(ing)?\s+myself\b",
        r"\b(commit(ting)?\s+suicide|end(ing)?\s+(my|it)\s+(life|all)|my\s+suicide\s+note|slit\s+my\s+wrists?)\b",
        r"\bi\s+(want|wish|plan|am\s+going|'m\s+going)\s+to\s+(die|overdose|end\s+it)\b",
    ],
    "violence": [
        (r"\b(kill|murder|stab|shoot|strangle|poison|torture|behead|kidnap|assassinate)\s+(him|her|them|someone|"
        r"somebody|a\s+(person|child|kid)|people|everyone|my\s+(wife|husband|boss|neighbou?r|ex|mother|father))\b"),
        r"\b(mass\s+shooting|shoot\s+up\s+(my|the|a)\s+school|bleed\s+to\s+death|bare\s+hands)\b",
    ],
    "illicit": [
        (r"\b(make|build|cook|synthesi[sz]e|manufacture)\s+(a\s+|some\s+)?(pipe\s+bomb|bomb|meth|methamphetamine|"
        r"crystal\s+meth|fentanyl|ricin|sarin|explosives?|molotov(\s+cocktail)?|napalm)\b"),
        r"\b(launder(ing)?\s+(drug\s+)?money|counterfeit\s+(money|bills)|stolen\s+credit\s+card|ransomware)\b",
    ],
    "sexual": [r"\b(porn|pornographic|erotica?|nudes|sext(ing)?|orgasm|masturbat\w*|smut)\b"],
    "harassment": [r"\b(fuck|screw)\s+(you|off)\b", r"\b(kill|hang|hurt)\s+yourself\b", r"\byou\s+(stupid|dumb|worthless|pathetic|ugly|fat)\s+\w+"],
    "sexual/minors": [(r"\b(child|kid|minor|underage|teen|\d{1,2}[\s-]?(yo|year[\s-]old))\b.{0,40}"
                      r"\b(sex|sexual|naked|nude|erotic|porn)\b")],
}
JAILBREAK_STRONG = [
    r"\bignore\s+(all\s+)?(the\s+)?(previous|prior|above|earlier|your)\s+(instructions|rules|prompts?|guidelines)\b",
    r"\b(you\s+are|act\s+as|pretend\s+to\s+be)\s+(now\s+)?(dan|stan|dude|an?\s+unfiltered|an?\s+uncensored)\b",
    r"\bdo\s+anything\s+now\b", r"\b(developer|god|jailbreak|unrestricted)\s+mode\b",
    (r"\b(disregard|forget|bypass|override)\s+(all\s+)?(your|the|any)\s+(rules|guidelines|safety|filters?|"
    r"restrictions|instructions|system\s+prompt)\b"),
    r"\breveal\s+(your|the)\s+(system\s+prompt|hidden\s+instructions)\b",
]
JAILBREAK_WEAK = [
    r"\bno\s+(rules|restrictions|limits|filters|censorship)\b", (r"\bwithout\s+(any\s+)?(restrictions|filters|"
    r"censorship|ethics)\b"), r"\bhypothetical(ly)?\b", r"\bstay\s+in\s+character\b", r"\bjailbreak\b",
    r"\b(as|like)\s+an?\s+ai\s+(with|without)\b",
]


@dataclass
class Rules:
    """Compiled patterns per category; `hits(text)` lists the categories whose patterns match."""

    blocklist: dict[str, list[str]] = field(default_factory=dict)   # category -> phrases
    regexes: dict[str, list[str]] = field(default_factory=dict)     # category -> regexes
    builtin: bool = True

    def __post_init__(self) -> None:
        # Built-in patterns and blocklist phrases are lowercase and run case-sensitively on the
        # lowercased text (several times faster than IGNORECASE in `re`); an operator's regexes
        # may use capitals in classes, so they run with IGNORECASE on the text as written.
        lower: dict[str, list[str]] = {k: list(v) for k, v in BUILTIN.items()} if self.builtin else {}
        for cat, words in self.blocklist.items():
            lower.setdefault(cat, []).extend(r"(?<!\w)" + re.escape(w.lower()) + r"(?!\w)" for w in words if w)
        self.compiled = {cat: re.compile("|".join(f"(?:{p})" for p in ps)) for cat, ps in lower.items() if ps}
        self.operator = {cat: re.compile("|".join(f"(?:{p})" for p in ps), _I) for cat, ps in self.regexes.items() if ps}
        self._strong = [re.compile(p) for p in JAILBREAK_STRONG]
        self._weak = [re.compile(p) for p in JAILBREAK_WEAK]

    def hits(self, text: str) -> set[str]:
        low = text.lower()
        return ({cat for cat, rx in self.compiled.items() if rx.search(low)}
                | {cat for cat, rx in self.operator.items() if rx.search(text)})

    def jailbreak_score(self, text: str) -> float:
        low = text.lower()
        score = 0.6 * sum(1 for p in self._strong if p.search(low)) + 0.25 * sum(1 for p in self._weak
                                                                                if p.search(low))
        return min(1.0, score)
