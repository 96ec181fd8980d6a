"""KVCacheManager: the block pool, block tables, reference counts and the prefix cache.

The KV cache is a pool of `num_blocks` blocks of `block_size` token slots. A sequence owns a
block table (block ids in token order). A *full* block is identified by a chained hash of
(parent block's hash, its token ids, the request's cache_salt), so two prompts with the same
first k blocks map to the same k blocks:

    prompt A: [sys prompt | sys prompt | question A ...]   hashes h1, h2, hA3
    prompt B: [sys prompt | sys prompt | question B ...]   hashes h1, h2, hB3 -> blocks of h1, h2 shared

Blocks are reference-counted. A block whose count drops to zero goes to the back of the free
queue but keeps its hash, so a later prompt can still hit it; allocation takes blocks from the
front of the queue (least recently freed) and only then forgets their hash (LRU eviction).
A sequence frees its blocks tail first, so its last blocks, the least likely to be shared,
are evicted before its first ones.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from kvserve.engine.request import Sequence


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}                  # hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.prefix_cache_queries = 0                       # prompt tokens looked up
        self.prefix_cache_hits = 0                          # prompt tokens found

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    # ---- hashing ----------------------------------------------------------------------
    def _hash(self, parent: bytes | None, tokens: list[int], salt: str | None) -> bytes:
        h = hashlib.blake2b(parent or b"", digest_size=16)
        h.update(array("q", tokens).tobytes())
        if salt:
            h.update(b"\x00salt\x00" + salt.encode())
        return h.digest()

    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes to cover every full block among its first num_tokens tokens."""
        bs = self.block_size
        while (len(seq.block_hashes) + 1) * bs <= num_tokens:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(self._hash(parent, seq.token_ids_slice(i * bs, (i + 1) * bs), seq.cache_salt))

    # ---- prefix cache -----------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Blocks of seq's prompt already in the cache (not yet claimed). At least one prompt
        token is always left to compute, so the step that follows produces the logits."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        self._update_hashes(seq, seq.num_tokens)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in seq.block_hashes[:max_blocks]:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---- allocation -------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: list[int] = ()) -> bool:
        need = self._blocks_needed(seq, num_new_tokens, len(computed))
        reusable_free = sum(1 for b in computed if self.ref_cnt[b] == 0)
        return need <= self.num_free_blocks - reusable_free

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, num_computed_blocks: int) -> int:
        have = len(seq.block_table) + num_computed_blocks
        total = seq.num_computed_tokens + num_computed_blocks * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: list[int] = ()) -> bool:
        """Give seq room for num_new_tokens more tokens after its computed ones, claiming the
        prefix-cache blocks `computed` first. False (and no change) if the pool is short."""
        if not self.can_allocate(seq, num_new_tokens, computed):
            return False
        for b in computed:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
            seq.block_table.append(b)
        if computed:
            seq.num_computed_tokens += len(computed) * self.block_size
        for _ in range(self._blocks_needed(seq, num_new_tokens, 0)):
            b, _ = self.free_queue.popitem(last=False)
            if self.block_hash[b] is not None:            # evict its old contents from the cache
                if self.cached.get(self.block_hash[b]) == b:
                    del self.cached[self.block_hash[b]]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            seq.block_table.append(b)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(seq, seq.num_computed_tokens)
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(n_full):
            b = seq.block_table[i]
            if self.block_hash[b] is not None:
                continue
            h = seq.block_hashes[i]
            self.block_hash[b] = h
            self.cached.setdefault(h, b)

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
        seq.block_table = []

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
