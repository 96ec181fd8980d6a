"""The KV cache's second tier: full blocks on local disk, found again by their chained hash.

The prefix cache (kv_cache_manager.py) forgets a block when its slot is reused. With a disk tier
(`kv_offload_dir`), full blocks are also written to disk under the same chained hash the prefix
cache uses (cache salt included, so keys stay isolated), every full block as it is computed
(`kv_offload_write_through`, the default, so a restart is warm) or only the ones evicted:

    step N+1, after schedule and before the forward (ModelRunner.execute's hook):
        the blocks noted since step N are copied out of the KV tensors (one index_select)
        and queued to the writer thread; a full queue drops them (a step never waits on disk);
        the last step's, when the store closes
    writer thread:  checksum, write to a temporary file, rename; LRU files out past the size cap
                    (the directory's as a whole, whichever process or model wrote them)
    a waiting request's RAM prefix-cache hit stops at block k:
        blocks k, k+1, ... are looked up on disk, read, verified and written into free blocks,
        registered in the prefix cache as if computed here; the request is then admitted with a
        longer hit. A chain longer than one step's load budget (max_step_ms, priced at the measured
        read time of a block) lands over several steps; the request waits for it (`DiskHit.loading`).

A store is a directory `DIR/kv-<fingerprint>/`, the fingerprint a hash of its header: the model's
content hash (its loaded weights, packed or not), KV dtype, block size, layers, KV heads and row
width. A server started on the same DIR with the same model starts warm; stores of other models
or formats are left alone (one log line). Each block file carries its hash, the store's
fingerprint, shape, dtype and a checksum: a truncated, corrupt or foreign file is a miss and is
deleted, never loaded. A write that fails (a full disk) stops the writes with one warning: the
engine goes on RAM-only. Blocks under a LoRA adapter are never written (an adapter's salt names a
load in this process only). Replicas on one machine can share DIR: a hash missing from this
process's index is looked for on disk, and the size cap holds for DIR as a whole
(engine/kv_disk_quota.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator

import numpy as np
import torch

from kvserve.engine.kv_disk_store import DiskKVStore, StoreHeader

logger = logging.getLogger("kvserve.engine")

__all__ = ["DiskHit", "DiskKVStore", "KVOffload", "StoreHeader", "attach_offload", "model_fingerprint"]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch's copies of blocks on the calling thread alone. They are memory-bound, and where other
    processes share the cores a team of two threads waits at each barrier for a descheduled one:
    at load ~4 on 2 cores, stacking 125 int8 blocks took 800 ms on two threads and 14 ms on one,
    their 30 layers' index_copy_ 215 ms and 14 ms (BENCHMARKS.md, issue 51)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def model_fingerprint(model: torch.nn.Module) -> str:
    """A content hash of the loaded weights: every tensor the modules hold (parameters, buffers and
    packed weights kept as plain attributes), with its name, shape and dtype (~0.3 s per 100 MB)."""
    h = hashlib.blake2b(digest_size=16)
    seen: set[int] = set()
    for name, mod in model.named_modules():
        items = [*mod._parameters.items(), *mod._buffers.items(),
                 *sorted((k, v) for k, v in vars(mod).items() if isinstance(v, torch.Tensor))]
        for k, t in items:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            h.update(f"{name}.{k}{tuple(t.shape)}{t.dtype}".encode())
            if t.numel():
                h.update(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


class DiskHit(list):
    """A prefix-cache hit extended from the disk tier; `loading`: more of the chain is on disk and
    lands in the coming steps (the request waits for it rather than computing it)."""

    loading: bool = False


class KVOffload:
    """The engine's side of the tier, between the KV manager (hashes, free blocks, `offload_pending`)
    and the runner (`read_blocks`, `write_blocks` on the KV tensors). Runs on the core's thread."""

    def __init__(self, store: DiskKVStore, kv, runner, *, write_through: bool = True,
                 step_budget_s: float | None = None):
        self.store, self.kv, self.runner = store, kv, runner
        self.write_through = write_through
        self.step_budget_s = step_budget_s          # seconds of block loads per step (None: no cap)
        self.read_seconds = 1e-3                    # per block: measured (moving average)
        self.hit_blocks = 0                         # blocks a request found on disk
        self._spent = 0.0
        h = store.header
        self.shape = [h.num_layers, 2, h.block_size, h.num_kv_heads, h.row_width]
        # the last step's blocks are noted for the next step's save: an engine stopping (a restart)
        # saves them as its store closes, or a warm restart would miss the end of the last prompt
        store.before_close = self.save

    def begin_step(self) -> None:
        self._spent = 0.0

    def save(self) -> None:
        """Copy the blocks noted by the manager out of the KV tensors and queue them (before the
        forward that may overwrite them)."""
        kv = self.kv
        pending, kv.offload_pending = kv.offload_pending, []
        store = self.store
        todo = [(h, b) for h, b in dict(pending).items() if store.wants(h)]
        room = store.room()
        if len(todo) > room:
            store.dropped_blocks += len(todo) - room
            todo = todo[:room]
        if not todo:
            return
        with one_thread():
            data = self.runner.read_blocks([b for _, b in todo])
        for j, (h, _) in enumerate(todo):
            store.put(h, data[j])

    def extend_hit(self, kv, hashes: list[bytes], hits: list[int]) -> list[int]:
        """hits: the RAM hit of the chain `hashes` (its first len(hits) blocks). Land the blocks that
        follow it on disk, as many as this step's load budget and the free pool allow."""
        store, k = self.store, len(hits)
        found = 0
        while k + found < len(hashes) and store.has(hashes[k + found]):
            found += 1
        if not found:
            return hits
        n = found
        if self.step_budget_s is not None:
            left = self.step_budget_s - self._spent
            n = min(n, max(0 if self._spent else 1, int(left / self.read_seconds)))
        keep = set(hits)
        spare = kv.num_free_blocks - sum(1 for b in hits if kv.ref_cnt[b] == 0) - 1
        pool_bound = spare < n
        n = max(0, min(n, spare))
        hit = DiskHit(hits)
        if n == 0:
            hit.loading = not pool_bound
            return hit
        t0 = time.perf_counter()
        victims = kv.take_free_blocks(n, keep)
        self.save()                                 # the victims' old contents first, if noted
        landed: list[tuple[int, bytes]] = []
        buf = None
        for b, h in zip(victims, hashes[k:k + n]):
            data = store.read(h, self.shape, self.runner.kv_dtype_name)
            if data is None:
                break
            if buf is None:
                buf = np.empty((n, len(data)), dtype=np.uint8)
            buf[len(landed)] = np.frombuffer(data, dtype=np.uint8)      # the one copy of the file's bytes
            landed.append((b, h))
        if landed:
            dtype = self.runner.kv_caches[0].dtype
            with one_thread():
                self.runner.write_blocks([b for b, _ in landed],
                                         torch.from_numpy(buf[:len(landed)]).view(dtype).view(-1, *self.shape))
        kv.return_free_blocks(victims[len(landed):])
        for b, h in landed:
            kv.register_cached(b, h)
            hit.append(b)
        self.hit_blocks += len(landed)
        seconds = time.perf_counter() - t0
        self._spent += seconds
        if landed:
            self.read_seconds = 0.7 * self.read_seconds + 0.3 * seconds / len(landed)
        hit.loading = len(landed) == n and n < found and not pool_bound
        return hit

    def stats(self) -> dict:
        return {**self.store.stats(), "kv_offload_hit_blocks": self.hit_blocks}


def attach_offload(config, model, kv, runner) -> KVOffload | None:
    """The disk tier of an engine whose config names `kv_offload_dir` (None without one, and where
    it does not serve: sliding-window pools, tensor-parallel ranks)."""
    if not config.kv_offload_dir:
        return None
    if not hasattr(kv, "cached") or kv.sliding_window is not None or config.tensor_parallel_size > 1:
        # (each rank holds its own heads' KV; a pool per layer type hashes blocks the tier does not read)
        logger.warning("KV disk tier: not used with sliding-window KV pools or tensor parallelism; the KV cache "
                       "stays RAM-only")
        return None
    cfg, c = model.config, runner.kv_caches[0]
    header = StoreHeader(model_hash=model_fingerprint(model), kv_dtype=runner.kv_dtype_name,
                         block_size=kv.block_size, num_layers=cfg.num_hidden_layers, num_kv_heads=c.shape[3],
                         row_width=c.shape[4])
    per_block = runner.bytes_per_layer_block(model, kv.block_size, c.dtype) * cfg.num_hidden_layers
    store = DiskKVStore(config.kv_offload_dir, header, config.kv_offload_bytes(),
                        queue_blocks=max(8, (64 << 20) // per_block))
    step = config.max_step_ms / 1000 if config.max_step_ms else None
    off = KVOffload(store, kv, runner, write_through=config.kv_offload_write_through, step_budget_s=step)
    kv.offload = runner.offload = off
    return off
