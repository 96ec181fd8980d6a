"""The KV cache's second tier: full blocks on local disk, found again by their chained hash.

The prefix cache (kv_cache_manager.py) forgets a block when its slot is reused. With a disk tier
(`kv_offload_dir`), full blocks are also written to disk under the same chained hash the prefix
cache uses (cache salt included, so keys stay isolated), every full block as it is computed
(`kv_offload_write_through`, the default, so a restart is warm) or only the ones evicted:

    step N+1, after schedule and before the forward (ModelRunner.execute's hook):
        the blocks noted since step N are copied out of the KV tensors (one index_select)
        and queued to the writer thread; a full queue drops them (a step never waits on disk)
    writer thread:  checksum, write to a temporary file, rename; LRU files out past the size cap
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
process's index is looked for on disk.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

import msgspec
import torch

logger = logging.getLogger("kvserve.engine")

MAGIC = b"KVB1"
try:
    import xxhash

    def _checksum(data) -> tuple[str, int]:
        return "xxh3_64", xxhash.xxh3_64_intdigest(data)
except ImportError:   # pragma: no cover - xxhash comes with the venv
    import zlib

    def _checksum(data) -> tuple[str, int]:
        return "crc32", zlib.crc32(data)


class StoreHeader(msgspec.Struct, kw_only=True, frozen=True):
    """What a store's blocks depend on: another value of any field is another store."""

    version: int = 1
    model_hash: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    row_width: int

    def fingerprint(self) -> str:
        return hashlib.blake2b(msgspec.json.encode(self), digest_size=8).hexdigest()


class BlockHeader(msgspec.Struct, kw_only=True):
    hash: bytes
    fingerprint: str
    dtype: str
    shape: list[int]
    checksum_kind: str
    checksum: int


_block_encoder = msgspec.msgpack.Encoder()
_block_decoder = msgspec.msgpack.Decoder(BlockHeader)


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


class DiskKVStore:
    """Block files under `root/kv-<fingerprint>/`, an LRU index of them, and the writer thread."""

    def __init__(self, root: str | os.PathLike, header: StoreHeader, max_bytes: int, queue_blocks: int = 64):
        self.header = header
        self.fingerprint = header.fingerprint()
        self.dir = Path(root) / f"kv-{self.fingerprint}"
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()     # hash -> file size, least recent first
        self._queued: set[bytes] = set()
        self.bytes = 0
        self.writable = True
        self.written_blocks = self.dropped_blocks = self.read_blocks = self.bad_blocks = 0
        self._open(root)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_blocks)
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()
        atexit.register(self.flush, 10.0)          # an offline run's last blocks reach the disk

    def _open(self, root: str | os.PathLike) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        hfile = self.dir / "header.json"
        if not hfile.exists():
            hfile.write_bytes(msgspec.json.encode(self.header))
        others = [p.name for p in Path(root).glob("kv-*") if p.is_dir() and p != self.dir]
        if others:
            logger.info("KV disk tier: ignoring %d store(s) in %s of another model or KV format (%s)",
                        len(others), root, ", ".join(sorted(others)[:4]))
        files = []
        for p in self.dir.glob("*/*.kvb"):
            try:
                st = p.stat()
                files.append((st.st_mtime_ns, bytes.fromhex(p.stem), st.st_size))
            except (OSError, ValueError):
                continue
        for _, h, size in sorted(files):
            self._index[h] = size
            self.bytes += size
        self._evict_to(self.max_bytes)
        if self._index:
            logger.info("KV disk tier: %d blocks (%.1f MiB) found in %s", len(self._index), self.bytes / 2**20,
                        self.dir)

    def path(self, h: bytes) -> Path:
        x = h.hex()
        return self.dir / x[:2] / f"{x}.kvb"

    # ---- lookups (the core's thread) ------------------------------------------------------------
    def has(self, h: bytes) -> bool:
        with self._lock:
            if h in self._index:
                return True
        try:   # written by another replica sharing the directory
            size = self.path(h).stat().st_size
        except OSError:
            return False
        with self._lock:
            if h not in self._index:
                self._index[h] = size
                self.bytes += size
        return True

    def read(self, h: bytes, shape: list[int], dtype: str) -> bytes | None:
        """The block's verified bytes, or None (missing, truncated, corrupt or foreign: deleted)."""
        p = self.path(h)
        try:
            raw = p.read_bytes()
        except OSError:
            self._forget(h)
            return None
        data = self._verify(raw, h, shape, dtype)
        if data is None:
            self.bad_blocks += 1
            logger.warning("KV disk tier: %s is truncated, corrupt or foreign: deleted", p.name)
            self._forget(h, unlink=True)
            return None
        with self._lock:
            if h in self._index:
                self._index.move_to_end(h)
        self.read_blocks += 1
        return data

    def _verify(self, raw: bytes, h: bytes, shape: list[int], dtype: str) -> memoryview | None:
        if len(raw) < 8 or raw[:4] != MAGIC:
            return None
        (n,) = struct.unpack_from("<I", raw, 4)
        try:
            head = _block_decoder.decode(raw[8:8 + n])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        data = memoryview(raw)[8 + n:]
        want = torch.Size(shape).numel() * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        if (head.hash != h or head.fingerprint != self.fingerprint or head.shape != shape or head.dtype != dtype
                or len(data) != want or _checksum(data) != (head.checksum_kind, head.checksum)):
            return None
        return data

    def _forget(self, h: bytes, unlink: bool = False) -> None:
        with self._lock:
            size = self._index.pop(h, None)
            if size is not None:
                self.bytes -= size
        if unlink:
            try:
                self.path(h).unlink()
            except OSError:
                pass

    # ---- writes -----------------------------------------------------------------------------
    def wants(self, h: bytes) -> bool:
        """Not on disk nor queued, and the store still takes writes."""
        with self._lock:
            return self.writable and h not in self._index and h not in self._queued

    def room(self) -> int:
        return self._queue.maxsize - self._queue.qsize()

    def put(self, h: bytes, block: torch.Tensor) -> bool:
        """Queue one block ([layers, 2, block_size, heads, width], on the CPU) for writing; False
        (dropped) when the writer is behind."""
        with self._lock:
            self._queued.add(h)
        try:
            self._queue.put_nowait((h, block))
            return True
        except queue.Full:
            with self._lock:
                self._queued.discard(h)
            self.dropped_blocks += 1
            return False

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                h, block = item
                if self.writable:
                    self._write(h, block)
                with self._lock:
                    self._queued.discard(h)
            finally:
                self._queue.task_done()

    def _write(self, h: bytes, block: torch.Tensor) -> None:
        data = memoryview(block.contiguous().view(torch.uint8).reshape(-1).numpy())
        kind, value = _checksum(data)
        head = _block_encoder.encode(BlockHeader(hash=h, fingerprint=self.fingerprint,
                                                 dtype=str(block.dtype).removeprefix("torch."),
                                                 shape=list(block.shape), checksum_kind=kind, checksum=value))
        size = 8 + len(head) + len(data)
        if size > self.max_bytes:
            return
        with self._lock:
            self._evict_to(self.max_bytes - size)
        p = self.path(h)
        try:
            self._write_file(p, [MAGIC, struct.pack("<I", len(head)), head, data])
        except OSError as e:
            self.writable = False
            logger.warning("KV disk tier: cannot write %s (%s): writes stop, the KV cache is RAM-only now", p, e)
            return
        with self._lock:
            self._index[h] = size
            self.bytes += size
        self.written_blocks += 1

    @staticmethod
    def _write_file(p: Path, parts: list) -> None:
        """Write to a temporary name and rename: a reader sees a whole file or none."""
        p.parent.mkdir(exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.writelines(parts)
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _evict_to(self, limit: int) -> None:
        """(under the lock) Delete least recently used files until the store holds <= limit bytes."""
        while self._index and self.bytes > limit:
            h, size = self._index.popitem(last=False)
            self.bytes -= size
            try:
                self.path(h).unlink()
            except OSError:
                pass

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the queued blocks are written (tests, shutdown)."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=5)

    def stats(self) -> dict:
        return {"kv_offload_blocks": len(self._index), "kv_offload_bytes": self.bytes,
                "kv_offload_written_blocks": self.written_blocks, "kv_offload_read_blocks": self.read_blocks,
                "kv_offload_dropped_blocks": self.dropped_blocks, "kv_offload_bad_blocks": self.bad_blocks}


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
        blocks, landed = [], []
        for b, h in zip(victims, hashes[k:k + n]):
            data = store.read(h, self.shape, self.runner.kv_dtype_name)
            if data is None:
                break
            blocks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            landed.append((b, h))
        if blocks:
            dtype = self.runner.kv_caches[0].dtype
            self.runner.write_blocks([b for b, _ in landed], torch.stack(blocks).view(dtype).view(-1, *self.shape))
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
    """The disk tier of an engine whose config names `kv_offload_dir` (None without one, and for a
    KV pool per layer type, which it does not serve)."""
    if not config.kv_offload_dir:
        return None
    if not hasattr(kv, "cached") or kv.sliding_window is not None:
        logger.warning("KV disk tier: not used with sliding-window KV pools; the KV cache stays RAM-only")
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
