"""HybridKVCacheManager: one KV pool for the full-attention layers, another for the sliding ones.

A model whose sliding-window layers sit beside full-attention ones (Gemma 2 and 3: five local
layers to one global) cannot free a block when the window passes it, since the global layers
still read it. So each layer type gets its own pool of blocks and its own block table per
request, each managed by a `KVCacheManager`:

    full pool  (global layers): [b0 b1 b2 b3 b4 b5 b6 b7 b8]    grows with the sequence
    local pool (sliding layers): [-1 -1 -1 -1 -1 c5 c6 c7 c8]   blocks behind the window released

The local manager releases, as a request advances, the blocks no later query can see (as it does
for Mistral, where every layer slides), so a sequence holds about window / block_size + 1 local
blocks however long it grows; the local pool is sized for that (`local_pool_blocks`), and the
memory saved goes to the full pool. Both tables have the same length; a layer reads its own
(the runner builds a second AttentionMetadata, `meta.local`).

Prefix caching: both pools hash their full blocks with the same chained hashes (the request's
hash list is shared). A hit of k blocks needs the full pool's first k blocks and the local pool's
blocks inside the window of position k * block_size (earlier ones become -1 entries): the longest
such k is taken, so a hit never reads a local block that was evicted.

Both allocations succeed or neither does. Accounting (`num_blocks`, usage, the metrics) is the
full pool's, which is what bounds the context; `local` is the sliding layers' manager.
"""

from __future__ import annotations

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request


class HybridHit(list):
    """A prefix-cache hit: the full pool's blocks (the list) and the local pool's (`local`, the same
    length, -1 behind the window)."""

    local: list[int]


def local_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Local blocks enough for every running sequence's window plus one step's new tokens."""
    per_seq = -(-(window - 1) // block_size) + 2
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


def _of_full(name: str) -> property:
    """A read-only attribute of the full pool's manager (what bounds the context)."""
    return property(lambda self: getattr(self.full, name), doc=f"The full pool's `{name}`.")


class HybridKVCacheManager:
    def __init__(self, num_blocks: int, num_local_blocks: int, block_size: int, enable_prefix_caching: bool,
                 window: int):
        self.full = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.local = KVCacheManager(num_local_blocks, block_size, enable_prefix_caching, window)
        self.local.req_hashes = self.full.req_hashes       # the same chained hashes for both pools
        self.window = window
        self.block_size = block_size
        self.sliding_window = None                          # the full layers' blocks are never released

    # ---- accounting (the full pool's) ---------------------------------------------------
    num_blocks = _of_full("num_blocks")
    num_free_blocks = _of_full("num_free_blocks")
    num_used_blocks = _of_full("num_used_blocks")
    prefix_cache_queries = _of_full("prefix_cache_queries")
    prefix_cache_hits = _of_full("prefix_cache_hits")
    req_blocks = _of_full("req_blocks")

    def usage(self) -> float:
        return max(self.full.usage(), self.local.usage())

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.full.record_query(num_prompt_tokens, num_hit_tokens)

    def block_ids(self, request_id: str) -> list[int]:
        return self.full.block_ids(request_id)

    def local_block_ids(self, request_id: str) -> list[int] | None:
        return self.local.block_ids(request_id)

    def num_held_blocks(self, request_id: str) -> int:
        return self.full.num_held_blocks(request_id)

    # ---- prefix cache -------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> HybridHit:
        full = self.full.get_computed_blocks(req)
        hashes = self.full.req_hashes.get(req.request_id, [])
        k, bs = len(full), self.block_size
        while k > 0:
            first = max(0, k * bs - self.window + 1) // bs     # the first block position k*bs sees
            local = [self.local.cached.get(h) for h in hashes[first:k]]
            missing = [i for i, b in enumerate(local) if b is None]
            if not missing:
                break
            k = first + missing[-1]                            # any longer hit would need that block
        hit = HybridHit(full[:k])
        hit.local = [-1] * first + local if k > 0 else []
        return hit

    # ---- allocation ---------------------------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, computed: list[int] = ()) -> bool:
        local = getattr(computed, "local", [])
        return (self.full.can_allocate(req, num_new_tokens, computed)
                and self.local.can_allocate(req, num_new_tokens, local))

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[int] = ()) -> bool:
        self.local.free_outside_window(req)
        if not self.can_allocate(req, num_new_tokens, computed):
            return False
        ok = self.full.allocate_slots(req, num_new_tokens, computed)
        ok = self.local.allocate_slots(req, num_new_tokens, getattr(computed, "local", [])) and ok
        assert ok, "both pools were checked"
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        self.full.trim(req, num_tokens)
        self.local.trim(req, num_tokens)

    def cache_full_blocks(self, req: Request) -> None:
        self.full.cache_full_blocks(req)
        self.local.cache_full_blocks(req)

    def free(self, request_id: str, *, forget_hashes: bool = True) -> None:
        self.local.free(request_id, forget_hashes=False)
        self.full.free(request_id, forget_hashes=forget_hashes)

    def reset_prefix_cache(self) -> None:
        self.full.reset_prefix_cache()
        self.local.reset_prefix_cache()
