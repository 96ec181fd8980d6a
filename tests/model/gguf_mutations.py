"""A mutation corpus of GGUF files, built from a valid one: each mutation is (name, bytes).

The byte offsets of every header part come from gguf's own reader (each part is a view into the
file's memory map), so a mutation rewrites exactly one count, length, type or offset:

* truncations at many offsets (through the header, the tensor infos and the data);
* the tensor and metadata counts set to 0, 2**32 and 2**63 - 1;
* every metadata key's length and every string value's length set huge;
* metadata values of the wrong type (an integer field's type tag changed to string, float, array);
* tensor infos: dimension counts and dimensions huge or 0, unknown and wrong tensor types,
  offsets past the end, overlapping another tensor, off the alignment; general.alignment 0 / 3.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

HUGE = 2**63 - 1


def _offset(reader: GGUFReader, part: np.ndarray) -> int:
    return part.ctypes.data - reader.data.ctypes.data


def _with(data: bytes, offset: int, new: bytes) -> bytes:
    out = bytearray(data)
    out[offset:offset + len(new)] = new
    return bytes(out)


def truncations(data: bytes, header_end: int, count: int = 24) -> list[tuple[str, bytes]]:
    cuts = sorted({0, 3, 4, 7, 8, 15, 16, 23, 24, 25, *np.linspace(24, header_end, count // 2, dtype=int).tolist(),
                   *np.linspace(header_end, len(data) - 1, count // 2, dtype=int).tolist()})
    return [(f"truncated at {c}", data[:c]) for c in cuts if c < len(data)]


def header_mutations(path) -> list[tuple[str, bytes]]:
    """Every count/length/type/offset mutation of the (small) GGUF file at `path`."""
    data = Path(path).read_bytes()
    reader = GGUFReader(path)
    out: list[tuple[str, bytes]] = []
    for name, at in (("tensor count", 8), ("metadata count", 16)):
        for v in (0, 2**32, HUGE):
            out.append((f"{name} = {v}", _with(data, at, struct.pack("<Q", v))))
    for fname, f in reader.fields.items():
        if fname.startswith("GGUF."):
            continue
        key_len = _offset(reader, f.parts[0])
        out.append((f"{fname}: key length huge", _with(data, key_len, struct.pack("<Q", HUGE))))
        vtype_at = _offset(reader, f.parts[2])
        vtype = int(f.parts[2][0])
        if vtype == GGUFValueType.STRING:
            out.append((f"{fname}: string length huge", _with(data, _offset(reader, f.parts[3]),
                                                              struct.pack("<Q", HUGE))))
        elif vtype == GGUFValueType.ARRAY:
            out.append((f"{fname}: array length huge", _with(data, _offset(reader, f.parts[4]),
                                                             struct.pack("<Q", HUGE))))
            out.append((f"{fname}: array item type bogus", _with(data, _offset(reader, f.parts[3]),
                                                                 struct.pack("<I", 99))))
        else:
            for wrong in {GGUFValueType.STRING, GGUFValueType.FLOAT32, GGUFValueType.ARRAY, 99} - {vtype}:
                out.append((f"{fname}: type {int(wrong)} instead of {vtype}",
                            _with(data, vtype_at, struct.pack("<I", int(wrong)))))
        if fname == "general.alignment":
            for v in (0, 3, 2**31):
                out.append((f"alignment {v}", _with(data, _offset(reader, f.parts[3]), struct.pack("<I", v))))
    tensors = reader.tensors
    for i, t in enumerate(tensors[:6]):
        f = t.field
        n_dims_at, dims_at, type_at, off_at = (_offset(reader, f.parts[k]) for k in (1, 2, 3, 4))
        out += [
            (f"{t.name}: n_dims huge", _with(data, n_dims_at, struct.pack("<I", 2**31))),
            (f"{t.name}: n_dims 0", _with(data, n_dims_at, struct.pack("<I", 0))),
            (f"{t.name}: dim huge", _with(data, dims_at, struct.pack("<Q", HUGE))),
            (f"{t.name}: dim 0", _with(data, dims_at, struct.pack("<Q", 0))),
            (f"{t.name}: dim x1024", _with(data, dims_at, struct.pack("<Q", int(f.parts[2][0]) * 1024))),
            (f"{t.name}: unknown type", _with(data, type_at, struct.pack("<I", 200))),
            (f"{t.name}: offset past the end", _with(data, off_at, struct.pack("<Q", len(data)))),
            (f"{t.name}: offset huge", _with(data, off_at, struct.pack("<Q", HUGE))),
            (f"{t.name}: offset off the alignment", _with(data, off_at, struct.pack("<Q", int(f.parts[4][0]) + 1))),
        ]
        for qt in (0, 1, 2, 8, 12, 14):     # F32, F16, Q4_0, Q8_0, Q4_K, Q6_K
            if qt != int(f.parts[3][0]):
                out.append((f"{t.name}: type {qt}", _with(data, type_at, struct.pack("<I", qt))))
        if i:
            prev = int(tensors[i - 1].field.parts[4][0])
            out.append((f"{t.name}: overlaps {tensors[i - 1].name}", _with(data, off_at, struct.pack("<Q", prev))))
    return out
