"""DirQuota: one size cap for a KV offload directory, whatever number of processes write under it.

Replicas on one machine share `--kv-offload-dir` (and a server with several models has one store per
model under it), so a cap kept by each store alone would let the directory grow to the sum of
them. The cap is the directory's instead: every block file written or deleted under DIR goes
through one lock file, `DIR/.kv-offload.lock` (an exclusive `flock`), which also holds the bytes
of block files the directory holds:

    write:   lock; used + size over the cap? scan DIR/kv-*/*/*.kvb (any process's, any model's),
             delete the least recently used (mtime: a read touches its file) until it fits, with a
             little headroom so the next writes do not scan again; write the file and rename it;
             used += size; unlock
    delete:  lock; unlink; used -= size; unlock

The directory holds every key's prompt KV, so it is private: DIR and every directory under it
are made 0700 and every file 0600, each created with O_EXCL|O_NOFOLLOW (a symlink planted in
its place is refused, never followed); a DIR the server's user does not own, or that its group
or others may write, is refused at start (`private_dir`, a clear error). `DIR/.kv-key` holds the
directory's secret key (32 random bytes, 0600): the block files are authenticated with an HMAC
under it (kv_disk_store.py), so a block edited or planted by anyone who cannot read the key is a
miss, never loaded.

The count is exact or over (a file removed by hand, a process killed after counting): an over-count
only brings the next scan sooner, and each scan counts again from the files. The writers serialize
on the lock (one block file, ~0.4 MB into the page cache, per hold) on their own threads: a step
never waits for it. The scan is O(files): at the 20 GiB default (~55k blocks of the default model)
a fraction of a second, once per `1/32` of the cap written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvserve.errors import InvalidRequest

logger = logging.getLogger("kvserve.engine")

LOCK_NAME = ".kv-offload.lock"
KEY_NAME = ".kv-key"
_NEW = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class UnsafeOffloadDir(InvalidRequest, code="unsafe_kv_offload_dir"):
    """The KV offload directory (or a file in it) is not private to the server's user."""


def _refuse(path: Path, why: str) -> UnsafeOffloadDir:
    return UnsafeOffloadDir(f"--kv-offload-dir {path}: {why}. It holds every key's prompt KV: give the server "
                            "a directory its user owns that no one else can write (e.g. mkdir -m 700 DIR), or "
                            "let the server create it.", param="kv_offload_dir")


def _check_private(path: Path, st: os.stat_result, kind: str) -> None:
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"the {kind} belongs to uid {st.st_uid}, not the server's user ({os.geteuid()})")
    if st.st_mode & 0o022:
        raise _refuse(path, f"the {kind} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})")


def private_dir(path: str | os.PathLike, parents: bool = False) -> Path:
    """`path` as a private directory: created 0700 (its parents too with `parents`), or, when it
    exists, a real directory (not a symlink) the server's user owns that no one else may write
    (UnsafeOffloadDir otherwise), its mode narrowed to 0700."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a directory (a symlink or a file)")
    _check_private(path, st, "directory")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700, follow_symlinks=False)
    return path


def open_private(path: Path, flags: int = os.O_RDWR) -> int:
    """A private file's descriptor: created 0600 with O_EXCL|O_NOFOLLOW, or the existing regular
    file opened with O_NOFOLLOW and checked (owner, no group/other write), narrowed to 0600."""
    try:
        return os.open(path, flags | _NEW, 0o600)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "it is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "it is not a regular file")
        _check_private(path, st, "file")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_new(path: Path, parts: list) -> None:
    """Write a new private file (0600, O_EXCL|O_NOFOLLOW: never through a planted name)."""
    fd = os.open(path, os.O_WRONLY | _NEW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.writelines(parts)


def directory_key(root: Path) -> bytes:
    """The directory's secret key (`root/.kv-key`, 0600), made once: written under a temporary
    name and linked into place, so a process reading it never sees it half written."""
    path = root / KEY_NAME
    for _ in range(3):
        try:
            fd = open_private(path, os.O_RDONLY) if path.exists() else -1
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            with os.fdopen(fd, "rb") as f:
                key = f.read()
            if len(key) == 32:
                return key
            raise _refuse(path, "the key file is not 32 bytes (delete it: the blocks under it become misses)")
        tmp = root / f".kv-key.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        write_new(tmp, [secrets.token_bytes(32)])
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    raise _refuse(path, "the key file could not be made")
_HEADROOM = 32          # a scan frees 1/_HEADROOM of the cap beyond what the write needs
_STALE_TMP_S = 3600.0   # a temporary file older than this is a killed writer's: deleted by a scan


class DirQuota:
    """The size cap of `root` as a whole (module docstring). Thread-safe within a process as well
    (each instance holds its own open file, and flock excludes across open files)."""

    def __init__(self, root: str | os.PathLike, max_bytes: int):
        self.root = private_dir(root, parents=True)
        self.max_bytes = max_bytes
        self._fd = open_private(self.root / LOCK_NAME)
        self.scans = 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _used(self) -> int | None:
        raw = os.pread(self._fd, 8, 0)
        return struct.unpack("<q", raw)[0] if len(raw) == 8 else None

    def _set_used(self, n: int) -> None:
        os.pwrite(self._fd, struct.pack("<q", max(0, n)), 0)

    def used(self) -> int | None:
        """The bytes of block files the directory holds, as counted (None: not counted yet)."""
        with self._locked():
            return self._used()

    def write(self, size: int, write: Callable[[], None]) -> list[Path]:
        """Make room for `size` bytes, then call `write` (which lands one file of that size, or
        raises: nothing is counted then). Returns the block files deleted to make room."""
        with self._locked():
            used = self._used()
            removed: list[Path] = []
            if used is None or used + size > self.max_bytes:
                # whole blocks of headroom (none under a cap of a few dozen blocks: exact LRU there)
                headroom = (self.max_bytes // _HEADROOM) // size * size if size else 0
                used, removed = self._scan_and_evict(self.max_bytes - size - headroom)
                self._set_used(used)
            if size:
                write()
                self._set_used(used + size)
            return removed

    def remove(self, path: Path) -> bool:
        """Delete one block file and uncount it (False: it was already gone)."""
        with self._locked():
            try:
                size = path.stat().st_size
                path.unlink()
            except OSError:
                return False
            used = self._used()
            if used is not None:
                self._set_used(used - size)
            return True

    def _scan_and_evict(self, limit: int) -> tuple[int, list[Path]]:
        """(under the lock) Count every block file under root; delete the least recently used until
        they hold at most `limit` bytes. Returns (bytes left, files deleted)."""
        self.scans += 1
        files: list[tuple[int, int, str]] = []
        now = time.time()
        for store in _subdirs(self.root, "kv-"):
            for sub in _subdirs(Path(store), ""):
                with contextlib.suppress(OSError), os.scandir(sub) as it:
                    for e in it:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if e.name.endswith(".kvb"):
                            files.append((st.st_mtime_ns, st.st_size, e.path))
                        elif e.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                            with contextlib.suppress(OSError):
                                os.unlink(e.path)
        files.sort()
        total = sum(size for _, size, _ in files)
        removed = []
        for _, size, path in files:
            if total <= limit:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("KV disk tier: cannot delete %s (%s)", path, e)
                continue
            total -= size
            removed.append(Path(path))
        return total, removed

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _subdirs(root: Path, prefix: str) -> list[str]:
    try:
        with os.scandir(root) as it:
            return [e.path for e in it if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
