"""Which replica serves a request: prefix-cache affinity balanced against load.

A replica's prefix cache only helps the prompts sent to it, so a gateway in front of N replicas
sends prompts that share a beginning to the same replica (SGLang's router and Ray Serve LLM's
prefix-aware router do the same with a radix tree of the text). Here the unit is the KV block:

* a prompt is cut into full blocks of `block_size` tokens and hashed as a chain, as the KV cache
  manager does (block i's hash covers blocks 0..i), so a hash names a whole prefix;
* the router remembers, per replica, the hashes of the prefixes it sent there (bounded, LRU);
  a new prompt goes to the replica holding its longest remembered prefix;
* a prompt whose prefix no replica holds is placed by consistent hashing (rendezvous: the highest
  hash(prefix, replica)) of its first `affinity_blocks` blocks, so new prefixes spread evenly and
  the same prefix lands on the same replica, and a replica leaving only moves its own prefixes;
* load wins over affinity past a point: a replica is a candidate only while its load (requests in
  flight through this gateway plus the waiting ones and KV usage it last reported) is within
  `balance_slack` of the least loaded replica's.

Pure Python, no Ray: the Ray client (engine/ray_client.py) asks it and tells it who is alive.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


def prefix_hashes(token_ids: list[int], block_size: int, max_blocks: int, salt: str | None = None,
                  salt_from: int = 0) -> list[bytes]:
    """Chained hashes of the first full blocks (at most max_blocks); blocks that end after
    `salt_from` include the cache salt, as in the KV cache manager."""
    out: list[bytes] = []
    parent = b""
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        h = hashlib.blake2b(parent, digest_size=12)
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        if salt and (i + 1) * block_size > salt_from:
            h.update(b"\x00salt\x00" + salt.encode())
        parent = h.digest()
        out.append(parent)
    return out


@dataclass
class ReplicaLoad:
    in_flight: int = 0            # requests this gateway sent there that have not finished
    waiting: int = 0              # the replica's last reported waiting queue
    kv_usage: float = 0.0         # its last reported KV cache usage, 0..1
    alive: bool = True
    accepting: bool = True        # False while draining: its requests finish, no new ones come
    seen: OrderedDict = field(default_factory=OrderedDict)   # prefix hash -> None, LRU

    @property
    def score(self) -> float:
        return self.in_flight + self.waiting + 4.0 * self.kv_usage


class PrefixAffinityRouter:
    def __init__(self, num_replicas: int, block_size: int, *, max_blocks: int = 64, affinity_blocks: int = 4,
                 balance_slack: float = 4.0, max_remembered: int = 100_000):
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.affinity_blocks = affinity_blocks
        self.balance_slack = balance_slack
        self.max_remembered = max_remembered
        self.affinity_hits = 0       # routed to the replica holding the longest known prefix
        self.routed = 0

    def alive(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.alive]

    def mark_dead(self, index: int) -> None:
        r = self.replicas[index]
        r.alive = False
        r.seen.clear()
        r.in_flight = 0

    def slot(self, index: int) -> ReplicaLoad:
        """Slot `index`, appended (not alive) when the replica is new."""
        while index >= len(self.replicas):
            self.replicas.append(ReplicaLoad(alive=False))
        return self.replicas[index]

    def revive(self, index: int) -> None:
        """A (re)started replica takes `index`'s place: empty cache, no load, accepting."""
        self.slot(index)
        self.replicas[index] = ReplicaLoad()

    def drain(self, index: int) -> None:
        """No new requests for `index`; the ones in flight finish there."""
        r = self.replicas[index]
        r.accepting = False
        r.seen.clear()

    def report(self, index: int, waiting: int, kv_usage: float) -> None:
        r = self.replicas[index]
        r.waiting, r.kv_usage = waiting, kv_usage

    def route(self, token_ids: list[int], salt: str | None = None, salt_from: int = 0,
              exclude: frozenset[int] = frozenset()) -> int:
        """The replica for this prompt (counted in flight until `done`). Raises LookupError when
        no replica is alive."""
        live = [i for i in self.alive() if i not in exclude and self.replicas[i].accepting]
        if not live:
            raise LookupError("no engine replica is alive")
        hashes = prefix_hashes(token_ids, self.block_size, self.max_blocks, salt, salt_from)
        floor = min(self.replicas[i].score for i in live)
        candidates = [i for i in live if self.replicas[i].score <= floor + self.balance_slack]
        best, best_len = -1, 0
        for i in candidates:
            seen = self.replicas[i].seen
            n = 0
            for h in hashes:      # a chained hash names the whole prefix: stop at the first miss
                if h not in seen:
                    break
                n += 1
            if n > best_len:
                best, best_len = i, n
        if best < 0:
            key = hashes[min(len(hashes), self.affinity_blocks) - 1] if hashes else array(
                "q", token_ids[: self.block_size]).tobytes()
            best = max(candidates, key=lambda i: hashlib.blake2b(key + i.to_bytes(4, "little"),
                                                                 digest_size=8).digest())
        else:
            self.affinity_hits += 1
        self.routed += 1
        r = self.replicas[best]
        r.in_flight += 1
        for h in hashes:
            r.seen[h] = None
            r.seen.move_to_end(h)
        while len(r.seen) > self.max_remembered:
            r.seen.popitem(last=False)
        return best

    def done(self, index: int) -> None:
        r = self.replicas[index]
        r.in_flight = max(0, r.in_flight - 1)
