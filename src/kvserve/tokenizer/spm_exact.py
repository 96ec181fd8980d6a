"""llama.cpp's SentencePiece encoder (`llm_tokenizer_spm`) step for step, for vocabularies a BPE
cannot express exactly.

The `tokenizers` BPE built in gguf_vocab.py ranks each merge by the merged token's score. Where
two different tokens have the same score (unigram-trained vocabularies store float32 log
probabilities, and equal ones occur), llama.cpp merges the leftmost pair; a BPE ranks the two
merges one above the other whatever their position. `needs_exact` finds such vocabularies and
`SpmEncoder` then encodes as llama.cpp does: special tokens split out (longest first), a space
prefixed at the start and after each special token when `add_space_prefix`, ' ' -> U+2581,
score-driven bigram merges (ties: leftmost), unknown pieces spelled as <0xXX> byte tokens.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
SPACE = "\u2581"


def needs_exact(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> bool:
    """Whether two different multi-character normal tokens share a score (as float32)."""
    import numpy as np

    s = np.asarray([sc for t, sc, ty in zip(tokens, scores, types, strict=True) if ty == NORMAL and len(t) > 1],
                   dtype=np.float32)
    return len(np.unique(s)) < len(s)


class SpmEncoder:
    def __init__(self, tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                 add_space_prefix: bool, rstrip: Sequence[str] = ()):
        import numpy as np

        self.spec = {"tokens": list(tokens), "scores": [float(x) for x in scores], "types": [int(x) for x in types],
                     "add_space_prefix": add_space_prefix, "rstrip": list(rstrip)}   # what rebuilds it
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.scores = np.asarray(scores, dtype=np.float32).tolist()   # compared as llama.cpp's floats
        self.add_space_prefix = add_space_prefix
        special = sorted({t for t, ty in zip(tokens, types, strict=True) if ty in (CONTROL, USER_DEFINED, UNKNOWN)},
                         key=len, reverse=True)
        self.rstrip = set(rstrip)
        self.special_re = re.compile("|".join(map(re.escape, special))) if special else None
        self.bytes = {b: self.vocab.get(f"<0x{b:02X}>") for b in range(256)}

    @classmethod
    def from_spec(cls, spec: dict) -> SpmEncoder:
        return cls(spec["tokens"], spec["scores"], spec["types"], add_space_prefix=spec["add_space_prefix"],
                   rstrip=spec["rstrip"])

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        prev_special, pos = True, 0
        for m in (self.special_re.finditer(text) if self.special_re else ()):
            if m.start() > pos:
                self._raw(text[pos:m.start()], prev_special, out)
            out.append(self.vocab[m.group()])
            prev_special, pos = True, m.end()
            if m.group() in self.rstrip:
                while pos < len(text) and text[pos].isspace():
                    pos += 1
        if pos < len(text):
            self._raw(text[pos:], prev_special, out)
        return out

    def _raw(self, text: str, prev_special: bool, out: list[int]) -> None:
        if self.add_space_prefix and prev_special:
            text = " " + text
        sym = list(text.replace(" ", SPACE))
        n = len(sym)
        prev, nxt = list(range(-1, n - 1)), [*range(1, n), -1]
        heap: list[tuple[float, int, int, int]] = []
        rev: dict[str, tuple[str, str]] = {}
        vocab, scores = self.vocab, self.scores

        def bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            t = sym[left] + sym[right]
            tid = vocab.get(t)
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, len(t)))
                rev[t] = (sym[left], sym[right])

        for i in range(1, n):
            bigram(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size or nxt[left] != right:
                continue
            sym[left] += sym[right]
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            bigram(prev[left], left)
            bigram(left, nxt[left])
        i = 0 if n else -1
        while i != -1:
            self._resegment(sym[i], rev, out)
            i = nxt[i]

    def _resegment(self, piece: str, rev: dict[str, tuple[str, str]], out: list[int]) -> None:
        tid = self.vocab.get(piece)
        if tid is not None:
            out.append(tid)
        elif piece in rev:
            self._resegment(rev[piece][0], rev, out)
            self._resegment(rev[piece][1], rev, out)
        else:
            for b in piece.encode("utf-8"):
                t = self.bytes[b]
                if t is None:
                    t = self.vocab.get(chr(b), 0)
                out.append(t)
