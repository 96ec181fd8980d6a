"""One size cap for a shared KV offload directory (engine/kv_disk_quota.py): stores of two replicas,
or of two models, writing under one directory keep it within the cap as a whole, least recently
used files out first whoever wrote them."""

from __future__ import annotations

import time
from pathlib import Path

from kvserve.engine.kv_disk_quota import LOCK_NAME, DirQuota
from kvserve.engine.kv_disk_store import DiskKVStore, StoreHeader
from tests.engine.test_kv_offload_store import HEADER, SHAPE, block, file_size

OTHER = StoreHeader(model_hash="n", kv_dtype="float16", block_size=2, num_layers=1, num_kv_heads=1, row_width=4)


def h(i: int) -> bytes:
    return i.to_bytes(2, "big") * 8


def on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.glob("kv-*/*/*.kvb"))


def test_two_replicas_on_one_directory_keep_its_cap_and_evict_the_oldest_of_either(tmp_path):
    size = file_size(tmp_path)
    a = DiskKVStore(tmp_path / "kv", HEADER, 4 * size)        # two processes' stores: one index each
    b = DiskKVStore(tmp_path / "kv", HEADER, 4 * size)
    for i, s in [(1, a), (2, b), (3, a), (4, b)]:
        s.put(h(i), block(i))
        s.flush()
        time.sleep(0.01)                                       # distinct mtimes
    assert on_disk(tmp_path / "kv") == 4 * size
    assert b.read(h(1), SHAPE, "float16") is not None          # b reads a's block 1: now the most recent
    time.sleep(0.01)
    a.put(h(5), block(5))
    a.flush()
    assert on_disk(tmp_path / "kv") == 4 * size                # each cap alone would allow 8 blocks here
    assert not a.path(h(2)).exists()                           # b's block 2 was the least recently used
    assert a.has(h(4)) and b.has(h(5)) and a.has(h(1))
    assert b.read(h(2), SHAPE, "float16") is None              # b's own index still had it: a miss
    assert DirQuota(tmp_path / "kv", 4 * size).used() == 4 * size


def test_two_models_under_one_directory_share_its_cap(tmp_path):
    size = file_size(tmp_path)
    a = DiskKVStore(tmp_path / "kv", HEADER, 6 * size)
    b = DiskKVStore(tmp_path / "kv", OTHER, 6 * size)
    assert a.dir != b.dir
    for i in range(5):
        a.put(h(i), block(i))
        b.put(h(100 + i), block(i))
    a.flush()
    b.flush()
    assert on_disk(tmp_path / "kv") == 6 * size
    kept = [(s, i) for s, base in ((a, 0), (b, 100)) for i in range(base, base + 5) if s.path(h(i)).exists()]
    assert len(kept) == 6 and all(s.read(h(i), SHAPE, "float16") is not None for s, i in kept)
    assert a.bytes <= 6 * size and b.bytes <= 6 * size         # an index never outgrows the cap


def test_concurrent_writers_never_overfill_the_directory(tmp_path):
    size = file_size(tmp_path)
    cap = 40 * size                                            # headroom: a scan frees one block more
    stores = [DiskKVStore(tmp_path / "kv", HEADER, cap) for _ in range(3)]    # three writer threads
    for i in range(60):
        for k, s in enumerate(stores):
            s.put(h(1000 * k + i), block(i))
    for s in stores:
        s.flush()
    final = on_disk(tmp_path / "kv")
    assert cap - 2 * size <= final <= cap and sum(s.dropped_blocks for s in stores) == 0
    assert DirQuota(tmp_path / "kv", cap).used() >= final     # the count is exact or over, never under


def test_a_restart_with_a_smaller_cap_trims_the_directory_and_an_uncounted_one_is_counted(tmp_path):
    size = file_size(tmp_path)
    s = DiskKVStore(tmp_path / "kv", HEADER, 8 * size)
    for i in range(6):
        s.put(h(i), block(i))
        s.flush()
        time.sleep(0.01)
    s.close()
    (tmp_path / "kv" / LOCK_NAME).unlink()                     # a directory written before the shared count
    small = DiskKVStore(tmp_path / "kv", HEADER, 4 * size)
    assert on_disk(tmp_path / "kv") == 4 * size == small.bytes
    assert not small.has(h(0)) and not small.has(h(1)) and small.has(h(5))
