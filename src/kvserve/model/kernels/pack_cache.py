"""Repacked GGUF weights cached in kvserve's cache directory: one file per model file, keyed by
its version and this code, memory-mapped at the next load.

The C kernels read Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 weights (Q5_0 as Q8_0 blocks, Q5_1 requantized) in their own
layout (16-row groups, scales apart from the quants: cpu/kvserve_kernels.cpp), so every packed
projection is rewritten once at load.
That costs start-up time (and for Q4_K more than a copy) and, held in anonymous memory, a second
copy of the weights per process. The first load of a file writes what it repacked into
`<cache>/packed/<key>.kvpack`; every later load maps that file instead (copy-on-write, never
written), so repacking is skipped, the weights are read from disk only when touched, and several
processes serving one model share the same page-cache pages.

The key covers everything the bytes depend on: the GGUF file's version (file_identity: its
inode, size, mtime and a sampled content hash; not the SHA-256 of every byte, which cost a fresh
file's first load seconds), the kernel sources and the
Python modules that decide which projections are built, in which order, from which tensors.
Entries are consumed in build order and each is checked against the layer asking for it (type,
rows, columns); any mismatch makes the loader build without the cache. KVSERVE_PACK_CACHE=0 turns
it off.

    file   b"KVSPACK1", u64 header length, JSON header {"entries": [...]}, then 64-byte aligned
           blobs; an entry: qtype, rows, cols, sdtype and (offset, bytes) of qs, d and m
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from kvserve.model.kernels import build

logger = logging.getLogger(__name__)

MAGIC = b"KVSPACK1"
Q4_0 = int(GGMLQuantizationType.Q4_0)
ALIGN = 64
KEEP_FILES = 16    # packed models kept in the cache; the least recently used beyond are deleted
KEEP_BYTES = 32 << 30   # and their total size (KVSERVE_PACK_CACHE_MAX_BYTES); the newest is always kept
# The modules whose code decides which projections exist, their order and their bytes.
_CODE = ("model/decoder.py", "model/linear.py", "model/gguf_loader.py", "model/gguf_families.py",
         "model/gguf_file.py", "model/moe.py", "model/kernels/gguf_linear.py", "model/kernels/kquants.py",
         "model/kernels/pack_cache.py", "model/kernels/fused_linear.py",
         "tokenizer/tokenizer.py", "tokenizer/gguf_vocab.py", "tokenizer/spm_exact.py")


# The scales' element type per sdtype code (2: Q4_K's super-block scales as bytes).
_SCALE_DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.uint8}


class PackMismatch(RuntimeError):
    """The cached entries do not fit the layers being built: build without the cache."""


def enabled() -> bool:
    return os.environ.get("KVSERVE_PACK_CACHE", "1").lower() not in ("0", "off", "false", "no")


def cache_root() -> Path:
    """KVSERVE_PACK_CACHE_DIR, else `packed` beside the compiled kernels (an empty directory
    measures a first load without recompiling the kernels)."""
    root = os.environ.get("KVSERVE_PACK_CACHE_DIR")
    return Path(root) if root else build.cache_dir().parent / "packed"


def file_digest(path: Path) -> str:
    """SHA-256 of the file's bytes, memoized under its (path, device, inode, size, mtime)."""
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
    memo = cache_root() / "hashes" / hashlib.sha256(ident.encode()).hexdigest()[:32]
    with contextlib.suppress(OSError):
        text = memo.read_text().strip()
        if len(text) == 64:
            return text
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(memo, digest.encode())
    return digest


SAMPLES, SAMPLE_BYTES, HEAD_BYTES = 64, 64 << 10, 4 << 20


def file_identity(path: Path) -> str:
    """A cheap identity of a file version, for cache keys: its (device, inode, size, mtime) and the
    SHA-256 of its first 4 MiB (a GGUF's header: metadata and tensor table), its last 64 KiB and
    64 evenly spaced 64 KiB samples. About 8 MB read, not the whole file: hashing every byte of a
    fresh 1 GB file cost seconds of its first load (a rewrite in place changes mtime; a copy is
    another file, repacked once)."""
    st = path.stat()
    h = hashlib.sha256(f"{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(HEAD_BYTES))
        span = st.st_size - HEAD_BYTES - SAMPLE_BYTES     # where samples may start, past the head
        for i in range(SAMPLES + 1) if span > 0 else ():
            f.seek(HEAD_BYTES + span * i // SAMPLES)       # i = SAMPLES: the file's last bytes
            h.update(f.read(SAMPLE_BYTES))
        if span <= 0:
            h.update(f.read())
    return h.hexdigest()


def code_digest() -> str:
    pkg = Path(__file__).resolve().parents[2]
    h = hashlib.sha256(str(build.KERNEL_VERSION).encode())
    for path in sorted(build.source_dir().glob("*.[ch]*")) + [pkg / p for p in _CODE]:
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def file_key(gguf_path: Path, variant: str = "") -> str:
    """The cache key of a model file's derived data: its content, this code, `variant`."""
    return hashlib.sha256(f"{file_identity(gguf_path)}|{code_digest()}|{variant}".encode()).hexdigest()[:32]


def atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class PackSession:
    """One model build: serves cached entries in order (`hit`) or records the layers it repacked."""

    def __init__(self, path: Path, entries: list[dict] | None = None, mm: mmap.mmap | None = None) -> None:
        self.path = path
        self.entries = entries
        self.mm = mm
        self.hit = entries is not None
        self.next = 0
        self.recorded: list[Any] = []
        self.lookup_only: tuple[Any, ...] = ()    # layers read a row at a time: not populated

    @classmethod
    def open(cls, gguf_path: Path, variant: str) -> PackSession:
        """The session for `gguf_path`: a hit if a valid cache file exists, else one that records.
        `variant` names load choices that change the bytes (the weight format)."""
        path = cache_root() / f"{file_key(gguf_path, variant)}.kvpack"
        wait(path)      # a write of this entry still under way (the same file loaded again at once)
        try:
            entries, mm = _map(path)     # populated by `finish`, once it knows the lookup-only tables
            os.utime(path)     # recently used
            return cls(path, entries, mm)
        except FileNotFoundError:
            return cls(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("kvserve: ignoring the unreadable packed-weight cache %s (%s)", path, e)
            return cls(path)

    def take(self, qtype: int, rows: int, cols: int,
             expect: tuple[int, int, bool] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The next cached entry as (qs, d, m, sdtype), views of the mapped file.
        expect: (qs bytes, scale count, has minima) the kernels will read for this layer; every
        blob's size and the scales' dtype are checked against it (an edited entry whose blobs
        are shorter would have the kernels read past them): PackMismatch if they differ."""
        if self.next >= len(self.entries):
            raise PackMismatch("more packed layers than cached entries")
        e = self.entries[self.next]
        if (e["qtype"], e["rows"], e["cols"]) != (int(qtype), rows, cols):
            raise PackMismatch(f"entry {self.next} is {e['qtype'], e['rows'], e['cols']}, the layer "
                               f"{int(qtype), rows, cols}")
        if e["sdtype"] not in _SCALE_DTYPES:
            raise PackMismatch(f"entry {self.next} has scale dtype code {e['sdtype']!r}")
        if expect is not None:
            qs_bytes, n_scales, has_m = expect
            esize = _SCALE_DTYPES[e["sdtype"]].itemsize
            want = {"qs": qs_bytes, "d": n_scales * esize, "m": n_scales * esize if has_m else 0}
            got = {name: e[name][1] for name in want}
            if e.get("m_is_-8d"):
                got["m"] = e["d"][1]
            if got != want:
                raise PackMismatch(f"entry {self.next} has blob sizes {got}, the kernels read {want}")
        self.next += 1
        dt = _SCALE_DTYPES[e["sdtype"]]
        d = self._view(e["d"], dt)
        m = d * -8.0 if e.get("m_is_-8d") else self._view(e["m"], dt)     # exact in either dtype
        return self._view(e["qs"], torch.uint8), d, m, e["sdtype"]

    def _view(self, span: list[int], dtype: torch.dtype) -> torch.Tensor:
        offset, nbytes = span
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.mm, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)

    def record(self, layer: Any) -> None:
        self.recorded.append(layer)

    def finish(self, lookup_only: tuple[Any, ...] = ()) -> None:
        """Hit: check every entry was used, then bring in the mapping's pages except those of the
        `lookup_only` layers (an untied embedding table: a token reads one row of it, so mapping
        it whole would hold the table in RSS, 220 MB of a 3B Q4_K_M file's 2.1 GB, for nothing).
        Miss: write the cache file in a background thread (the layers keep their repacked copies:
        the first token does not wait for a disk write of the file's size, seconds for a 1 GB
        model); with BACKGROUND off, write it now and point the recorded layers at its mapping
        (their anonymous copies are freed)."""
        if self.hit:
            if self.next != len(self.entries):
                raise PackMismatch(f"{len(self.entries) - self.next} cached entries left unused")
            if POPULATE:
                _populate(self.mm, _spans(self.mm, lookup_only))
            return
        self.lookup_only = lookup_only
        if not self.recorded:
            return
        if BACKGROUND:
            # not a daemon: a process that ends at once (a one-shot run) still completes the file
            writer = threading.Thread(target=self._write_in_background, name="kvserve-pack-write")
            with _pending_lock:
                _pending[self.path] = writer
            writer.start()
            return
        try:
            self._write()
        except OSError as e:
            logger.warning("kvserve: packed weights not cached (%s)", e)
            return
        try:
            # mapped lazily: each layer's anonymous copy is freed as it adopts its view, and only
            # then are the pages brought in (populating first held both copies: 3x the file at peak)
            reopened = PackSession(self.path, *_map(self.path))
        except (OSError, ValueError, KeyError, TypeError):
            return
        try:
            for layer in self.recorded:     # each layer whole: one adopted or not is self-consistent
                qs, d, m, _ = reopened.take(layer.qtype, layer.out_features, layer.in_features)
                layer.adopt_packed(qs, d, m)
        except PackMismatch as e:
            logger.warning("kvserve: packed-weight cache written but not mapped (%s)", e)
        if POPULATE:
            _populate(reopened.mm, _spans(reopened.mm, self.lookup_only))
        _prune(self.path.parent)

    def _write_in_background(self) -> None:
        with contextlib.suppress(OSError, AttributeError):   # this thread only: the first steps go first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            self._write()
            _prune(self.path.parent)
        except Exception as e:  # noqa: BLE001 - a cache that is not written is only a slower next load
            logger.warning("kvserve: packed weights not cached (%s)", e)
        finally:
            with _pending_lock:
                if _pending.get(self.path) is threading.current_thread():
                    del _pending[self.path]

    def _write(self) -> None:
        entries, blobs, pos = [], [], 0
        for layer in self.recorded:
            e = {"qtype": int(layer.qtype), "rows": layer.out_features, "cols": layer.in_features,
                 "sdtype": layer.desc.sdtype}
            if e["qtype"] == Q4_0:     # (the layer may not even hold them: GGUFQuantLinear._drop_q4_0_minima)
                e["m_is_-8d"] = True      # a Q4_0 minimum is -8 d: not stored (the cache stays <= 1.1x the file)
            for name in ("qs", "d", "m"):
                t = getattr(layer, name)
                if name == "m" and e.get("m_is_-8d"):
                    t = torch.empty(0, dtype=torch.uint8)
                nbytes = t.numel() * t.element_size()
                e[name] = [pos, nbytes]
                blobs.append(t)
                pos += -(-nbytes // ALIGN) * ALIGN
            entries.append(e)
        header = json.dumps({"entries": entries}).encode()
        header = header.ljust(_data_start(len(header)) - 16)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(header)) + header)
                for t in blobs:
                    nbytes = t.numel() * t.element_size()
                    if nbytes:
                        f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
                    f.write(b"\0" * (-(-nbytes // ALIGN) * ALIGN - nbytes))
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _data_start(header_len: int) -> int:
    return -(-(16 + header_len) // ALIGN) * ALIGN


POPULATE = True
BACKGROUND = True    # a miss writes its cache file in a background thread (PackSession.finish)
_pending: dict[Path, threading.Thread] = {}
_pending_lock = threading.Lock()


def wait(path: Path | None = None) -> None:
    """Wait for the background write of cache file `path` (None: of every file) to end."""
    with _pending_lock:
        writers = [t for p, t in _pending.items() if path is None or p == path]
    for t in writers:
        t.join()

_MADV_POPULATE_READ = 22     # Linux 5.14+; Python's mmap module does not name it


def _spans(mm: mmap.mmap, layers: tuple[Any, ...]) -> list[tuple[int, int]]:
    """The (start, end) offsets in `mm` of the layers' blobs (qs, d, m) that are views of it."""
    base, out = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr(), []
    for layer in layers:
        for name in ("qs", "d", "m"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.numel():
                start = t.data_ptr() - base
                if 0 <= start < len(mm):
                    out.append((start, start + t.numel() * t.element_size()))
    return sorted(out)


def _populate(mm: mmap.mmap, skip: list[tuple[int, int]] = ()) -> None:
    """Map every page now but those inside the `skip` spans, one call per stretch (the weights are
    all read by the first forward anyway): page by page on first touch costs more and lands on the
    first token's time."""
    page, at = mmap.PAGESIZE, 0
    for start, end in [*skip, (len(mm), len(mm))]:
        lo, hi = at // page * page, -(-start // page) * page     # whole pages, the stretch's edges included
        if hi > lo:
            try:
                mm.madvise(_MADV_POPULATE_READ, lo, min(hi, len(mm)) - lo)
            except (OSError, ValueError):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    mm.madvise(mmap.MADV_WILLNEED, lo, min(hi, len(mm)) - lo)      # at least read ahead
        at = max(at, end)


def _map(path: Path) -> tuple[list[dict], mmap.mmap]:
    """A cache file's entries (offsets made absolute) and its private mapping (not populated);
    raises on a bad file."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)   # private: pages shared until written
    if mm[:8] != MAGIC:
        raise ValueError("bad magic")
    n = struct.unpack_from("<Q", mm, 8)[0]
    base = _data_start(n)
    if base > len(mm):
        raise ValueError("truncated header")
    entries = json.loads(mm[16:16 + n])["entries"]
    for e in entries:
        if not all(type(e[k]) is int for k in ("qtype", "rows", "cols", "sdtype")):
            raise ValueError("bad entry")
        for name in ("qs", "d", "m"):
            span = e[name]
            if (not isinstance(span, list) or len(span) != 2 or any(type(v) is not int or v < 0 for v in span)
                    or span[0] % ALIGN):
                raise ValueError(f"bad {name} span {span!r}")
            span[0] += base
            if span[0] + span[1] > len(mm):
                raise ValueError("truncated")
    return entries, mm


def max_bytes() -> int:
    """The cap on the packed files' total size: KVSERVE_PACK_CACHE_MAX_BYTES, else KEEP_BYTES."""
    try:
        return int(os.environ.get("KVSERVE_PACK_CACHE_MAX_BYTES", KEEP_BYTES))
    except ValueError:
        return KEEP_BYTES


def _prune(root: Path) -> None:
    """Least recently used first: past KEEP_FILES files of a kind, or past max_bytes() of packed
    files in total (the newest packed file stays whatever its size: it was just asked for)."""
    cap = max_bytes()
    for pattern in ("*.kvpack", "*.tokenizer.json"):
        files = []
        for p in root.glob(pattern):
            with contextlib.suppress(OSError):
                st = p.stat()
                files.append((st.st_mtime_ns, st.st_size, p))
        files.sort(key=lambda f: f[0], reverse=True)
        total = 0
        for i, (_, size, old) in enumerate(files):
            total += size
            if i >= KEEP_FILES or (pattern == "*.kvpack" and i > 0 and total > cap):
                with contextlib.suppress(OSError):
                    old.unlink()


_current: ContextVar[PackSession | None] = ContextVar("kvserve_pack_session", default=None)


def current() -> PackSession | None:
    """The session of the model being built in this context (read by GGUFQuantLinear)."""
    return _current.get()


@contextlib.contextmanager
def active(session: PackSession | None) -> Iterator[None]:
    token = _current.set(session)
    try:
        yield
    finally:
        _current.reset(token)
