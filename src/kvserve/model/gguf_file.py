"""A GGUF file memory-mapped and read in one pass: metadata parsed lazily, tensors as views of
the mapping (no copy), in the shape gguf's `GGUFReader` gives them.

Why not `gguf.GGUFReader`: it builds a numpy view per part of every metadata item, about a
million small arrays for a 50k-token vocabulary and its merges (5 s of a 6 s start-up on the
default model, and hundreds of MB of Python objects). Here a string array is one walk over
(length, bytes) pairs that records where each item starts; `contents()` decodes them when asked.
The object keeps the subset of GGUFReader's interface kvserve uses (`fields[key].contents()`,
`.types`, `len(.data)`; `tensors[i].name/.shape/.tensor_type/.data/.data_offset/.n_bytes`), so
code written against either works with both.

Bounds are checked before this runs (gguf_check.py); any decoding failure left is reported by
the caller as a corrupt header.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}
_NP_DTYPE = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
             7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_DENSE = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass
class Field:
    """One metadata item. `data` has one entry per array item (GGUFReader's indices), so
    `len(field.data)` is an array's length, as with GGUFReader."""

    name: str
    types: list[GGUFValueType]
    _buf: Any = field(repr=False)
    _value: Any = None                       # a scalar's value
    _spans: list[tuple[int, int]] | None = None   # a string's / string array's (start, length)
    _array: np.ndarray | None = None         # a scalar array's items
    data: range = field(default_factory=lambda: range(1))

    def contents(self) -> Any:
        main = self.types[0]
        if main == GGUFValueType.STRING:
            s, n = self._spans[0]
            return self._buf[s:s + n].decode("utf-8")
        if main != GGUFValueType.ARRAY:
            return self._value
        if self._spans is not None:
            buf = self._buf
            return [buf[s:s + n].decode("utf-8") for s, n in self._spans]
        return self._array.tolist() if self._array is not None else []


@dataclass
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray              # dims innermost first, as in the file
    n_elements: int
    n_bytes: int
    data_offset: int               # from the start of the file
    data: np.ndarray               # a read-only view of the mapping


class GGUFFile:
    """`GGUFFile(path)`: the header parsed, the data mapped read-only (pages shared with every
    other process that maps the same file, read from disk only when touched)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._mm, dtype=np.uint8)
        self.fields: dict[str, Field] = {}
        self.tensors: list[Tensor] = []
        self._pos = 0
        self._parse()

    # ---- header walk ------------------------------------------------------------------------
    def _unpack(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self._mm, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return v

    def _string_span(self) -> tuple[int, int]:
        n = self._unpack("<Q")
        start = self._pos
        self._pos += n
        if self._pos > len(self._mm):
            raise ValueError("string runs past the end of the file")
        return start, n

    def _parse(self) -> None:
        mm = self._mm
        if mm[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        for key, value, vt in (("GGUF.version", version, GGUFValueType.UINT32),   # as GGUFReader lists them
                               ("GGUF.tensor_count", n_tensors, GGUFValueType.UINT64),
                               ("GGUF.kv_count", n_kv, GGUFValueType.UINT64)):
            self.fields[key] = Field(key, [vt], mm, _value=value)
        for _ in range(n_kv):
            s, n = self._string_span()
            key = mm[s:s + n].decode("utf-8")
            self.fields[key] = self._field(key, self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            s, n = self._string_span()
            name = mm[s:s + n].decode("utf-8")
            n_dims = self._unpack("<I")
            dims = [self._unpack("<Q") for _ in range(n_dims)]
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        alignment = self.fields["general.alignment"].contents() if "general.alignment" in self.fields else 32
        start = -(-self._pos // alignment) * alignment
        seen = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name}")
            seen.add(name)
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims))
            n_bytes = n_elems * type_size // block
            at = start + offset
            np_dims = tuple(reversed(dims))
            if qtype in _DENSE:
                data = self.data[at:at + n_bytes].view(_DENSE[qtype]).reshape(np_dims)
            else:
                data = self.data[at:at + n_bytes].reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
            self.tensors.append(Tensor(name, qtype, np.array(dims, dtype=np.uint64), n_elems, n_bytes, at, data))

    def _field(self, key: str, vtype: int) -> Field:
        t = GGUFValueType(vtype)
        if t == GGUFValueType.STRING:
            return Field(key, [t], self._mm, _spans=[self._string_span()])
        if t != GGUFValueType.ARRAY:
            return Field(key, [t], self._mm, _value=self._unpack(_SCALAR_FMT[vtype]))
        item, count = self._unpack("<I"), self._unpack("<Q")
        sub = GGUFValueType(item)
        if sub == GGUFValueType.STRING:
            spans, pos, mm, unpack = [], self._pos, self._mm, struct.Struct("<Q").unpack_from
            for _ in range(count):
                n = unpack(mm, pos)[0]
                spans.append((pos + 8, n))
                pos += 8 + n
            if pos > len(mm):
                raise ValueError(f"{key} runs past the end of the file")
            self._pos = pos
            return Field(key, [t, sub], self._mm, _spans=spans, data=range(count))
        if sub == GGUFValueType.ARRAY:     # nested arrays: walk over them, nothing reads them
            for _ in range(count):
                self._field(key, item)
            return Field(key, [t, sub], self._mm, data=range(count))
        dtype = np.dtype(_NP_DTYPE[item]).newbyteorder("<")
        arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._pos)
        self._pos += count * dtype.itemsize
        return Field(key, [t, sub], self._mm, _array=arr, data=range(count))
