"""Stop-string matching in time linear in the text: an Aho-Corasick automaton over the stops.

The streaming detokenizer asks two things of every new piece of text: did a stop string just
complete (the first to complete wins; at one end position the longest, i.e. the one that begins
first), and how long is the longest tail of the text that is still the beginning of some stop
(held back from the stream until it either completes or is ruled out)? The automaton answers
both from one state per sequence: the state is the trie node of that longest tail, so its depth
is the hold-back, and a node's `match` names the longest stop that ends there. Each character
costs amortised O(1) (the failure links never climb more than the characters fed), so a token
costs what its text adds, not what the output or the stops already hold.

Automata are immutable and shared: `automaton(stops)` caches the most recent ones (at most 16,
and at most `_CACHE_CHARS` characters of stops in all, so a few huge offline stop lists cannot
pin gigabytes), so the `n` sequences of one request (and repeated requests with the same stops)
build it once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence

_CACHE_ENTRIES = 16
_CACHE_CHARS = 1 << 20


class StopAutomaton:
    """A trie of the stop strings with failure links; feed text through `feed` from state 0."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        match = [-1]          # index of the longest stop that is a suffix of the node's string
        for k, s in enumerate(self.stops):
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    match.append(-1)
                node = nxt
            if match[node] < 0:   # a repeated stop keeps its first index
                match[node] = k
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                target = goto[f].get(ch, 0) if node else 0
                fail[child] = target if target != child else 0
                if match[child] < 0:
                    match[child] = match[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._match, self._depth = goto, fail, match, depth

    def feed(self, state: int, text: str) -> tuple[int, int, int]:
        """Advance `state` over `text` up to the first completed stop.

        Returns (state, end, stop index): `end` is the offset in `text` just past the first stop
        to complete and the index of the longest stop ending there, or (state, -1, -1) when none
        completes. The returned state is where the text was left off."""
        goto, fail, match = self._goto, self._fail, self._match
        for pos, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            k = match[state]
            if k >= 0:
                return state, pos + 1, k
        return state, -1, -1

    def partial_len(self, state: int) -> int:
        """Length of the longest tail of the text fed so far that some stop string begins with."""
        return self._depth[state]

    @property
    def num_nodes(self) -> int:
        return len(self._goto)


_cache: OrderedDict[tuple[str, ...], StopAutomaton] = OrderedDict()
_cache_lock = threading.Lock()


def automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The shared automaton for these stop strings (order matters: it breaks ties)."""
    with _cache_lock:
        found = _cache.get(stops)
        if found is not None:
            _cache.move_to_end(stops)
            return found
    built = StopAutomaton(stops)
    with _cache_lock:
        _cache[stops] = built
        while len(_cache) > _CACHE_ENTRIES or (
                len(_cache) > 1 and sum(len(s) for k in _cache for s in k) > _CACHE_CHARS):
            _cache.popitem(last=False)
    return built
