"""KVCacheManager: the block pool, block tables, reference counts and the prefix cache.

The KV cache is a pool of `num_blocks` blocks of `block_size` token slots. A sequence owns a
block table (block ids in token order). A *full* block is identified by a chained hash of
(parent block's hash, its token ids, the request's cache_salt), so two prompts with the same
first k blocks map to the same k blocks (the server salts by API key, so keys cannot see each
other's prompts; blocks wholly inside an operator-declared shared prefix, `cache_salt_from`, are
hashed without the salt, so every key hits those):

    prompt A: [sys prompt | sys prompt | question A ...]   hashes h1, h2, hA3
    prompt B: [sys prompt | sys prompt | question B ...]   hashes h1, h2, hB3 -> blocks of h1, h2 shared

Blocks are reference-counted. A block whose count drops to zero goes to the back of the free
queue but keeps its hash, so a later prompt can still hit it; allocation takes blocks from the
front of the queue (least recently freed) and only then forgets their hash (LRU eviction).
A request frees its blocks tail first, so its last blocks, the least likely to be shared,
are evicted before its first ones.

With a sliding window on every layer (`sliding_window`, Mistral), a request's blocks that lie
wholly before the window of its next query are released as it advances (their table entries
become -1, so positions keep their slots): a sequence then holds about window / block_size + 1
blocks however long it grows. Released blocks keep their hashes like any freed block, so a later
prompt with the same prefix still hits them while they are not evicted.

The manager owns request -> blocks (`block_ids(request_id)`) and the requests' block hashes; it
reads a request's tokens and computed count and never writes request state.

With a disk tier (`offload`, engine/kv_offload.py) the manager notes the full blocks to write
(`offload_pending`: every one as it is hashed, or each one as it is evicted) and, where a prompt's
RAM hit ends, asks the tier for the blocks that follow; they land in free blocks as cached ones.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from kvserve.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        self.num_blocks = num_blocks
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}                  # hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.req_blocks: dict[str, list[int]] = {}          # request id -> block table
        self.req_hashes: dict[str, list[bytes]] = {}        # request id -> hashes of its full blocks
        self.prefix_cache_queries = 0                       # prompt tokens looked up
        self.prefix_cache_hits = 0                          # prompt tokens found
        self.offload = None                                 # the disk tier (engine/kv_offload.py)
        self.offload_pending: list[tuple[bytes, int]] = []  # (hash, block) to write before the next forward
        self._offloadable = [False] * num_blocks            # (evict-only mode) hashed outside an adapter

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

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def local_block_ids(self, request_id: str) -> list[int] | None:
        """The sliding layers' own block table (None: every layer reads block_ids)."""
        return None

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds (its table less the entries released behind the window)."""
        return sum(1 for b in self.block_ids(request_id) if b >= 0)

    def _release(self, b: int) -> None:
        self.ref_cnt[b] -= 1
        if self.ref_cnt[b] == 0:
            self.free_queue[b] = None

    def free_outside_window(self, req: Request) -> None:
        """Release req's blocks that no query from its next token on can see (sliding window)."""
        table = self.req_blocks.get(req.request_id)
        if self.sliding_window is None or not table:
            return
        first_visible = max(0, req.num_computed_tokens - self.sliding_window + 1)
        for i in range(min(first_visible // self.block_size, len(table))):
            if table[i] >= 0:
                self._release(table[i])
                table[i] = -1

    def block_hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Hashes of every full block among req's first num_tokens tokens (extended as needed)."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            salt = req.cache_salt if (i + 1) * bs > req.cache_salt_from else None
            if req.lora is not None:   # an adapter's KV differs from the base's: never shared across them
                salt = f"{salt or ''}\x00lora\x00{req.lora.key}"
            hashes.append(self._hash(parent, req.token_ids_slice(i * bs, (i + 1) * bs), salt))
        return hashes

    # ---- prefix cache -----------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> list[int]:
        """Blocks of req's prompt already in the cache (not yet claimed). At least one prompt
        token is always left to compute, so the step that follows produces the logits."""
        if not self.enable_prefix_caching or req.want_prompt_logprobs:
            return []
        hashes = self.block_hashes(req, req.num_tokens)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in hashes[:max_blocks]:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        if self.offload is not None and len(hits) < max_blocks and req.lora is None:
            return self.offload.extend_hit(self, hashes[:max_blocks], hits)
        return hits

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---- allocation -------------------------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, computed: list[int] = ()) -> bool:
        need = self._blocks_needed(req, num_new_tokens, len(computed))
        reusable_free = sum(1 for b in computed if b >= 0 and self.ref_cnt[b] == 0)
        return need <= self.num_free_blocks - reusable_free

    def _blocks_needed(self, req: Request, num_new_tokens: int, num_computed_blocks: int) -> int:
        have = len(self.block_ids(req.request_id)) + num_computed_blocks
        total = req.num_computed_tokens + num_computed_blocks * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[int] = ()) -> bool:
        """Give req room for num_new_tokens more tokens after its computed ones and the prefix-cache
        blocks `computed` (claimed first, in front of them). False (and no change) if the pool is
        short. The caller counts the claimed blocks' tokens as computed; a -1 in `computed` is a
        block behind the window (engine/kv_hybrid.py), kept as a -1 table entry."""
        self.free_outside_window(req)
        if not self.can_allocate(req, num_new_tokens, computed):
            return False
        table = self.req_blocks.setdefault(req.request_id, [])
        for b in computed:
            if b < 0:
                table.append(b)
                continue
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
            table.append(b)
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        for _ in range(max(0, -(-total // self.block_size) - len(table))):
            b, _ = self.free_queue.popitem(last=False)
            self._evict(b)
            self.ref_cnt[b] = 1
            table.append(b)
        return True

    def _evict(self, b: int) -> None:
        """Forget free block b's cached contents (noted for the disk tier first, in evict-only mode)."""
        h = self.block_hash[b]
        if h is None:
            return
        if self.cached.get(h) == b:
            del self.cached[h]
            if self._offloadable[b] and not self.offload.write_through:
                self.offload_pending.append((h, b))
        self.block_hash[b] = None
        self._offloadable[b] = False

    def take_free_blocks(self, n: int, keep: set[int]) -> list[int]:
        """Up to n free blocks not in keep, least recently freed first, their contents forgotten (the
        disk tier overwrites them; `return_free_blocks` gives back those it did not use)."""
        out: list[int] = []
        for b in self.free_queue:
            if len(out) == n:
                break
            if b not in keep:
                out.append(b)
        for b in out:
            del self.free_queue[b]
            self._evict(b)
        return out

    def return_free_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)

    def register_cached(self, b: int, h: bytes) -> None:
        """Free block b now holds the contents of hash h (landed from the disk tier): cached, most
        recently used."""
        self.block_hash[b] = h
        self.cached[h] = b
        self.free_queue[b] = None

    def trim(self, req: Request, num_tokens: int) -> None:
        """Release req's blocks wholly past its first num_tokens slots (rejected draft tokens)."""
        table = self.req_blocks.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        while table and len(table) > keep:
            b = table.pop()
            if b >= 0:
                self._release(b)

    def cache_full_blocks(self, req: Request) -> None:
        """Register req's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.block_ids(req.request_id)
        hashes = self.block_hashes(req, req.num_computed_tokens)
        n_full = min(req.num_computed_tokens // self.block_size, len(table))
        for i in range(n_full):
            b = table[i]
            if b < 0 or self.block_hash[b] is not None:
                continue
            h = hashes[i]
            self.block_hash[b] = h
            self.cached.setdefault(h, b)
            if self.offload is not None and req.lora is None:   # (an adapter's salt names a load, not a file)
                if self.offload.write_through:
                    self.offload_pending.append((h, b))
                else:
                    self._offloadable[b] = True

    def free(self, request_id: str, *, forget_hashes: bool = True) -> None:
        """Release the request's blocks (tail first); forget_hashes=False keeps its block hashes
        for a preempted request that will be recomputed."""
        for b in reversed(self.req_blocks.pop(request_id, [])):
            if b >= 0:
                self._release(b)
        if forget_hashes:
            self.req_hashes.pop(request_id, None)

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self._offloadable = [False] * self.num_blocks
