"""The router (engine/replica_router.py) with two KV tiers: a replica holds a prefix in RAM (what the
router sent it, bounded by its pool) or on disk (what it sent to any replica writing the same disk
store, plus what the store reported holding); the longest prefix in either tier wins, a RAM hit
beats a disk hit of the same length, load still balances, and a replica sharing no store with the
chosen one that holds a longer prefix is named as the donor to fetch it from."""

from __future__ import annotations

from kvserve.engine.disagg import prompt_block_hashes
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.messages import EngineCoreRequest
from kvserve.engine.replica_router import PrefixAffinityRouter, prefix_hashes
from kvserve.sampling_params import SamplingParams

BS = 4
A = list(range(64))                  # 16 blocks
B = list(range(500, 564))


def router(n: int = 3, **kw) -> PrefixAffinityRouter:
    return PrefixAffinityRouter(n, BS, balance_slack=2, **kw)


def settle(r: PrefixAffinityRouter) -> None:
    for rep in r.replicas:
        rep.in_flight = 0


def test_router_hashes_are_the_kv_cache_managers():
    """A disk store's own hashes (a warm restart's summary) only count if they are the same chain."""
    kv = KVCacheManager(8, BS)
    for salt, salt_from in ((None, 0), ("key-1", 0), ("key-1", 20)):
        req = EngineCoreRequest(request_id="r", prompt_token_ids=A, sampling_params=SamplingParams(),
                                arrival_time=0.0, cache_salt=salt, cache_salt_from=salt_from)
        assert prefix_hashes(A, BS, 64, salt, salt_from) == prompt_block_hashes(kv, req, len(A) // BS)


def test_replicas_sharing_a_disk_store_hold_each_others_prefixes_and_ram_wins_a_tie():
    r = router()
    r.set_tier(0, disk="node1:/kv")
    r.set_tier(1, disk="node1:/kv")
    r.set_tier(2, disk="node2:/kv")
    first = r.decide(A)
    assert first.blocks == 0 and first.donor is None
    x = first.index
    settle(r)
    again = r.decide(A)
    assert (again.index, again.blocks) == (x, 16)               # RAM and disk: it stays
    settle(r)
    same_store = ({0, 1} - {x}) if x in (0, 1) else set()
    for i in same_store:
        assert r.held(i, prefix_hashes(A, BS, 64)) == (16, 0)    # on its disk, not in its RAM
    r.replicas[x].in_flight = 10                                 # loaded past the slack
    moved = r.decide(A)
    assert moved.index != x
    if x in (0, 1):
        assert moved.index in same_store and moved.blocks == 16 and moved.donor is None   # the shared disk
        assert r.disk_hits == 1
    else:
        assert moved.blocks == 0 and moved.donor == x and moved.donor_blocks == 16       # another machine


def test_a_ram_hit_beats_a_disk_hit_of_the_same_length_and_a_longer_disk_hit_beats_ram():
    r = router(2)
    r.set_tier(1, disk="n:/kv", held=prefix_hashes(A, BS, 8))    # its store: the first 8 blocks
    r.replicas[0].seen.update((h, None) for h in prefix_hashes(A, BS, 8))   # RAM of replica 0: the same 8
    assert r.decide(A[:36]).index == 0                           # 8 and 8: RAM wins
    settle(r)
    r2 = router(2)
    r2.set_tier(1, disk="n:/kv", held=prefix_hashes(A, BS, 12))
    r2.replicas[0].seen.update((h, None) for h in prefix_hashes(A, BS, 8))
    d = r2.decide(A)
    assert (d.index, d.blocks) == (1, 12)                        # 12 on disk beat 8 in RAM
    assert r2.held(1, prefix_hashes(A, BS, 64)) == (16, 16)      # now sent there: both tiers


def test_equal_holders_go_to_the_less_loaded():
    r = router(3)
    for i in range(3):
        r.set_tier(i, disk="n:/kv", held=prefix_hashes(A, BS, 16))
    r.replicas[0].in_flight, r.replicas[1].in_flight, r.replicas[2].in_flight = 2, 1, 2
    assert r.decide(A).index == 1


def test_load_balance_still_applies_and_the_loaded_holder_is_the_donor():
    r = router(2, min_fetch_blocks=2)
    x = r.route(A)
    r.replicas[x].in_flight = 10
    d = r.decide(A)
    assert d.index == 1 - x and (d.donor, d.donor_blocks) == (x, 16)
    assert r.decide(A, fetch=False).donor is None
    settle(r)
    r.replicas[x].in_flight = 10
    short = r.decide(A[:4] + B)               # x holds 1 block of it: not worth a fetch
    assert short.index == 1 - x and short.donor is None


def test_a_dead_replica_forgets_its_ram_not_its_disk_store():
    r = router(2)
    r.set_tier(0, disk="n:/kv")
    r.set_tier(1, disk="n:/kv")
    x = r.route(A)
    r.mark_dead(x)
    assert r.decide(A).blocks == 16                              # the other one reads the same store
    r.revive(x)
    r.set_tier(x, disk="n:/kv")                                  # restarted on the same directory
    assert r.held(x, prefix_hashes(A, BS, 64)) == (16, 0)
    r.set_tier(x, disk=None)                                     # restarted without a disk tier
    assert r.held(x, prefix_hashes(A, BS, 64)) == (0, 0)


def test_what_a_tier_remembers_is_bounded_by_its_size():
    r = router(1)
    r.set_tier(0, ram_blocks=6, disk="n:/kv", disk_blocks=10)
    r.route(A)                                                   # 16 blocks
    assert len(r.replicas[0].seen) == 6 and len(r.disks["n:/kv"]) == 10
    assert r.held(0, prefix_hashes(A, BS, 64)) == (10, 6)        # first blocks kept: a pool evicts tails first
    r.route(B)
    assert r.held(0, prefix_hashes(A, BS, 64)) == (0, 0)
    assert r.held(0, prefix_hashes(B, BS, 64)) == (10, 6)


def test_blocks_under_an_adapter_are_not_noted_on_disk():
    r = router(2)
    r.set_tier(0, disk="n:/kv")
    r.set_tier(1, disk="n:/kv")
    x = r.decide(A, to_disk=False).index
    assert r.held(1 - x, prefix_hashes(A, BS, 64)) == (0, 0)
