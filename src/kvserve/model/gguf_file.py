"""A GGUF file memory-mapped and read in one pass: metadata parsed lazily, tensors as views of
the mapping (no copy), in the shape gguf's `GGUFReader` gives them.

Why not `gguf.GGUFReader`: it builds a numpy view per part of every metadata item, about a
million small arrays for a 50k-token vocabulary and its merges (5 s of a 6 s start-up on the
default model, and hundreds of MB of Python objects). Here a string array is one walk over
(length, bytes) pairs that records where each item starts; `contents()` decodes them when asked.
The object keeps the subset of GGUFReader's interface kvserve uses (`fields[key].contents()`,
`.types`, `len(.data)`; `tensors[i].name/.shape/.tensor_type/.data/.data_offset/.n_bytes`), so
code written against either works with both.

The walk is bounds-checked as it goes (gguf_check.py's cursor and checks): a corrupt header ends
in a `ModelLoadError` that says what is wrong and where, after at most one pass over it, never in
a loop over a length of 2**63 or an allocation beyond the file. A failure left to decode (a key
that is not UTF-8) is reported by the caller (gguf_loader.open_gguf) as a corrupt header.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from kvserve.errors import ModelLoadError
from kvserve.model.gguf_check import (
    ARRAY,
    SCALARS,
    STRING,
    Cursor,
    check_alignment,
    check_counts,
    check_layout,
    tensor_info,
)

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
            if os.fstat(f.fileno()).st_size == 0:
                raise ModelLoadError(f"{self.path} is empty")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._mm, dtype=np.uint8)
        self.fields: dict[str, Field] = {}
        self.tensors: list[Tensor] = []
        self._parse(Cursor(self._mm, self.path))

    # ---- header walk ------------------------------------------------------------------------
    def _parse(self, c: Cursor) -> None:
        mm = self._mm
        magic = c.take(4, "the magic")
        if magic != b"GGUF":
            raise ModelLoadError(f"{self.path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
        version = c.u32("the version")
        if version not in (2, 3):
            c.fail(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = c.u64("the tensor count"), c.u64("the metadata count")
        check_counts(c, n_kv, n_tensors)
        for key, value, vt in (("GGUF.version", version, GGUFValueType.UINT32),   # as GGUFReader lists them
                               ("GGUF.tensor_count", n_tensors, GGUFValueType.UINT64),
                               ("GGUF.kv_count", n_kv, GGUFValueType.UINT64)):
            self.fields[key] = Field(key, [vt], mm, _value=value)
        alignment = 32
        for i in range(n_kv):
            raw_key = c.string(f"metadata key {i}")
            vtype = c.u32(f"the type of metadata {raw_key!r}")
            key = raw_key.decode("utf-8")
            f = self.fields[key] = self._field(c, key, vtype, f"metadata {raw_key[:80]!r}")
            if key == "general.alignment":
                v = f._value
                alignment = check_alignment(c, vtype, v if isinstance(v, int) and not isinstance(v, bool) else None)
        known = {int(k): v for k, v in GGML_QUANT_SIZES.items()}
        infos = [tensor_info(c, i, known) for i in range(n_tensors)]
        start = check_layout(c, [(offset, nbytes, name) for name, _, _, offset, nbytes in infos], alignment)
        seen = set()
        for raw_name, dims, raw_type, offset, n_bytes in infos:
            name = raw_name.decode("utf-8")
            if name in seen:
                raise ValueError(f"duplicated tensor {name}")
            seen.add(name)
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims))
            at = start + offset
            np_dims = tuple(reversed(dims))
            if qtype in _DENSE:
                data = self.data[at:at + n_bytes].view(_DENSE[qtype]).reshape(np_dims)
            else:
                data = self.data[at:at + n_bytes].reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
            self.tensors.append(Tensor(name, qtype, np.array(dims, dtype=np.uint64), n_elems, n_bytes, at, data))

    def _field(self, c: Cursor, key: str, vtype: int, what: str, depth: int = 0) -> Field:
        if vtype in SCALARS:
            return Field(key, [GGUFValueType(vtype)], self._mm, _value=c.scalar(vtype, what))
        if vtype == STRING:
            return Field(key, [GGUFValueType.STRING], self._mm, _spans=[c.string_span(what)])
        if vtype != ARRAY:
            c.fail(f"{what} has unknown value type {vtype}")
        item, count = c.array_header(what, depth)
        types = [GGUFValueType.ARRAY, GGUFValueType(item)]
        if item == STRING:
            return Field(key, types, self._mm, _spans=c.string_spans(count, what), data=range(count))
        if item == ARRAY:     # nested arrays: walk over them, nothing reads them
            for _ in range(count):
                self._field(c, key, item, what, depth + 1)
            return Field(key, types, self._mm, data=range(count))
        dtype = np.dtype(_NP_DTYPE[item]).newbyteorder("<")
        arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=c.skip(count * dtype.itemsize, what))
        return Field(key, types, self._mm, _array=arr, data=range(count))
