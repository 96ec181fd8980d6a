"""A bounds-checked walk over a GGUF header, before gguf's reader touches the file.

gguf's `GGUFReader` trusts the header: an array length of 2**63 makes it read item after item
(seconds, and memory far beyond the file), a tensor count or a string length past the end makes
it fail with whatever numpy raises. `check_gguf` walks the same layout with every count and
length checked against the bytes that remain (each item needs at least one byte, a string at
least its 8-byte length), so a corrupt header costs one pass over it and ends in a
`ModelLoadError` that names what is wrong. Then, with the tensor infos read: every dimension
positive, every type known, each tensor's data aligned, inside the file and not overlapping
another's.

    header   magic "GGUF", version u32 (2 or 3), tensor count u64, metadata count u64
    metadata key (u64 length + bytes), value type u32, value
    tensors  name, n_dims u32 (1..4), dims u64 x n_dims, type u32, offset u64 (from the data start)
    data     at the first multiple of general.alignment (default 32) after the infos
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from kvserve.errors import ModelLoadError

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # type -> size
_STRING, _ARRAY = 8, 9
_INT_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, what: str):
        raise ModelLoadError(f"{self.path} is truncated or corrupt: {what} (at byte {self.pos} of {self.size})")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.size - self.pos:
            self.fail(f"{what} needs {n} bytes but the file ends first")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str) -> bytes:
        n = self.u64(f"the length of {what}")
        return self.take(n, what)

    def skip_strings(self, count: int, what: str) -> None:
        """Step over `count` strings without copying them (a vocabulary has tens of thousands)."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                break
            pos += 8 + unpack(buf, pos)[0]
            if pos > size:
                break
        else:
            self.pos = pos
            return
        self.pos = min(pos, size)
        self.fail(f"{what} runs past the end of the file")

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            raw = self.take(_SCALARS[vtype], what)
            return struct.unpack(_INT_FMT[vtype], raw)[0] if vtype in _INT_FMT else None
        if vtype == _STRING:
            self.string(what)
            return None
        if vtype == _ARRAY:
            if depth > 2:
                self.fail(f"{what} nests arrays too deep")
            item = self.u32(f"the item type of {what}")
            count = self.u64(f"the length of {what}")
            least = _SCALARS.get(item, 8 if item in (_STRING, _ARRAY) else 0)
            if least == 0:
                self.fail(f"{what} has unknown item type {item}")
            if count * least > self.size - self.pos:
                self.fail(f"{what} claims {count} items, more than the file holds")
            if item in _SCALARS:
                self.take(count * least, what)
            elif item == _STRING:
                self.skip_strings(count, what)
            else:
                for _ in range(count):
                    self.value(item, what, depth + 1)
            return None
        self.fail(f"{what} has unknown value type {vtype}")


def check_gguf(path: Path, known_types: dict[int, tuple[int, int]]) -> None:
    """Raise ModelLoadError unless the header and tensor layout of `path` are consistent.
    `known_types`: tensor type id -> (block size in elements, bytes per block)."""
    with open(path, "rb") as f:
        if Path(path).stat().st_size == 0:
            raise ModelLoadError(f"{path} is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _check(_Cursor(buf, Path(path)), known_types)


def _check(c: _Cursor, known_types: dict[int, tuple[int, int]]) -> None:
    c.take(4, "the magic")
    version = c.u32("the version")
    if version not in (2, 3):
        c.fail(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors = c.u64("the tensor count")
    n_kv = c.u64("the metadata count")
    if n_kv * 13 > c.size - c.pos or n_tensors * 29 > c.size - c.pos:   # the smallest entries
        c.fail(f"the header claims {n_kv} metadata entries and {n_tensors} tensors, more than the file holds")
    alignment = 32
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        vtype = c.u32(f"the type of metadata {key!r}")
        value = c.value(vtype, f"metadata {key[:80]!r}")
        if key == b"general.alignment":
            if vtype != 4 or not value or value & (value - 1) or value > 1 << 16:
                c.fail(f"general.alignment must be a power of two (u32) up to 65536, got {value!r}")
            alignment = value
    infos = []
    for i in range(n_tensors):
        name = c.string(f"the name of tensor {i}")
        n_dims = c.u32(f"the dimension count of tensor {name[:80]!r}")
        if not 1 <= n_dims <= 4:
            c.fail(f"tensor {name[:80]!r} has {n_dims} dimensions (1 to 4 allowed)")
        dims = [c.u64(f"a dimension of tensor {name[:80]!r}") for _ in range(n_dims)]
        ttype = c.u32(f"the type of tensor {name[:80]!r}")
        offset = c.u64(f"the data offset of tensor {name[:80]!r}")
        if ttype not in known_types:
            c.fail(f"tensor {name[:80]!r} has unknown type {ttype}")
        if any(d == 0 or d > 1 << 40 for d in dims):
            c.fail(f"tensor {name[:80]!r} has dimensions {dims}")
        block, block_bytes = known_types[ttype]
        elements = 1
        for d in dims:
            elements *= d
        if dims[0] % block:
            c.fail(f"tensor {name[:80]!r}: its rows of {dims[0]} are not a multiple of its type's block of {block}")
        infos.append((offset, elements // block * block_bytes, name[:80]))
    start = -(-c.pos // alignment) * alignment
    end_prev, prev = 0, None
    for offset, nbytes, name in sorted(infos):
        if offset % alignment:
            c.fail(f"tensor {name!r} starts at offset {offset}, not a multiple of the alignment {alignment}")
        if offset < end_prev:
            c.fail(f"tensor {name!r} overlaps tensor {prev!r}")
        if start + offset + nbytes > c.size:
            c.fail(f"tensor {name!r} ({nbytes} bytes at offset {offset}) extends beyond the end of the file")
        end_prev, prev = offset + nbytes, name
