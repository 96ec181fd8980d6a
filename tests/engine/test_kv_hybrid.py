"""HybridKVCacheManager on synthetic requests (no model): the sliding layers' pool holds only the
window while the full layers' table grows; prefix hits need the local blocks inside the window of
the hit and are cut short where one was evicted. (Served end to end: tests/model/test_families.py.)"""

from __future__ import annotations

from test_kv_cache_manager import BS, make_seq

from kvserve.engine.kv_hybrid import HybridKVCacheManager, local_pool_blocks

WINDOW = 8


def step(kv: HybridKVCacheManager, seq, n: int, hits=()) -> None:
    assert kv.allocate_slots(seq, n, hits)
    seq.num_computed_tokens += len(hits) * BS + n
    kv.cache_full_blocks(seq)


def brute_force_hit(kv: HybridKVCacheManager, seq) -> int:
    """The longest k whose full blocks 0..k-1 and local blocks in the window of k*BS are cached."""
    hashes = kv.full.block_hashes(seq, seq.num_tokens)
    best = 0
    for k in range(1, (seq.num_tokens - 1) // BS + 1):
        first = max(0, k * BS - WINDOW + 1) // BS
        if all(h in kv.full.cached for h in hashes[:k]) and all(h in kv.local.cached for h in hashes[first:k]):
            best = k
        if hashes[k - 1] not in kv.full.cached:
            break
    return best


def test_local_blocks_stay_within_the_window():
    kv = HybridKVCacheManager(64, 16, BS, True, WINDOW)
    a = make_seq(range(100, 140), "a")
    held = []
    for _ in range(10):
        step(kv, a, 4)
        held.append(kv.local.num_held_blocks("a"))
    assert kv.full.num_held_blocks("a") == 10 and len(kv.local_block_ids("a")) == 10
    assert max(held) <= -(-(WINDOW - 1) // BS) + 1
    assert kv.local_block_ids("a")[:6] == [-1] * 6
    kv.free("a")
    assert kv.num_used_blocks == 0 and kv.local.num_used_blocks == 0
    # a later prompt sharing 32 tokens hits 8 blocks: full 0..7, local only the window's 6..7
    b = make_seq(list(range(100, 132)) + [1, 2, 3, 4], "b")
    hit = kv.get_computed_blocks(b)
    assert len(hit) == 8 == brute_force_hit(kv, b)
    assert hit.local[:6] == [-1] * 6 and all(x >= 0 for x in hit.local[6:])
    step(kv, b, 4, hit)
    assert kv.local.num_held_blocks("b") <= 3 and kv.local_block_ids("b")[:6] == [-1] * 6


def test_a_hit_stops_before_an_evicted_local_block():
    kv = HybridKVCacheManager(64, 6, BS, True, WINDOW)
    a = make_seq(range(100, 140), "a")
    for _ in range(10):
        step(kv, a, 4)
    kv.free("a")
    # six fresh blocks at once take the whole local pool: every local block of "a" is evicted
    d = make_seq(range(500, 524), "d")
    step(kv, d, 24)
    kv.free("d")
    b = make_seq(list(range(100, 132)) + [1, 2, 3, 4], "b")
    assert len(kv.full.get_computed_blocks(b)) == 8         # the full pool still has the prefix ...
    assert kv.get_computed_blocks(b) == [] == kv.get_computed_blocks(b).local   # ... the local one not
    # partly evicted: after a prompt whose local blocks 0..5 are the newest, hits are cut to them
    c = make_seq(range(100, 124), "c")
    step(kv, c, 24, kv.get_computed_blocks(c))
    kv.free("c")
    for tail in (12, 20, 28, 36):
        e = make_seq(list(range(100, 100 + tail)) + [7, 8, 9, 10], f"e{tail}")
        hit = kv.get_computed_blocks(e)
        assert len(hit) == brute_force_hit(kv, e) == min(tail, 24) // BS
        kv.free(e.request_id)


def test_a_short_pool_refuses_both_allocations():
    kv = HybridKVCacheManager(64, 3, BS, True, WINDOW)
    a = make_seq(range(20), "a")
    assert not kv.allocate_slots(a, 16)                      # 4 local blocks needed, 3 exist
    assert kv.full.num_used_blocks == 0 and kv.block_ids("a") == []
    assert local_pool_blocks(WINDOW, BS, 2, 16) == 2 * 4 + 4
