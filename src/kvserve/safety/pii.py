"""Personal data and secrets in text: find, redact, and redact a stream as it is written.

Kinds: `email`, `phone` (9-15 digits written as a phone number: +country, (area), 415-555-0134, 020 7946 0958), `card` (13-19 digits that pass
the Luhn check), `iban` (country code, check digits, BBAN, passing the ISO 7064 mod-97 check) and
`secret` (API-key shapes: sk-..., kvs-..., AKIA..., ghp_..., xox?-..., AIza..., and the value
after `api_key=`, `token:`, `password=` and the like). Checksums keep order numbers and dates
from being taken for cards and IBANs. A match is replaced by `[EMAIL]`, `[PHONE]`, ...

`StreamRedactor` redacts a text that arrives in pieces (an answer being streamed): it releases
only text that no later piece can turn into (part of) a match: the last word, and a trailing run
of digits and separators (a phone, card or IBAN being written), at most 64 characters before it
is known; `finish()` releases the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("email", "phone", "card", "iban", "secret")
_EMAIL = re.compile(r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9\-]+(?:\.[A-Za-z0-9\-]+)*\.[A-Za-z]{2,}")
_CARD = re.compile(r"(?<![\w\-])(?:\d{4}(?:[ \-]?\d{4}){2,3}(?:[ \-]?\d{1,3})?|\d{4}[ \-]?\d{6}[ \-]?\d{5}"
                   r"|\d{13,19})(?![\w\-])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")
_PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .\-]?(?:\(\d{1,4}\)[ .\-]?)?\d{1,4}(?:[ .\-]?\d{2,4}){1,4}"
                    r"|\(\d{2,4}\)[ .\-]?\d{3,4}[ .\-]?\d{3,4}|\d{3}[.\-]\d{3}[.\-]\d{4}"
                    r"|0\d{2,4}[ .\-]\d{3,4}[ .\-]?\d{3,4})(?!\w)")
_SECRET = re.compile(r"\b(?:sk-(?:proj-)?[A-Za-z0-9_\-]{20,}|kvs-[A-Za-z0-9_\-]{20,}|AKIA[0-9A-Z]{16}"
                     r"|gh[pousr]_[A-Za-z0-9]{30,}|xox[abprs]-[A-Za-z0-9\-]{10,}|AIza[0-9A-Za-z_\-]{35})")
_KEYED = re.compile(r"(?i)\b(?:api[_\-]?key|secret(?:[_\-]key)?|access[_\-]?token|auth[_\-]?token|token|"
                    r"password|passwd)\b[\"']?\s*[:=]\s*[\"']?([^\s\"',;]{7,}[^\s\"',;.])")
HOLD = 64
# What may still grow into a match at the end of a streamed text: a run of digits, capitals and
# phone/card/IBAN separators that holds a digit, a word with an `@` in it, or the last word.
_TAIL = re.compile(r"(?:[+(]?\d[\dA-Z ().\-]*|[A-Z]{2}\d[\dA-Z ().\-]*|[\w.%+\-]*@[\w.\-]*|[^\s]+)$")


@dataclass(frozen=True)
class Match:
    kind: str
    start: int
    end: int


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def iban_ok(text: str) -> bool:
    s = text.replace(" ", "")
    if not 15 <= len(s) <= 34:
        return False
    moved = s[4:] + s[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def find(text: str, kinds: tuple[str, ...] = KINDS) -> list[Match]:
    """Non-overlapping matches, left to right (an earlier-listed kind wins an overlap)."""
    found: list[Match] = []
    if "secret" in kinds:
        found += [Match("secret", m.start(), m.end()) for m in _SECRET.finditer(text)]
        found += [Match("secret", m.start(1), m.end(1)) for m in _KEYED.finditer(text)]
    if "email" in kinds:
        found += [Match("email", m.start(), m.end()) for m in _EMAIL.finditer(text)]
    if "iban" in kinds:
        found += [Match("iban", m.start(), m.end()) for m in _IBAN.finditer(text) if iban_ok(m.group())]
    if "card" in kinds:
        for m in _CARD.finditer(text):
            digits = re.sub(r"\D", "", m.group())
            if 13 <= len(digits) <= 19 and luhn_ok(digits):
                found.append(Match("card", m.start(), m.end()))
    if "phone" in kinds:
        for m in _PHONE.finditer(text):
            if 9 <= sum(c.isdigit() for c in m.group()) <= 15:
                found.append(Match("phone", m.start(), m.end()))
    out: list[Match] = []
    for m in sorted(found, key=lambda m: m.start):   # stable: the earlier kind first at one start
        if not out or m.start >= out[-1].end:
            out.append(m)
    return out


def redact(text: str, kinds: tuple[str, ...] = KINDS, matches: list[Match] | None = None) -> str:
    matches = find(text, kinds) if matches is None else matches
    parts, pos = [], 0
    for m in matches:
        parts += [text[pos:m.start], f"[{m.kind.upper()}]"]
        pos = m.end
    parts.append(text[pos:])
    return "".join(parts)


class StreamRedactor:
    """Redact a text written piece by piece; each `feed` returns what may be sent now."""

    def __init__(self, kinds: tuple[str, ...] = KINDS):
        self.kinds = kinds
        self.context = ""     # the last sent characters (already redacted): left context for matches
        self.pending = ""     # received, not yet sent
        self.found: list[str] = []   # kinds redacted so far

    def _release(self, final: bool) -> str:
        text = self.context + self.pending
        base = len(self.context)
        matches = [m for m in find(text, self.kinds) if m.end > base]
        cut = len(text)
        if not final:
            tail = _TAIL.search(text, max(base, cut - HOLD))
            cut = max(base, tail.start() if tail else cut)
            for m in matches:   # a match that reaches past the cut may still grow: hold it whole
                if m.start < cut < m.end or m.end == len(text):
                    cut = max(base, min(cut, m.start))
        out, pos = [], base
        for m in matches:
            if m.start >= pos and m.end <= cut:
                out += [text[pos:m.start], f"[{m.kind.upper()}]"]
                self.found.append(m.kind)
                pos = m.end
        out.append(text[pos:cut])
        sent = "".join(out)
        self.pending = text[cut:]
        self.context = (self.context + sent)[-HOLD:]
        return sent

    def feed(self, piece: str) -> str:
        self.pending += piece
        return self._release(final=False)

    def finish(self) -> str:
        return self._release(final=True)
