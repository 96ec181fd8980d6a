"""KVCacheManager on synthetic requests (no model): block accounting, reference counts,
chained prefix hashes, cache_salt, and least-recently-freed eviction order."""

from __future__ import annotations

import pytest

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request
from kvserve.sampling_params import SamplingParams

BS = 4


def make_seq(tokens: list[int], rid: str = "r", salt: str | None = None, **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params), arrival_seq=0, cache_salt=salt,
                   want_prompt_logprobs=params.get("prompt_logprobs") is not None)


def compute(kv: KVCacheManager, seq: Request, n: int | None = None) -> None:
    """What one engine step does for seq: allocate, 'compute' n tokens, register full blocks."""
    n = seq.num_tokens - seq.num_computed_tokens if n is None else n
    assert kv.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    kv.cache_full_blocks(seq)


def admit(kv: KVCacheManager, seq: Request) -> list[int]:
    """Claim the prefix-cache hits and compute the rest, as the scheduler does on admission."""
    hits = kv.get_computed_blocks(seq)
    n = seq.num_tokens - len(hits) * BS
    assert kv.allocate_slots(seq, n, hits)
    seq.num_computed_tokens += len(hits) * BS + n
    kv.cache_full_blocks(seq)
    return hits


def test_allocation_counts_blocks_and_free_returns_them():
    kv = KVCacheManager(8, BS)
    seq = make_seq(range(10))
    assert kv.allocate_slots(seq, 10)
    assert len(kv.block_ids(seq.request_id)) == 3 and kv.num_free_blocks == 5
    assert all(kv.ref_cnt[b] == 1 for b in kv.block_ids(seq.request_id))
    seq.num_computed_tokens = 10
    assert kv.allocate_slots(seq, 2)             # tokens 10, 11 still fit in the third block
    assert len(kv.block_ids(seq.request_id)) == 3
    seq.num_computed_tokens = 12
    assert kv.allocate_slots(seq, 1)             # token 12 opens a fourth
    assert len(kv.block_ids(seq.request_id)) == 4 and kv.num_free_blocks == 4
    kv.free(seq.request_id)
    assert kv.block_ids(seq.request_id) == [] and kv.num_free_blocks == 8 and kv.ref_cnt == [0] * 8


def test_allocation_refuses_without_partial_change():
    kv = KVCacheManager(3, BS)
    a = make_seq(range(8))
    assert kv.allocate_slots(a, 8)
    b = make_seq(range(100, 109), "b")
    assert not kv.allocate_slots(b, 9)           # needs 3 blocks, 1 free
    assert kv.block_ids(b.request_id) == [] and kv.num_free_blocks == 1


def test_shared_prefix_hits_and_refcounts():
    kv = KVCacheManager(16, BS)
    a = make_seq(list(range(10)), "a")
    compute(kv, a)
    b = make_seq(list(range(8)) + [50, 51, 52], "b")
    hits = admit(kv, b)
    assert hits == kv.block_ids(a.request_id)[:2]              # two full blocks in common
    assert kv.block_ids(b.request_id)[:2] == kv.block_ids(a.request_id)[:2] and kv.block_ids(b.request_id)[2] != kv.block_ids(a.request_id)[2]
    assert [kv.ref_cnt[x] for x in kv.block_ids(a.request_id)[:2]] == [2, 2]
    kv.free(a.request_id)
    assert [kv.ref_cnt[x] for x in kv.block_ids(b.request_id)[:2]] == [1, 1]
    assert kv.block_ids(b.request_id)[0] not in kv.free_queue  # still owned by b
    kv.free(b.request_id)
    assert kv.num_free_blocks == 16


def test_hash_is_chained_through_the_parent():
    kv = KVCacheManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    compute(kv, a)
    # Same second block, different first block: the second block must not hit.
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")
    assert kv.get_computed_blocks(b) == []
    c = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0], "c")
    assert kv.get_computed_blocks(c) == kv.block_ids(a.request_id)[:2]


def test_cache_salt_separates_hashes():
    kv = KVCacheManager(16, BS)
    compute(kv, make_seq(range(9), "a", salt="alice"))
    assert kv.get_computed_blocks(make_seq(range(9), "b", salt="bob")) == []
    assert kv.get_computed_blocks(make_seq(range(9), "c")) == []
    assert len(kv.get_computed_blocks(make_seq(range(9), "d", salt="alice"))) == 2


def test_salt_applies_from_the_end_of_a_shared_prefix():
    """Blocks wholly before cache_salt_from are hashed unsalted (an operator's shared prompt):
    every salt hits them, and nothing after them."""
    kv = KVCacheManager(16, BS)
    a = make_seq(list(range(9)) + [50, 51, 52, 53], "a", salt="alice")
    a.cache_salt_from = 6          # blocks [0..3] shared; [4..7] holds tokens past it: salted
    compute(kv, a)
    b = make_seq(list(range(9)) + [50, 51, 52, 53], "b", salt="bob")
    b.cache_salt_from = 6
    assert kv.get_computed_blocks(b) == kv.block_ids("a")[:1]
    mine = make_seq(list(range(9)) + [50, 51, 52, 53], "c", salt="alice")
    mine.cache_salt_from = 6
    assert len(kv.get_computed_blocks(mine)) == 3


def test_cache_scope_salts(tmp_path):
    from kvserve.server.routing.cache_scope import CacheScope
    from kvserve.server.stores.keys import ApiKey

    a, b = ApiKey("a", tier="paid"), ApiKey("b", tier="paid")
    key, tier, glob = CacheScope("key"), CacheScope("tier"), CacheScope("global")
    assert key.salt(a, None) != key.salt(b, None)
    assert tier.salt(a, None) == tier.salt(b, None) != tier.salt(ApiKey("c", tier="free"), None)
    assert glob.salt(a, None) is None and glob.salt(a, "x") == glob.salt(b, "x") != glob.salt(b, "y")
    assert key.salt(a, "x") != key.salt(b, "x")
    with pytest.raises(ValueError):
        CacheScope("everyone")


def test_one_prompt_token_is_always_left_to_compute():
    kv = KVCacheManager(16, BS)
    compute(kv, make_seq(range(8), "a"))
    # Prompt of exactly two full blocks, both cached: only the first may be reused.
    assert len(kv.get_computed_blocks(make_seq(range(8), "b"))) == 1
    assert len(kv.get_computed_blocks(make_seq(range(9), "c"))) == 2


def test_prompt_logprobs_and_disabled_cache_get_no_hits():
    kv = KVCacheManager(16, BS)
    compute(kv, make_seq(range(9), "a"))
    assert kv.get_computed_blocks(make_seq(range(9), "b", prompt_logprobs=1)) == []
    off = KVCacheManager(16, BS, enable_prefix_caching=False)
    compute(off, make_seq(range(9), "a"))
    assert off.cached == {} and off.get_computed_blocks(make_seq(range(9), "b")) == []


def test_freed_blocks_stay_reusable_until_evicted_lru():
    kv = KVCacheManager(6, BS)
    a = make_seq(range(100, 109), "a")       # blocks: 2 full + 1 partial
    compute(kv, a)
    a_blocks = list(kv.block_ids(a.request_id))
    kv.free(a.request_id)
    b = make_seq(range(200, 209), "b")
    compute(kv, b)
    b_blocks = list(kv.block_ids(b.request_id))
    kv.free(b.request_id)
    # Free queue (b reused the 3 never-used blocks): a's blocks tail first, then b's tail first.
    assert list(kv.free_queue) == [a_blocks[2], a_blocks[1], a_blocks[0], b_blocks[2], b_blocks[1], b_blocks[0]]
    # Both prefixes are still cached.
    assert kv.get_computed_blocks(make_seq(range(100, 109), "a2")) == a_blocks[:2]
    assert kv.get_computed_blocks(make_seq(range(200, 209), "b2")) == b_blocks[:2]
    # Taking two fresh blocks evicts a's tail (partial, unhashed) then a's second block:
    # a keeps only its first block, b keeps both.
    c = make_seq(range(300, 305), "c")
    assert kv.allocate_slots(c, 5)
    assert kv.block_ids(c.request_id) == [a_blocks[2], a_blocks[1]]
    assert kv.get_computed_blocks(make_seq(range(100, 109), "a3")) == a_blocks[:1]
    assert kv.get_computed_blocks(make_seq(range(200, 209), "b3")) == b_blocks[:2]


def test_hit_on_a_free_block_moves_it_out_of_the_free_queue():
    kv = KVCacheManager(4, BS)
    a = make_seq(range(9), "a")
    compute(kv, a)
    kv.free(a.request_id)
    assert kv.num_free_blocks == 4
    b = make_seq(list(range(8)) + [7, 7, 7, 7, 7, 7, 7], "b")   # 15 tokens: 2 hits + 2 new blocks
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    # Reusing the two hit blocks leaves 2 truly free: the 2 new blocks fit, 3 would not.
    assert kv.can_allocate(b, 7, hits)
    assert not kv.can_allocate(b, 11, hits)
    assert kv.allocate_slots(b, 7, hits)
    assert kv.block_ids(b.request_id)[:2] == hits and kv.num_free_blocks == 0
    assert b.num_computed_tokens == 0            # the scheduler, not the manager, counts the 8 cached tokens


@pytest.mark.parametrize("n", [1, 4, 5, 16])
def test_blocks_needed_matches_ceil(n):
    kv = KVCacheManager(8, BS)
    seq = make_seq(range(n))
    assert kv.allocate_slots(seq, n)
    assert len(kv.block_ids(seq.request_id)) == -(-n // BS)
