"""Issue 60: the KV disk tier trusts nothing in its directory (engine/kv_disk_quota.py,
kv_disk_store.py). It holds every key's prompt KV: directories 0700 and files 0600, created
with O_EXCL|O_NOFOLLOW; a directory another user owns or others may write is refused at start;
a planted symlink is refused, never followed; a block is authenticated with the directory's
secret key, so a block that is internally consistent but not signed with this directory's key
(copied from another directory, or forged) is a miss, never loaded."""

from __future__ import annotations

import os
import shutil
import stat

import pytest
import torch

from kvserve.engine.kv_disk_quota import KEY_NAME, LOCK_NAME, UnsafeOffloadDir
from kvserve.engine.kv_disk_store import DiskKVStore, StoreHeader

HEADER = StoreHeader(model_hash="m", kv_dtype="float16", block_size=2, num_layers=1, num_kv_heads=1, row_width=4)
SHAPE = [1, 2, 2, 1, 4]
H = b"\x07" * 16


def store(root, cap: int = 1 << 20) -> DiskKVStore:
    s = DiskKVStore(root, HEADER, cap)
    s.put(H, torch.full(SHAPE, 7.0, dtype=torch.float16))
    s.flush()
    return s


def mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_directories_0700_files_0600(tmp_path):
    old = os.umask(0)   # the modes come from the creation calls, not from a lucky umask
    try:
        s = store(tmp_path / "kv")
    finally:
        os.umask(old)
    root = tmp_path / "kv"
    block = s.path(H)
    assert [mode(d) for d in (root, s.dir, block.parent)] == [0o700] * 3
    assert [mode(f) for f in (root / LOCK_NAME, root / KEY_NAME, s.dir / "header.json", block)] == [0o600] * 4
    s.close()


def test_a_directory_others_can_write_or_another_user_owns_is_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(UnsafeOffloadDir, match="writable by its group or others"):
        DiskKVStore(loose, HEADER, 1 << 20)
    if os.geteuid() == 0:   # only root can give a directory away
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(UnsafeOffloadDir, match="belongs to uid 65534"):
            DiskKVStore(theirs, HEADER, 1 << 20)
    # an existing private directory of ours, mode 0755, is narrowed to 0700
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o755)
    DiskKVStore(ours, HEADER, 1 << 20).close()
    assert mode(ours) == 0o700


def test_planted_symlinks_are_refused_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    (root / LOCK_NAME).symlink_to(target)
    with pytest.raises(UnsafeOffloadDir, match="symlink"):
        DiskKVStore(root, HEADER, 1 << 20)
    assert target.read_bytes() == b""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real").mkdir(mode=0o700)
    with pytest.raises(UnsafeOffloadDir, match="not a directory"):
        DiskKVStore(link, HEADER, 1 << 20)


def test_a_block_not_signed_with_this_directorys_key_is_a_miss(tmp_path):
    """Old code: a block copied from another directory (same model, same format, a valid
    checksum) was loaded; now its MAC under this directory's key fails."""
    a = store(tmp_path / "a")
    assert a.read(H, SHAPE, "float16") is not None
    b = DiskKVStore(tmp_path / "b", HEADER, 1 << 20)
    b.path(H).parent.mkdir(mode=0o700, exist_ok=True)
    shutil.copyfile(a.path(H), b.path(H))
    os.chmod(b.path(H), 0o600)
    assert b.has(H)
    assert b.read(H, SHAPE, "float16") is None and b.bad_blocks == 1 and not b.path(H).exists()
    # an edited byte in a's own block: a miss too
    raw = bytearray(a.path(H).read_bytes())
    raw[-1] ^= 1
    a.path(H).write_bytes(bytes(raw))
    assert a.read(H, SHAPE, "float16") is None
    a.close()
    b.close()


def test_a_block_name_planted_as_a_symlink_or_fifo_is_a_miss_not_followed(tmp_path):
    s = DiskKVStore(tmp_path / "kv", HEADER, 1 << 20)
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 64)
    for i, plant in enumerate((lambda p: p.symlink_to(secret), lambda p: os.mkfifo(p))):
        h = bytes([i + 1]) * 16
        s.path(h).parent.mkdir(mode=0o700, exist_ok=True)
        plant(s.path(h))
        assert s.has(h) and s.read(h, SHAPE, "float16") is None   # a FIFO would block a plain read
    assert secret.read_bytes() == b"x" * 64
    s.close()
