"""The GGUF header is walked once, bounds-checked as it is read (gguf_file.py over gguf_check.py's
cursor): a corrupt file ends in the checks' own ModelLoadError from GGUFFile itself, and loading
a file opens and walks its header one time."""

from __future__ import annotations

import struct

import pytest
from gguf import GGUFReader
from gguf_mutations import HUGE, _offset, _with
from ggufmaker import make_tiny_llama_gguf

from kvserve.errors import ModelLoadError
from kvserve.model import gguf_file
from kvserve.model.gguf_file import GGUFFile
from kvserve.model.gguf_loader import open_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama_gguf(tmp_path_factory.mktemp("walk") / "tiny.gguf", qtype="Q8_0")


def _mutant(tmp_path, data: bytes):
    path = tmp_path / "mutant.gguf"
    path.write_bytes(data)
    return path


def test_corrupt_headers_fail_in_the_one_walk(tiny, tmp_path):
    data = tiny.read_bytes()
    reader = GGUFReader(tiny)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    cases = {
        "claims 9223372036854775807 items, more than the file holds":
            _with(data, _offset(reader, tokens.parts[4]), struct.pack("<Q", HUGE)),
        "has unknown item type 99": _with(data, _offset(reader, tokens.parts[3]), struct.pack("<I", 99)),
        "the header claims": _with(data, 16, struct.pack("<Q", HUGE)),
        "has unknown type 200": _with(data, _offset(reader, reader.tensors[0].field.parts[4]), struct.pack("<I", 200)),
        "extends beyond the end of the file": data[: len(data) - 64],
        "GGUF version 7 is not supported": _with(data, 4, struct.pack("<I", 7)),
    }
    for message, blob in cases.items():
        path = _mutant(tmp_path, blob)
        for read in (GGUFFile, open_gguf):
            with pytest.raises(ModelLoadError, match="truncated or corrupt") as e:
                read(path)
            assert message in str(e.value) and "\n" not in str(e.value), (message, str(e.value))


def test_empty_and_foreign_files(tmp_path):
    with pytest.raises(ModelLoadError, match="is empty"):
        GGUFFile(_mutant(tmp_path, b""))
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        GGUFFile(_mutant(tmp_path, b"PK\x03\x04" + bytes(64)))


def test_open_walks_the_header_once(tiny, monkeypatch):
    walks = []
    real = gguf_file.GGUFFile._parse

    def counted(self, c):
        walks.append(self.path)
        return real(self, c)

    monkeypatch.setattr(gguf_file.GGUFFile, "_parse", counted)
    reader = open_gguf(tiny)
    assert walks == [tiny] and len(reader.tensors) == len(GGUFReader(tiny).tensors)
