"""DiskKVStore: the KV disk tier's files (engine/kv_offload.py says what the tier does).

    DIR/kv-<fingerprint>/header.json            the StoreHeader the fingerprint hashes
    DIR/kv-<fingerprint>/<h[:2]>/<h>.kvb         one block: MAGIC, a 4-byte header length, a msgpack
                                                 BlockHeader (hash, fingerprint, dtype, shape, mac),
                                                 the block's raw bytes [layers, 2, block_size,
                                                 kv_heads, row width]

`mac` is an HMAC-SHA256, under the directory's secret key (DIR/.kv-key, kv_disk_quota.py), of the
header's fields and the bytes: a block edited, swapped or planted by anyone without the key fails
it and is a miss (deleted), never loaded. Directories are 0700, files 0600, created with
O_EXCL|O_NOFOLLOW (kv_disk_quota.py's `private_dir`, `write_new`).

The index (hash -> size, least recently used first) is rebuilt from the files' mtimes at start.
Lookups and reads run on the core's thread; writes on the store's own thread, through a bounded
queue; both take one lock around the index. The size cap is the whole directory's, shared with
every process (replica) and store writing under it (engine/kv_disk_quota.py): each write makes
room by deleting the directory's least recently used block files first.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import itertools
import logging
import os
import queue
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

from kvserve.engine.kv_disk_quota import DirQuota, directory_key, private_dir, write_new

logger = logging.getLogger("kvserve.engine")

MAGIC = b"KVB2"


class StoreHeader(msgspec.Struct, kw_only=True, frozen=True):
    """What a store's blocks depend on: another value of any field is another store."""

    version: int = 2           # 2: blocks carry an HMAC, not a checksum
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
    mac: bytes


def block_mac(key: bytes, h: bytes, fingerprint: str, dtype: str, shape: list[int], data) -> bytes:
    """HMAC-SHA256 of a block's identity and bytes under the directory's key."""
    m = hmac.new(key, digestmod=hashlib.sha256)
    m.update(msgspec.msgpack.encode([h, fingerprint, dtype, shape]))
    m.update(data)
    return m.digest()


_block_encoder = msgspec.msgpack.Encoder()
_block_decoder = msgspec.msgpack.Decoder(BlockHeader)


def _read_regular(p: Path) -> bytes:
    """A block file's bytes: never through a symlink, never a FIFO or device (OSError instead)."""
    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{p} is not a regular file")
        return f.read()


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
        self.quota = DirQuota(root, max_bytes)       # makes and checks the private root
        self.key = directory_key(self.quota.root)
        self.before_close: Callable[[], None] | None = None   # the engine's blocks noted but not queued yet
        self._open(root)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_blocks)
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()
        atexit.register(self.flush, 10.0)          # an offline run's last blocks reach the disk

    def _open(self, root: str | os.PathLike) -> None:
        private_dir(self.dir)
        hfile = self.dir / "header.json"
        try:
            write_new(hfile, [msgspec.json.encode(self.header)])
        except FileExistsError:
            pass
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
        self._dropped(self.quota.write(0, lambda: None))     # a directory over the cap (a smaller one now)
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
                self._note(h, size)
        return True

    def read(self, h: bytes, shape: list[int], dtype: str) -> bytes | None:
        """The block's verified bytes, or None (missing, truncated, corrupt or foreign: deleted)."""
        p = self.path(h)
        try:
            raw = _read_regular(p)
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
        try:
            os.utime(p)                              # the LRU order a restart rebuilds from mtimes
        except OSError:
            pass
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
                or len(data) != want or not hmac.compare_digest(
                    head.mac, block_mac(self.key, h, self.fingerprint, dtype, shape, data))):
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

    def recent_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` hashes the store holds, most recently used first (read only: a replica's
        summary for the gateway's router)."""
        with self._lock:
            return list(itertools.islice(reversed(self._index), limit))

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
        dtype, shape = str(block.dtype).removeprefix("torch."), list(block.shape)
        head = _block_encoder.encode(BlockHeader(hash=h, fingerprint=self.fingerprint, dtype=dtype, shape=shape,
                                                 mac=block_mac(self.key, h, self.fingerprint, dtype, shape, data)))
        size = 8 + len(head) + len(data)
        if size > self.max_bytes:
            return
        p, parts = self.path(h), [MAGIC, struct.pack("<I", len(head)), head, data]
        try:
            removed = self.quota.write(size, lambda: self._write_file(p, parts))
        except OSError as e:
            self.writable = False
            logger.warning("KV disk tier: cannot write %s (%s): writes stop, the KV cache is RAM-only now", p, e)
            return
        self._dropped(removed)
        with self._lock:
            self._note(h, size)
        self.written_blocks += 1

    def _note(self, h: bytes, size: int) -> None:
        """(under the lock) Index a file on disk as the most recent. Another process's writes may have
        deleted files still indexed here (a read of one is a miss): past the cap, the oldest entries
        are certainly stale or soon evicted, and are forgotten (their files stay)."""
        self.bytes += size - self._index.pop(h, 0)
        self._index[h] = size
        while self.bytes > self.max_bytes and len(self._index) > 1:
            self.bytes -= self._index.popitem(last=False)[1]

    def _dropped(self, paths: list[Path]) -> None:
        """Forget the files the directory's cap deleted (this store's; another's are not indexed here)."""
        if not paths:
            return
        with self._lock:
            for p in paths:
                if p.parent.parent != self.dir:
                    continue
                try:
                    size = self._index.pop(bytes.fromhex(p.stem), None)
                except ValueError:
                    continue
                if size is not None:
                    self.bytes -= size

    @staticmethod
    def _write_file(p: Path, parts: list) -> None:
        """Write to a temporary name (0600, O_EXCL|O_NOFOLLOW) and rename: a reader sees a whole
        file or none."""
        private_dir(p.parent)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.unlink(missing_ok=True)   # a killed writer's (this pid and thread again)
        try:
            write_new(tmp, parts)
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the queued blocks are written (tests, shutdown)."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.005)

    def close(self) -> None:
        hook, self.before_close = self.before_close, None
        if hook is not None:
            hook()
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=5)
        self.quota.close()

    def stats(self) -> dict:
        return {"kv_offload_blocks": len(self._index), "kv_offload_bytes": self.bytes,
                "kv_offload_written_blocks": self.written_blocks, "kv_offload_read_blocks": self.read_blocks,
                "kv_offload_dropped_blocks": self.dropped_blocks, "kv_offload_bad_blocks": self.bad_blocks}
