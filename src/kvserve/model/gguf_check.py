"""The bounds checks of a GGUF header walk: a cursor whose every read is checked against the
bytes that remain, and the checks on what it reads. gguf_file.py's one pass over the header reads
through them.

A header that is trusted can make a reader loop for seconds or allocate far beyond the file (an
array length of 2**63 read item by item) or fail with whatever numpy raises (a tensor count or a
string length past the end). Here every count and length is checked before it is used (each item
needs at least one byte, a string at least its 8-byte length), so a corrupt header costs at most
one pass over it and ends in a `ModelLoadError` that names what is wrong and where. Then, with
the tensor infos read: every dimension positive, every type known, each tensor's data aligned,
inside the file and not overlapping another's.

    header   magic "GGUF", version u32 (2 or 3), tensor count u64, metadata count u64
    metadata key (u64 length + bytes), value type u32, value
    tensors  name, n_dims u32 (1..4), dims u64 x n_dims, type u32, offset u64 (from the data start)
    data     at the first multiple of general.alignment (default 32) after the infos
"""

from __future__ import annotations

import struct
from pathlib import Path

from kvserve.errors import ModelLoadError

SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # value type -> size
SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class Cursor:
    """Reads from `buf` (a memory map of the file at `path`), every read checked against its end."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def fail(self, what: str):
        raise ModelLoadError(f"{self.path} is truncated or corrupt: {what} (at byte {self.pos} of {self.size})")

    def skip(self, n: int, what: str) -> int:
        """Step over n bytes; returns where they start."""
        if n < 0 or n > self.size - self.pos:
            self.fail(f"{what} needs {n} bytes but the file ends first")
        self.pos += n
        return self.pos - n

    def take(self, n: int, what: str) -> bytes:
        at = self.skip(n, what)
        return self.buf[at:at + n]

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.skip(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.skip(8, what))[0]

    def scalar(self, vtype: int, what: str):
        return struct.unpack_from(SCALAR_FMT[vtype], self.buf, self.skip(SCALARS[vtype], what))[0]

    def string(self, what: str) -> bytes:
        return self.take(self.u64(f"the length of {what}"), what)

    def string_span(self, what: str) -> tuple[int, int]:
        """A string's (start, length), not copied."""
        n = self.u64(f"the length of {what}")
        return self.skip(n, what), n

    def string_spans(self, count: int, what: str) -> list[tuple[int, int]]:
        """`count` strings' (start, length), none copied (a vocabulary has tens of thousands)."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, struct.Struct("<Q").unpack_from
        spans = []
        for _ in range(count):
            if pos + 8 > size:
                break
            n = unpack(buf, pos)[0]
            spans.append((pos + 8, n))
            pos += 8 + n
            if pos > size:
                break
        else:
            self.pos = pos
            return spans
        self.pos = min(pos, size)
        self.fail(f"{what} runs past the end of the file")

    def array_header(self, what: str, depth: int) -> tuple[int, int]:
        """An array's item type and length, checked: known type, no more items than bytes left."""
        if depth > 2:
            self.fail(f"{what} nests arrays too deep")
        item = self.u32(f"the item type of {what}")
        count = self.u64(f"the length of {what}")
        least = SCALARS.get(item, 8 if item in (STRING, ARRAY) else 0)
        if least == 0:
            self.fail(f"{what} has unknown item type {item}")
        if count * least > self.size - self.pos:
            self.fail(f"{what} claims {count} items, more than the file holds")
        return item, count


def check_counts(c: Cursor, n_kv: int, n_tensors: int) -> None:
    if n_kv * 13 > c.size - c.pos or n_tensors * 29 > c.size - c.pos:   # the smallest entries
        c.fail(f"the header claims {n_kv} metadata entries and {n_tensors} tensors, more than the file holds")


def check_alignment(c: Cursor, vtype: int, value) -> int:
    if vtype != 4 or not value or value & (value - 1) or value > 1 << 16:
        c.fail(f"general.alignment must be a power of two (u32) up to 65536, got {value!r}")
    return value


def tensor_info(c: Cursor, i: int, known_types: dict[int, tuple[int, int]]) -> tuple[bytes, list[int], int, int, int]:
    """One tensor info read and checked: (name, dims, type, offset, bytes)."""
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
    return name, dims, ttype, offset, elements // block * block_bytes


def check_layout(c: Cursor, infos: list[tuple[int, int, bytes]], alignment: int) -> int:
    """infos: (offset, bytes, name) per tensor. Each aligned, inside the file, not overlapping
    another; returns where the data starts (the first multiple of the alignment after the infos)."""
    start = -(-c.pos // alignment) * alignment
    end_prev, prev = 0, None
    for offset, nbytes, name in sorted(infos):
        name = name[:80]
        if offset % alignment:
            c.fail(f"tensor {name!r} starts at offset {offset}, not a multiple of the alignment {alignment}")
        if offset < end_prev:
            c.fail(f"tensor {name!r} overlaps tensor {prev!r}")
        if start + offset + nbytes > c.size:
            c.fail(f"tensor {name!r} ({nbytes} bytes at offset {offset}) extends beyond the end of the file")
        end_prev, prev = offset + nbytes, name
    return start
