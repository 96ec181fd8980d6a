"""DiskKVStore alone (engine/kv_disk_store.py): the size cap evicts least recently used files, a
restart finds them again, a store of another format is left alone, a writer behind drops writes."""

from __future__ import annotations

import threading
import time

import torch

from kvserve.engine.kv_disk_store import DiskKVStore, StoreHeader

HEADER = StoreHeader(model_hash="m", kv_dtype="float16", block_size=2, num_layers=1, num_kv_heads=1, row_width=4)
SHAPE = [1, 2, 2, 1, 4]


def block(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i), dtype=torch.float16)


def h(i: int) -> bytes:
    return bytes([i]) * 16


def file_size(tmp_path) -> int:
    s = DiskKVStore(tmp_path / "probe", HEADER, 1 << 20)
    s.put(h(0), block(0))
    s.flush()
    return s.bytes


def test_the_size_cap_evicts_the_least_recently_used(tmp_path):
    size = file_size(tmp_path)
    s = DiskKVStore(tmp_path / "kv", HEADER, 3 * size)
    for i in (1, 2, 3):
        s.put(h(i), block(i))
        s.flush()
        time.sleep(0.01)                                   # distinct mtimes for the restart below
    assert s.read(h(1), SHAPE, "float16") is not None      # 1 is now the most recently used
    s.put(h(4), block(4))
    s.flush()
    assert [s.has(h(i)) for i in (1, 2, 3, 4)] == [True, False, True, True]
    assert s.bytes == 3 * size
    data = s.read(h(4), SHAPE, "float16")
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float16).view(SHAPE), block(4))

    again = DiskKVStore(tmp_path / "kv", HEADER, 3 * size)
    assert again.bytes == 3 * size and again.has(h(3))
    assert again.read(h(3), SHAPE, "float16") is not None


def test_a_store_of_another_format_is_its_own_directory(tmp_path, caplog):
    s = DiskKVStore(tmp_path, HEADER, 1 << 20)
    s.put(h(1), block(1))
    s.flush()
    other = StoreHeader(**{**{f: getattr(HEADER, f) for f in HEADER.__struct_fields__}, "kv_dtype": "int8"})
    with caplog.at_level("INFO", logger="kvserve.engine"):
        t = DiskKVStore(tmp_path, other, 1 << 20)
    assert not t.has(h(1)) and t.dir != s.dir
    assert sum("of another model or KV format" in r.message for r in caplog.records) == 1


def test_a_writer_behind_drops_writes_instead_of_waiting(tmp_path, monkeypatch):
    gate = threading.Event()
    real = DiskKVStore._write

    def slow(self, hh, b):
        gate.wait(10)
        real(self, hh, b)

    monkeypatch.setattr(DiskKVStore, "_write", slow)
    s = DiskKVStore(tmp_path, HEADER, 1 << 20, queue_blocks=1)
    assert s.put(h(1), block(1))
    deadline = time.monotonic() + 5
    while s._queue.qsize() and time.monotonic() < deadline:   # the writer holds block 1
        time.sleep(0.005)
    assert s.put(h(2), block(2))                            # queued
    assert not s.put(h(3), block(3))                        # dropped, at once
    assert s.dropped_blocks == 1 and s.wants(h(3)) and not s.wants(h(2))
    gate.set()
    s.flush()
    assert s.has(h(1)) and s.has(h(2)) and not s.has(h(3))
