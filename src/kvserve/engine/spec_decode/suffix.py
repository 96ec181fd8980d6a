"""Suffix decoding across requests (`--speculative suffix`, `ngram+suffix`): drafts from what
earlier answers said, for workloads that repeat themselves across requests (an agent loop asking
for the same kind of JSON plan, a support bot answering one question for many users).

The index is a trie of every substring of at most `depth` tokens of the recent requests' prompts
(their last `PROMPT_TAIL` tokens) and outputs, each node counting how often its substring
occurred; a decoding request's own tokens go in as they are generated. A request is drafted for
from the longest suffix of its tokens found in the trie with a continuation (at most
`depth - k` long, so k tokens can follow): walking down, each step takes the child seen most
often, and stops where that child's share of the continuations falls under `threshold`. Inserting
a token touches `depth` nodes (one per suffix ending at it: the request keeps those nodes as its
cursor), and a lookup is a binary search over match lengths (a suffix that occurs implies all its
shorter suffixes do), so a step costs tens of microseconds per request in pure Python.

Bounded: every token inserted is charged to its request's contribution, and once the total over
all scopes passes `budget` tokens the oldest contributions are taken out again (their paths
replayed with the counts decremented; a node at zero is dropped), a live request's included (its
cursor restarts). The trie holds at most `depth` nodes per token in the budget.

Scoped: one trie per (cache salt, LoRA adapter) — the prefix cache's scope, server/routing/
cache_scope.py — so one key's answers never become another key's drafts unless the operator
shares the scope (`--prefix-cache-scope tier|global`); each engine (one model) has its own.

Pricing (the scheduler's step-cost break-even rule, decoder.py): a draft token's probability is
its share of the continuations times a calibration learned per evidence bucket (how many
continuations the node has seen: a share of 1 out of 1 is worth less than 40 out of 40); a draft
is cut where the cumulative probability falls under the step's break-even bar. With
`ngram+suffix` prompt lookup proposes too (priced by its running per-position acceptance rates)
and the draft with the larger expected number of accepted tokens wins. A request whose first
position does not pay probes one token every `_PROBE`-th chance so the rates stay measured.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.engine.request import Request
from kvserve.engine.spec_decode.proposer import NgramProposer

PROMPT_TAIL = 1024     # prompt tokens of a request put in the trie (its last ones)
_BUCKETS = (1, 2, 4, 8)          # evidence buckets: continuations seen at a node (>= each bound)
_CAL0 = (0.55, 0.7, 0.85, 0.95)  # starting calibration per bucket
_W = 0.05                        # weight of the newest draft token in a bucket's calibration
_PROBE = 32
_LOOKUP0 = 0.8


class _Node:
    __slots__ = ("children", "count", "src")

    def __init__(self, src: tuple[str, str]):
        self.count = 0
        self.children: dict[int, _Node] | None = None
        self.src = src            # (request id, "prompt" | "output") of the latest insertion


@dataclass(eq=False)
class _Contribution:
    scope: tuple
    rid: str
    prompt_len: int                              # tokens of it that are prompt
    start: int = 0                               # sequence position of tokens[0]
    tokens: list[int] = field(default_factory=list)
    cursor: list[_Node] = field(default_factory=list)
    alive: bool = True                           # still in the trie


def _bucket(total: int) -> int:
    b = 0
    for i, lo in enumerate(_BUCKETS):
        if total >= lo:
            b = i
    return b


class SuffixIndex:
    """Tries per scope over a global token budget (the module docstring)."""

    def __init__(self, budget: int = 10_000, depth: int = 24):
        self.budget, self.depth = budget, depth
        self.roots: dict[tuple, _Node] = {}
        self.num_tokens = 0                      # tokens charged, all scopes
        self.num_nodes = 0
        self._fifo: deque[_Contribution] = deque()
        self._live: dict[str, _Contribution] = {}
        self._done: dict[str, int] = {}          # request ids already folded in at finish (ignored after)

    @staticmethod
    def scope_of(req: Request) -> tuple:
        lora = req.lora
        return (req.cache_salt, getattr(lora, "key", None) or getattr(lora, "name", None))

    def _root(self, scope: tuple) -> _Node:
        root = self.roots.get(scope)
        if root is None:
            root = self.roots[scope] = _Node(("", ""))
        return root

    def _add(self, c: _Contribution, tok: int) -> None:
        src = (c.rid, "prompt" if len(c.tokens) < c.prompt_len else "output")
        c.tokens.append(tok)
        root = self._root(c.scope)
        new = []
        for parent in [root, *c.cursor[:self.depth - 1]]:
            ch = parent.children
            if ch is None:
                ch = parent.children = {}
            node = ch.get(tok)
            if node is None:
                node = ch[tok] = _Node(src)
                self.num_nodes += 1
            node.count += 1
            node.src = src
            new.append(node)
        c.cursor = new
        self.num_tokens += 1

    def _remove(self, c: _Contribution) -> None:
        """Take a contribution's paths out again (the insertions replayed, counts decremented)."""
        root = self.roots.get(c.scope)
        c.alive = False
        if root is None:
            return
        cursor: list[_Node] = []
        for tok in c.tokens:
            new = []
            for parent in [root, *cursor[:self.depth - 1]]:
                node = parent.children.get(tok) if parent.children else None
                if node is None:                 # (under a node already dropped)
                    continue
                node.count -= 1
                if node.count <= 0:
                    del parent.children[tok]
                    self.num_nodes -= 1
                new.append(node)
            cursor = new
        self.num_tokens -= len(c.tokens)
        if not root.children:
            del self.roots[c.scope]

    def _evict(self) -> None:
        while self.num_tokens > self.budget and self._fifo:
            c = self._fifo.popleft()
            if not c.alive:
                continue
            self._remove(c)
            if self._live.get(c.rid) is c:       # a live request starts a new contribution
                at = c.start + len(c.tokens)
                fresh = _Contribution(c.scope, c.rid, max(0, c.start + c.prompt_len - at), at)
                self._live[c.rid] = fresh
                self._fifo.append(fresh)

    def sync(self, req: Request) -> _Contribution | None:
        """Insert what of req's prompt tail and output is not in its trie yet."""
        rid = req.request_id
        if rid in self._done:
            return None
        c = self._live.get(rid)
        prompt = req.prompt_token_ids
        if c is None:
            skip = max(0, len(prompt) - PROMPT_TAIL)
            c = self._live[rid] = _Contribution(self.scope_of(req), rid, len(prompt) - skip, skip)
            self._fifo.append(c)
        pos = c.start + len(c.tokens)                          # next sequence position to insert
        n = len(prompt)
        seq_len = n + len(req.output_token_ids)
        if pos < seq_len:
            for i in range(pos, seq_len):
                self._add(c, prompt[i] if i < n else req.output_token_ids[i - n])
            self._evict()
        return self._live.get(rid)

    def finish(self, req: Request | None, rid: str) -> None:
        """A request ended: its tokens so far stay in the trie (until evicted), its cursor goes."""
        if req is not None and rid in self._live:
            self.sync(req)
        c = self._live.pop(rid, None)
        if c is not None:
            c.cursor = []

    def match(self, scope: tuple, tokens: Sequence[int], most: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of tokens (<= most long) that occurs with a continuation."""
        root = self.roots.get(scope)
        if root is None or not root.children or most <= 0:
            return None, 0

        def walk(m: int) -> _Node | None:
            node = root
            for t in tokens[len(tokens) - m:]:
                ch = node.children
                node = ch.get(t) if ch else None
                if node is None:
                    return None
            return node if node.children else None

        lo, hi, best = 1, min(most, len(tokens)), None
        while lo <= hi:                           # occurring with a continuation is monotone in m
            mid = (lo + hi) // 2
            node = walk(mid)
            if node is not None:
                best, lo = (node, mid), mid + 1
            else:
                hi = mid - 1
        return best if best is not None else (None, 0)


class SuffixDrafter:
    """The decoder's suffix path: the index, the break-even cut, the calibration, the sources."""

    hidden_sink = None

    def __init__(self, k_max: int, budget: int, depth: int, threshold: float, lookup: NgramProposer | None):
        self.index = SuffixIndex(budget, depth)
        self.k_max, self.threshold = k_max, threshold
        self.cal = list(_CAL0)
        self.lookup = lookup
        self.lookup_rate = [_LOOKUP0] * k_max
        self._lookup_rounds = [0] * k_max
        self._pending: dict[str, tuple[str, list[int], list[float]]] = {}   # rid -> (kind, buckets, shares)
        self._probe = _PROBE
        self.sources: dict[str, str] = {}        # rid -> where its latest draft came from
        self._seconds: deque[float] = deque(maxlen=64)
        self.num_lookup_drafts = 0

    @property
    def seconds_per_call(self) -> float:
        return sorted(self._seconds)[len(self._seconds) // 2] if self._seconds else 0.0

    def _walk(self, node: _Node, k: int) -> tuple[list[int], list[float], list[int], list[float]]:
        """Greedy continuation from node: tokens, cumulative probabilities, evidence buckets, shares."""
        toks, cum, buckets, shares, p = [], [], [], [], 1.0
        while len(toks) < k and node.children:
            total, best, bn = 0, -1, None
            for t, ch in node.children.items():
                total += ch.count
                if bn is None or ch.count > bn.count:
                    best, bn = t, ch
            share = bn.count / total
            if share < self.threshold:
                break
            b = _bucket(total)
            p *= min(1.0, share * self.cal[b])
            toks.append(best)
            cum.append(p)
            buckets.append(b)
            shares.append(share)
            node = bn
        return toks, cum, buckets, shares

    def draft(self, req: Request, k: int, bar: float) -> list[int]:
        """req's draft for this step (k most), cut to what pays at `bar` (module docstring)."""
        t0 = time.perf_counter()
        idx = self.index
        idx.sync(req)
        toks = req.prompt_token_ids + req.output_token_ids if self.lookup is not None else None
        scope = idx.scope_of(req)
        tail = req.output_token_ids[-idx.depth:] if len(req.output_token_ids) >= idx.depth else \
            (req.prompt_token_ids + req.output_token_ids)[-idx.depth:]
        node, _m = idx.match(scope, tail, idx.depth - min(k, idx.depth - 1))
        best: tuple[float, list[int], list[float], str, list[int], list[float]] = (0.0, [], [], "", [], [])
        if node is not None:
            d, cum, buckets, shares = self._walk(node, k)
            if d:
                first = node.children[d[0]].src
                src = ("prompt" if first[1] == "prompt" else "request") if first[0] == req.request_id else "other"
                best = (sum(cum), d, cum, src, buckets, shares)
        if self.lookup is not None:
            d = self.lookup.lookup(toks, k)
            if d:
                cum, p = [], 1.0
                for i in range(len(d)):
                    p *= self.lookup_rate[i]
                    cum.append(p)
                if sum(cum) > best[0]:
                    best = (sum(cum), d, cum, "lookup", [], [])
        _, d, cum, src, buckets, shares = best
        n = 0
        while n < len(d) and cum[n] >= bar:
            n += 1
        if n == 0 and d:                         # the first does not pay: probe now and then
            self._probe -= 1
            if self._probe > 0:
                d = []
            else:
                self._probe, n = _PROBE, 1
        d = d[:n]
        if d:
            kind = "lookup" if src == "lookup" else "suffix"
            self._pending[req.request_id] = (kind, buckets[:n], shares[:n])
            self.sources[req.request_id] = "prompt" if src == "lookup" else src
        self._seconds.append(time.perf_counter() - t0)
        return d

    def observe(self, rid: str, drafted: int, accepted: int) -> None:
        kind, buckets, shares = self._pending.pop(rid, ("", [], []))
        if kind == "lookup":
            self.num_lookup_drafts += 1
            for i in range(min(accepted + 1, drafted)):
                self._lookup_rounds[i] += 1
                w = max(0.05, 1.0 / (self._lookup_rounds[i] + 2))
                self.lookup_rate[i] += w * ((i < accepted) - self.lookup_rate[i])
        elif kind == "suffix":
            for i in range(min(accepted + 1, len(buckets))):     # tried: up to the first rejection
                b, s = buckets[i], shares[i]
                hit = 1.0 if i < accepted else 0.0
                self.cal[b] = min(1.5, max(0.05, self.cal[b] + _W * (hit - s * self.cal[b]) / s))

    def finish(self, req: Request | None, rid: str) -> None:
        self.index.finish(req, rid)
        self._pending.pop(rid, None)
        self.sources.pop(rid, None)
