"""Stop strings through the automaton: the same deltas, text and stop reason as the quadratic
search it replaced, on many random cases (stops spanning tokens, overlapping stops, prefixes of
one another, held-back partial matches), and a cost linear in the text."""

from __future__ import annotations

import random

import pytest

from kvserve.tokenizer import stop_matcher
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """Token i decodes to VOCAB[i]; nothing is special and no byte is split."""

    def __init__(self, vocab: list[str]):
        self.vocab = vocab
        self.all_special_ids: set[int] = set()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[i] for i in ids)


class QuadraticDetokenizer(IncrementalDetokenizer):
    """The search as it was before the automaton: re-find every stop over the new tail and test
    every prefix of every stop against the end of the text for the hold-back."""

    def _append(self, new_text: str) -> None:
        max_stop = max((len(s) for s in self.stop), default=0)
        start = max(0, len(self._text) - max_stop + 1)
        self._text += new_text
        if not self.stop:
            return
        best = None
        for s in self.stop:
            i = self._text.find(s, start)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            end, begin, s = best
            self._text = self._text[:end if self.include_stop_str_in_output else begin]
            self.stop_reason = s

    def _partial_stop_len(self) -> int:
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._text)), hold, -1):
                if self._text.endswith(s[:n]):
                    hold = n
                    break
        return hold


def run(cls, tok, ids, stops, include, chunks):
    d = cls(tok, [], stop=stops, include_stop_str_in_output=include)
    deltas, i = [], 0
    for size in chunks:
        if i >= len(ids) or d.stopped:
            break
        deltas.append(d.add_tokens(ids[i:i + size]))
        i += size
    deltas.append(d.flush())
    return deltas, d.text, d.stop_reason


VOCAB = ["a", "b", "c", "ab", "ba", "abc", "ca", "aab", "", " ", "bb", "cab"]


@pytest.mark.parametrize("seed", range(400))
def test_same_output_as_the_quadratic_search(seed):
    rng = random.Random(seed)
    tok = CharTokenizer(VOCAB)
    ids = [rng.randrange(len(VOCAB)) for _ in range(rng.randint(0, 60))]
    stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
    if rng.random() < 0.3:
        stops.append(stops[0])                  # a repeated stop keeps its first place
    if rng.random() < 0.3:
        stops.append(stops[0][:-1] or "a")      # a stop that is a prefix of another
    include = rng.random() < 0.5
    chunks = [rng.randint(1, 4) for _ in range(len(ids) + 1)]
    new = run(IncrementalDetokenizer, tok, ids, stops, include, chunks)
    old = run(QuadraticDetokenizer, tok, ids, stops, include, chunks)
    assert new == old, (ids, stops, include)


def test_same_output_on_the_real_tokenizer_with_stops_spanning_tokens():
    import gguf

    from kvserve.model.registry import resolve
    from kvserve.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(gguf.GGUFReader(resolve(None).path))
    text = "The quick brown fox jumps over the lazy dog. Héllo wörld 🤖 again: the quick fox."
    ids = tok.encode(text, add_special_tokens=False)
    for stops in (["fox jumps"], ["ck bro", "lazy"], ["wörld 🤖"], ["quick fox.", "the q"], ["zz"]):
        for include in (False, True):
            new = run(IncrementalDetokenizer, tok, ids, stops, include, [1] * len(ids))
            assert new == run(QuadraticDetokenizer, tok, ids, stops, include, [1] * len(ids))


def test_each_character_is_fed_once_whatever_the_stops(monkeypatch):
    """Sixteen 1,024-character stops (the server's cap) that the output keeps almost matching:
    the automaton sees each output character once, and holds back at most one stop's length."""
    fed: list[int] = []
    real_feed = stop_matcher.StopAutomaton.feed

    def counting_feed(self, state, text):
        fed.append(len(text))
        return real_feed(self, state, text)

    monkeypatch.setattr(stop_matcher.StopAutomaton, "feed", counting_feed)
    stops = ["a" * 1023 + chr(ord("b") + k) for k in range(16)]
    tok = CharTokenizer(["a" * 3, "a"])
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    streamed = sum(len(detok.add_tokens([0])) for _ in range(1000))
    assert sum(fed) == 3000 == len(detok.text)
    assert streamed == 3000 - 1023          # the longest partial match is held back
    assert detok.flush() == "a" * 1023
    auto = stop_matcher.automaton(tuple(stops))
    assert auto.num_nodes == 1 + 1023 + 16      # the shared prefix is stored once


def test_an_automaton_is_shared_by_the_sequences_of_a_request():
    tok = CharTokenizer(VOCAB)
    a = IncrementalDetokenizer(tok, [], stop=["abc", "zz"])
    b = IncrementalDetokenizer(tok, [], stop=["abc", "zz"])
    assert a._stops is b._stops


def test_the_automaton_cache_is_bounded_in_entries_and_characters(monkeypatch):
    monkeypatch.setattr(stop_matcher, "_cache", type(stop_matcher._cache)())
    monkeypatch.setattr(stop_matcher, "_CACHE_CHARS", 100)
    for k in range(5):
        stop_matcher.automaton((chr(ord("a") + k) * 60,))
    assert list(stop_matcher._cache) == [("e" * 60,)]
    for k in range(40):
        stop_matcher.automaton((str(k),))
    assert len(stop_matcher._cache) == stop_matcher._CACHE_ENTRIES
