"""Personal data and secrets in text: find, redact, and redact a stream as it is written.

Kinds: `email`, `phone` (9-15 digits written as a phone number: +country, (area), 415-555-0134,
020 7946 0958), `card` (13-19 digits that pass the Luhn check), `iban` (country code, check
digits, BBAN, passing the ISO 7064 mod-97 check) and `secret` (API-key shapes: sk-..., kvs-...,
AKIA..., ghp_..., xox?-..., AIza..., and the value after `api_key=`, `token:`, `password=` and the
like). Checksums keep order numbers and dates from being taken for cards and IBANs. A match is
replaced by `[EMAIL]`, `[PHONE]`, ...

Cost is linear in the text (issue 49, findings 2 and 6). Every pattern starts only where its
first characters allow (a word boundary, a literal prefix, a lookbehind) and has bounded
repetitions, except a secret's value, which is one greedy run. E-mails are found from each `@`
(the local part is at most 64 characters and never holds an `@`), never by trying every start of
a run of letters. A long text is scanned in windows of `WINDOW` characters (overlapping by more
than the longest bounded match), so each regex call is short and the GIL changes hands between
them; a secret cut by a window's end is extended to the end of its run.

`StreamRedactor` redacts a text that arrives in pieces (an answer being streamed): it releases
only text that no later piece can turn into (part of) a match, and holds back at most `HOLD_MAX`
characters. When the held text passes that bound, what is in a match is released as its mask and
the rest of a still-growing match (a secret or an address that keeps going) is dropped until the
run ends; what is not in a match is released as it is. Each piece costs O(HOLD_MAX + its length).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("email", "phone", "card", "iban", "secret")
_AT = re.compile(r"(?<=[A-Za-z0-9._%+\-])@(?=[A-Za-z0-9\-]{1,63}\.)")   # an `@` that may join an e-mail
_LOCAL = re.compile(r"[A-Za-z0-9._%+\-]{1,64}\Z")      # searched in the 64 characters before an `@`
_DOMAIN = re.compile(r"[A-Za-z0-9\-]{1,63}(?:\.[A-Za-z0-9\-]{1,63}){0,6}\.[A-Za-z]{2,24}")
_CARD = re.compile(r"(?<![\w\-])(?:\d{4}(?:[ \-]?\d{4}){2,3}(?:[ \-]?\d{1,3})?|\d{4}[ \-]?\d{6}[ \-]?\d{5}"
                   r"|\d{13,19})(?![\w\-])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")
_PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .\-]?(?:\(\d{1,4}\)[ .\-]?)?\d{1,4}(?:[ .\-]?\d{2,4}){1,4}"
                    r"|\(\d{2,4}\)[ .\-]?\d{3,4}[ .\-]?\d{3,4}|\d{3}[.\-]\d{3}[.\-]\d{4}"
                    r"|0\d{2,4}[ .\-]\d{3,4}[ .\-]?\d{3,4})(?!\w)")
_SECRET = re.compile(r"\b(?:sk-(?:proj-)?[A-Za-z0-9_\-]{20,}|kvs-[A-Za-z0-9_\-]{20,}|AKIA[0-9A-Z]{16}"
                     r"|gh[pousr]_[A-Za-z0-9]{30,}|xox[abprs]-[A-Za-z0-9\-]{10,}|AIza[0-9A-Za-z_\-]{35})")
_KEYED = re.compile(r"(?i)\b(?:api[_\-]?key|secret(?:[_\-]key)?|access[_\-]?token|auth[_\-]?token|token|"
                    r"password|passwd)\b[\"']?[ \t]{0,8}[:=][ \t]{0,8}[\"']?([^\s\"',;]{7,}[^\s\"',;.])")
_SECRET_RUN = re.compile(r"[A-Za-z0-9_\-]*")
_KEYED_RUN = re.compile(r"[^\s\"',;]*")
WINDOW = 8192       # characters per regex call on a long text
OVERLAP = 640       # more than the longest bounded match (an e-mail: 64 + 1 + 7 x 64 + 25)
HOLD = 64           # left context kept by the stream redactor
HOLD_MAX = 256      # the most text the stream redactor holds back (a growing tail starts at most this far back)
# What may still grow into a match at the end of a streamed text: a run of digits, capitals and
# phone/card/IBAN separators that holds a digit, a word with an `@` in it, or the last word.
_TAIL = re.compile(r"(?:[+(]?\d[\dA-Z ().\-]*|[A-Z]{2}\d[\dA-Z ().\-]*|[\w.%+\-]*@[\w.\-]*|[^\s]+)$")
# The rest of a match that was masked while it could still grow: dropped until the run ends.
_CONTINUES = {"secret": re.compile(r"[^\s\"',;]*"), "email": re.compile(r"[A-Za-z0-9\-]*(?:\.[A-Za-z0-9\-]+)*"),
              "phone": re.compile(r"[\d\-]*"), "card": re.compile(r"[\d\-]*"), "iban": re.compile(r"[A-Z0-9]*")}


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


def _emails(text: str, pos: int, endpos: int) -> list[Match]:
    """E-mails whose `@` lies in [pos, endpos): the local part searched back from each `@`."""
    out: list[Match] = []
    if "@" not in text[pos:endpos]:
        return out
    for a in _AT.finditer(text, pos, min(len(text), endpos + 64)):
        at = a.start()
        if at >= endpos:
            break
        lo = text.rfind("@", max(0, at - 64), at) + 1 or max(0, at - 64)   # a local part holds no `@`
        local = _LOCAL.search(text, lo, at)
        dom = _DOMAIN.match(text, at + 1) if local else None
        if local and dom and (not out or local.start() >= out[-1].end):
            out.append(Match("email", local.start(), dom.end()))
    return out


def _find_window(text: str, pos: int, endpos: int, kinds: tuple[str, ...]) -> list[Match]:
    """Matches that start in [pos, endpos) (an e-mail: whose `@` does), seeing up to endpos + OVERLAP."""
    end = min(len(text), endpos + OVERLAP)
    found: list[Match] = []
    if "secret" in kinds:
        for rx, run, group in ((_SECRET, _SECRET_RUN, 0), (_KEYED, _KEYED_RUN, 1)):
            for m in rx.finditer(text, pos, end):
                if m.start() >= endpos:
                    break
                stop = m.end(group)
                if stop == end < len(text):        # cut by the window: the run goes on
                    stop = run.match(text, stop).end()
                found.append(Match("secret", m.start(group), stop))
    if "email" in kinds:
        found += _emails(text, pos, min(end, endpos + 64))
    if "iban" in kinds:
        found += [Match("iban", m.start(), m.end()) for m in _IBAN.finditer(text, pos, end)
                  if m.start() < endpos and iban_ok(m.group())]
    if "card" in kinds:
        for m in _CARD.finditer(text, pos, end):
            digits = re.sub(r"\D", "", m.group())
            if m.start() < endpos and 13 <= len(digits) <= 19 and luhn_ok(digits):
                found.append(Match("card", m.start(), m.end()))
    if "phone" in kinds:
        for m in _PHONE.finditer(text, pos, end):
            if m.start() < endpos and 9 <= sum(c.isdigit() for c in m.group()) <= 15:
                found.append(Match("phone", m.start(), m.end()))
    return found


def find(text: str, kinds: tuple[str, ...] = KINDS) -> list[Match]:
    """Non-overlapping matches, left to right (an earlier-listed kind wins an overlap); linear time."""
    found: list[Match] = []
    for pos in range(0, len(text), WINDOW):
        found += _find_window(text, pos, min(len(text), pos + WINDOW), kinds)
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
        self.pending = ""     # received, not yet sent (at most HOLD_MAX after a feed, plus one piece)
        self.found: list[str] = []   # kinds redacted so far
        self.dropping: str | None = None   # the kind of a masked match whose run is still being written

    def _release(self, final: bool) -> str:
        text = self.context + self.pending
        base = len(self.context)
        matches = [m for m in find(text, self.kinds) if m.end > base]
        cut = len(text)
        if not final:
            tail = _TAIL.search(text, max(base, cut - HOLD_MAX))
            cut = max(base, tail.start() if tail else cut)
            for m in matches:   # a match that reaches past the cut may still grow: hold it whole
                if m.start < cut < m.end or m.end == len(text):
                    cut = max(base, min(cut, m.start))
            if len(text) - cut > HOLD_MAX:      # held too long: release up to the bound, masks whole
                cut = len(text) - HOLD_MAX
                for m in matches:
                    if m.start < cut < m.end:
                        cut = m.end
                        if m.end == len(text):
                            self.dropping = m.kind
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
        if self.dropping is not None:
            n = _CONTINUES[self.dropping].match(piece).end()
            piece = piece[n:]
            if not piece:
                return ""
            self.dropping = None
        self.pending += piece
        return self._release(final=False)

    def finish(self) -> str:
        self.dropping = None
        return self._release(final=True)
