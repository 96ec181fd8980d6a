"""Per-document cleaning, run in worker processes: extract → language → quality rules → PII.

Quality rules follow Gopher (Rae et al., 2021, appendix A) and C4 (Raffel et al., 2020); each
rule has a name, and the first one a document fails is the reason it is dropped (report.json
counts documents per reason):

    too_short / too_long     fewer than `min_words` or more than `max_words` words
    mean_word_length         mean word length outside [3, 10] characters
    symbol_ratio             ('#' + ellipses) per word above 0.1
    digit_ratio              digits above 25% of non-space characters
    bullet_lines             more than 90% of lines start with a bullet
    ellipsis_lines           more than 30% of lines end with an ellipsis
    repeated_lines           more than 30% of lines are duplicates of another line
    non_alpha_words          fewer than 80% of words contain a letter
    repeated_ngrams          the most frequent 2/3/4-gram covers more than 20/18/16% of the
                             characters, or duplicated 5-grams cover more than 15%
    stop_words               English text with fewer than 2 of Gopher's stop words
    curly_bracket, lorem     C4: code-like '{' and placeholder text

PII scrubbing replaces e-mail addresses, phone numbers, IP addresses and card-like numbers by
<EMAIL>, <PHONE>, <IP_ADDRESS>, <CARD_NUMBER> in kept text.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass

from kvserve.data.dedup import minhash_values

STOP_WORDS = frozenset(("the", "be", "to", "of", "and", "that", "have", "with"))
BULLETS = ("•", "●", "○", "■", "□", "▪", "-", "*", "·", "‣")
_WORD = re.compile(r"\w+(?:['’]\w+)*", re.UNICODE)

PII_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("EMAIL", re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")),
    ("IP_ADDRESS", re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")),
    ("CARD_NUMBER", re.compile(r"\b(?:\d[ -]?){13,16}\b")),
    ("PHONE", re.compile(r"(?<![\w.])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}\b")),
]


@dataclass
class CleanConfig:
    lang: tuple[str, ...] = ()       # ISO 639-1 codes to keep; empty = every language
    min_words: int = 50
    max_words: int = 100_000
    scrub_pii: bool = True
    shingle: int = 5                 # words per MinHash shingle
    num_perm: int = 128


def extract(html: str) -> str:
    """Main text of an HTML page (trafilatura: boilerplate, navigation and comments removed)."""
    import trafilatura

    return trafilatura.extract(html, include_comments=False, include_tables=False, deduplicate=False) or ""


_detector = None


def detect_language(text: str) -> str | None:
    """ISO 639-1 code of the text's language (lingua, offline, models loaded on first use)."""
    global _detector
    if _detector is None:
        from lingua import LanguageDetectorBuilder

        _detector = LanguageDetectorBuilder.from_all_languages().build()
    lang = _detector.detect_language_of(text[:2000])
    return lang.iso_code_639_1.name.lower() if lang is not None else None


def _dup_ngram_fraction(words: list[str], n: int) -> float:
    """Characters in n-grams that occur more than once (each word counted once), over all characters."""
    if len(words) < n:
        return 0.0
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    covered = [False] * len(words)
    for i, g in enumerate(grams):
        if counts[g] > 1:
            for j in range(i, i + n):
                covered[j] = True
    total = sum(len(w) for w in words)
    return sum(len(w) for w, c in zip(words, covered) if c) / max(total, 1)


def _top_ngram_fraction(words: list[str], n: int) -> float:
    if len(words) < n:
        return 0.0
    counts = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    gram, count = counts.most_common(1)[0]
    if count < 2:
        return 0.0
    return count * sum(len(w) for w in gram) / max(sum(len(w) for w in words), 1)


def quality_failure(text: str, cfg: CleanConfig, lang: str | None) -> str | None:
    """The name of the first quality rule the text fails, or None."""
    words = _WORD.findall(text)
    n = len(words)
    if n < cfg.min_words:
        return "too_short"
    if n > cfg.max_words:
        return "too_long"
    mean_len = sum(len(w) for w in words) / n
    if not 3 <= mean_len <= 10:
        return "mean_word_length"
    if (text.count("#") + text.count("...") + text.count("…")) / n > 0.1:
        return "symbol_ratio"
    chars = sum(not c.isspace() for c in text)
    if sum(c.isdigit() for c in text) / max(chars, 1) > 0.25:
        return "digit_ratio"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if lines:
        if sum(ln.startswith(BULLETS) for ln in lines) / len(lines) > 0.9:
            return "bullet_lines"
        if sum(ln.endswith(("...", "…")) for ln in lines) / len(lines) > 0.3:
            return "ellipsis_lines"
        if len(lines) > 1 and 1 - len(set(lines)) / len(lines) > 0.3:
            return "repeated_lines"
    tokens = text.split()
    if sum(any(c.isalpha() for c in t) for t in tokens) / max(len(tokens), 1) < 0.8:
        return "non_alpha_words"
    lower = [w.lower() for w in words]
    if (_top_ngram_fraction(lower, 2) > 0.20 or _top_ngram_fraction(lower, 3) > 0.18
            or _top_ngram_fraction(lower, 4) > 0.16 or _dup_ngram_fraction(lower, 5) > 0.15):
        return "repeated_ngrams"
    if lang in (None, "en") and len(STOP_WORDS.intersection(lower)) < 2:
        return "stop_words"
    if "{" in text:
        return "curly_bracket"
    if "lorem ipsum" in text.lower():
        return "lorem"
    return None


def scrub_pii(text: str) -> tuple[str, dict[str, int]]:
    found: dict[str, int] = {}
    for name, pattern in PII_PATTERNS:
        text, k = pattern.subn(f"<{name}>", text)
        if k:
            found[name.lower()] = k
    return text, found


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def process(raw: tuple[str, str, bool], cfg: CleanConfig) -> dict:
    """One document through every per-document stage. Returns {"drop": rule} or the kept text
    with its language, PII counts, exact-dedup digest and MinHash signature."""
    payload, source, is_html = raw
    text = extract(payload) if is_html and payload else payload
    text = "\n".join(line.rstrip() for line in text.strip().splitlines())
    if not text:
        return {"drop": "empty" if not is_html else "extraction_empty"}
    lang = detect_language(text) if cfg.lang else None
    if cfg.lang and lang not in cfg.lang:
        return {"drop": "language", "lang": lang}
    rule = quality_failure(text, cfg, lang)
    if rule:
        return {"drop": rule}
    pii: dict[str, int] = {}
    if cfg.scrub_pii:
        text, pii = scrub_pii(text)
    norm = normalize(text)
    return {"text": text, "source": source, "lang": lang, "pii": pii,
            "digest": hashlib.blake2b(norm.encode(), digest_size=16).digest(),
            "minhash": minhash_values(norm.split(), cfg.shingle, cfg.num_perm)}


def process_batch(batch: list[tuple[str, str, bool]], cfg: CleanConfig) -> list[dict]:
    return [process(raw, cfg) for raw in batch]
