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

Two tiers (`--kv-offload-dir`, engine/kv_offload.py): a replica keeps its prefixes on disk long
after its KV pool evicted them, and replicas on one machine sharing a directory hold each other's
disk blocks. Each replica reports its tier once (`set_tier`, from its first stats: its pool's
blocks, a key naming its disk store, node and directory, that store's capacity and a bounded list
of the hashes it already holds); the router then remembers two things:

* per replica, what it sent there, bounded by its KV pool's blocks (what RAM can still hold);
* per disk store, what it sent to any replica writing it, bounded by the store's capacity;

and a prompt goes to the candidate holding its longest prefix in either tier, a RAM hit before a
disk hit of the same length, then the less loaded. The hashes are the KV cache manager's (same
chain, salt and digest), so a store's own list of hashes counts. When a replica outside the
chosen one's store holds a longer prefix (it is loaded past the slack, say), `decide` names it
the donor: the Ray client has the chosen replica fetch those blocks from it (engine/disagg.py).

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
    `salt_from` include the cache salt: the KV cache manager's hashes of a request without an adapter."""
    out: list[bytes] = []
    parent = b""
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        h = hashlib.blake2b(parent, digest_size=16)          # the KV cache manager's own hash
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        if salt and (i + 1) * block_size > salt_from:
            h.update(b"\x00salt\x00" + salt.encode())
        parent = h.digest()
        out.append(parent)
    return out


def _remember(seen: OrderedDict, hashes: list[bytes], limit: int) -> None:
    """Note a prompt's chain, its first blocks the most recent (a request frees its blocks tail
    first, so a pool evicts a prompt's last blocks before its first), and forget past `limit`."""
    for h in reversed(hashes):
        seen[h] = None
        seen.move_to_end(h)
    while len(seen) > limit:
        seen.popitem(last=False)


@dataclass
class ReplicaLoad:
    in_flight: int = 0            # requests this gateway sent there that have not finished
    waiting: int = 0              # the replica's last reported waiting queue
    kv_usage: float = 0.0         # its last reported KV cache usage, 0..1
    alive: bool = True
    accepting: bool = True        # False while draining: its requests finish, no new ones come
    seen: OrderedDict = field(default_factory=OrderedDict)   # prefix hash -> None, LRU (its RAM)
    ram_blocks: int = 0           # its KV pool's blocks (0: not reported, the router's own bound)
    disk: str | None = None       # the key of the disk store it reads and writes (None: RAM only)

    @property
    def score(self) -> float:
        return self.in_flight + self.waiting + 4.0 * self.kv_usage


@dataclass
class Route:
    """`decide`'s answer: the replica, how many of the prompt's blocks it holds (either tier), and
    a donor outside its disk store holding more (`donor_blocks`), or None."""

    index: int
    blocks: int = 0
    donor: int | None = None
    donor_blocks: int = 0


class PrefixAffinityRouter:
    def __init__(self, num_replicas: int, block_size: int, *, max_blocks: int = 64, affinity_blocks: int = 4,
                 balance_slack: float = 4.0, max_remembered: int = 100_000, min_fetch_blocks: int = 2):
        self.replicas = [ReplicaLoad() for _ in range(num_replicas)]
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.affinity_blocks = affinity_blocks
        self.balance_slack = balance_slack
        self.max_remembered = max_remembered
        self.min_fetch_blocks = min_fetch_blocks     # a donor must hold this many blocks more
        self.disks: dict[str, OrderedDict] = {}      # disk store key -> its hashes, LRU
        self.disk_blocks: dict[str, int] = {}        # disk store key -> its capacity in blocks
        self.affinity_hits = 0       # routed to the replica holding the longest known prefix
        self.disk_hits = 0           # ... of which its longest prefix was (partly) on disk only
        self.routed = 0

    def alive(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.alive]

    def mark_dead(self, index: int) -> None:
        """Its RAM is gone (its disk store, which others may share or a restart reopens, is not)."""
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

    def set_tier(self, index: int, ram_blocks: int = 0, disk: str | None = None, disk_blocks: int = 0,
                 held: list[bytes] = ()) -> None:
        """What replica `index` reported of its tiers: its KV pool's blocks, its disk store's key
        (replicas that report the same key share the store), capacity in blocks, and hashes the
        store already holds (least recently used first: a warm restart)."""
        r = self.slot(index)
        r.ram_blocks, r.disk = ram_blocks, disk
        if disk is None:
            return
        if disk_blocks:
            self.disk_blocks[disk] = max(disk_blocks, self.disk_blocks.get(disk, 0))
        seen = self.disks.setdefault(disk, OrderedDict())
        for h in held:
            seen.setdefault(h, None)
        _remember(seen, [], self._disk_limit(disk))

    def _disk_limit(self, disk: str) -> int:
        return min(self.max_remembered, self.disk_blocks.get(disk) or self.max_remembered)

    def held(self, index: int, hashes: list[bytes]) -> tuple[int, int]:
        """(blocks of the chain `hashes` replica `index` holds in either tier, of which in RAM): a
        chained hash names the whole prefix, so the walk stops at the first block held nowhere."""
        r = self.replicas[index]
        disk = self.disks.get(r.disk) if r.disk is not None else None
        total = ram = 0
        for h in hashes:
            if h in r.seen:
                ram += 1
            elif disk is None or h not in disk:
                break
            total += 1
        return total, ram

    def route(self, token_ids: list[int], salt: str | None = None, salt_from: int = 0,
              exclude: frozenset[int] = frozenset()) -> int:
        """The replica for this prompt (counted in flight until `done`). Raises LookupError when
        no replica is alive."""
        return self.decide(token_ids, salt, salt_from, exclude=exclude, fetch=False).index

    def decide(self, token_ids: list[int], salt: str | None = None, salt_from: int = 0,
               exclude: frozenset[int] = frozenset(), *, fetch: bool = True, to_disk: bool = True) -> Route:
        """`route` with the prefix each tier holds and, when `fetch`, the donor to fetch a longer
        one from. `to_disk`: the prompt's blocks reach the disk tier (not under a LoRA adapter)."""
        live = [i for i in self.alive() if i not in exclude and self.replicas[i].accepting]
        if not live:
            raise LookupError("no engine replica is alive")
        hashes = prefix_hashes(token_ids, self.block_size, self.max_blocks, salt, salt_from)
        floor = min(self.replicas[i].score for i in live)
        candidates = [i for i in live if self.replicas[i].score <= floor + self.balance_slack]
        best, best_key = -1, (0, 0, 0.0)
        for i in candidates:
            total, ram = self.held(i, hashes)
            key = (total, ram, -self.replicas[i].score)     # longest, then more of it in RAM, then idler
            if total and key > best_key:
                best, best_key = i, key
        if best < 0:
            key = hashes[min(len(hashes), self.affinity_blocks) - 1] if hashes else array(
                "q", token_ids[: self.block_size]).tobytes()
            best = max(candidates, key=lambda i: hashlib.blake2b(key + i.to_bytes(4, "little"),
                                                                 digest_size=8).digest())
        else:
            self.affinity_hits += 1
            self.disk_hits += best_key[1] < best_key[0]
        route = Route(best, best_key[0])
        if fetch:
            self._donor(route, hashes, exclude)
        self.routed += 1
        r = self.replicas[best]
        r.in_flight += 1
        _remember(r.seen, hashes, min(self.max_remembered, r.ram_blocks or self.max_remembered))
        if r.disk is not None and to_disk:
            _remember(self.disks.setdefault(r.disk, OrderedDict()), hashes, self._disk_limit(r.disk))
        return route

    def _donor(self, route: Route, hashes: list[bytes], exclude: frozenset[int]) -> None:
        """The live replica outside the chosen one's disk store holding the longest prefix, if it
        holds at least `min_fetch_blocks` more (its load does not matter: an export is a copy)."""
        disk = self.replicas[route.index].disk
        for i in self.alive():
            if i == route.index or i in exclude or (disk is not None and self.replicas[i].disk == disk):
                continue
            total, _ = self.held(i, hashes)
            if total >= route.blocks + self.min_fetch_blocks and total > route.donor_blocks:
                route.donor, route.donor_blocks = i, total

    def done(self, index: int) -> None:
        r = self.replicas[index]
        r.in_flight = max(0, r.in_flight - 1)
