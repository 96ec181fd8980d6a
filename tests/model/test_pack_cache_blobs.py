"""Issue 60's pack-cache part: a `.kvpack` hit is used only if every blob has the size (and the
scales the dtype) the kernels will read for its layer; an edited or inconsistent entry makes the
load rebuild from the GGUF (same greedy tokens, the entry rewritten), never a read past a blob.
The cache's total size is capped in bytes as well as in files."""

from __future__ import annotations

import json
import struct

import pytest
from test_gguf_in_place import greedy, old_load, tiny_random

from kvserve.model.kernels import pack_cache
from kvserve.model.loader import load_model


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "packed"
    monkeypatch.setattr(pack_cache, "cache_root", lambda: root)
    return root


def edit_header(path, edit) -> None:
    """Rewrite the JSON header of a cache file in place (same length: the blobs do not move)."""
    data = bytearray(path.read_bytes())
    n = struct.unpack_from("<Q", data, 8)[0]
    header = json.loads(bytes(data[16:16 + n]))
    edit(header["entries"])
    new = json.dumps(header).encode()
    assert len(new) <= n
    data[16:16 + n] = new.ljust(n)
    path.write_bytes(bytes(data))


def entries(path) -> list[dict]:
    data = path.read_bytes()
    n = struct.unpack_from("<Q", data, 8)[0]
    return json.loads(data[16:16 + n])["entries"]


def shrink_qs(es):          # the first layer's quants a block shorter than the kernels read
    es[0]["qs"][1] -= 64


def flip_sdtype(es):        # Q4_K super-block scale bytes said to be float16: the d blob is half what is read
    e = next(e for e in es if e["sdtype"] == 2)
    e["sdtype"] = 1


def stray_minima(es):       # a Q4_K layer (its minima are in the super-block scales) given a minima blob
    e = next(e for e in es if e["sdtype"] == 2)
    e["m"][1] = 64


def shrink_scales(es):      # Q4_K super-block scales a group shorter than the kernels read
    e = next(e for e in es if e["sdtype"] == 2)
    e["d"][1] -= 320


def unaligned(es):
    es[1]["d"][0] += 2


def not_an_int(es):
    es[0]["rows"] = float(es[0]["rows"])


@pytest.mark.parametrize("edit", [shrink_qs, flip_sdtype, stray_minima, shrink_scales, unaligned, not_an_int],
                         ids=lambda f: f.__name__)
def test_edited_blob_is_rebuilt(tmp_path, cache_dir, edit):
    path = tiny_random(tmp_path / "r.gguf", "Q4_K")
    want = greedy(*old_load(path))
    load_model(str(path))
    pack_cache.wait()     # the cache file is written in the background
    (cached,) = cache_dir.glob("*.kvpack")
    good = json.dumps(entries(cached))
    edit_header(cached, edit)
    assert json.dumps(entries(cached)) != good
    loaded = load_model(str(path))
    assert greedy(loaded.model, loaded.tokenizer) == want
    pack_cache.wait()
    assert json.dumps(entries(cached)) == good         # rewritten from the file


def test_take_checks_blob_sizes(tmp_path, cache_dir):
    path = tiny_random(tmp_path / "r.gguf", "Q8_0")
    load_model(str(path))
    pack_cache.wait()     # the cache file is written in the background
    (cached,) = cache_dir.glob("*.kvpack")
    e = entries(cached)[0]
    session = pack_cache.PackSession.open(path, "")
    if not session.hit:     # the variant name differs: open the file directly
        session = pack_cache.PackSession(cached, *pack_cache._map(cached))
    scales = e["d"][1] // (2 if e["sdtype"] else 4)
    with pytest.raises(pack_cache.PackMismatch, match="blob sizes"):
        session.take(e["qtype"], e["rows"], e["cols"], (e["qs"][1] + 64, scales, False))
    session.next = 0
    qs, d, m, _ = session.take(e["qtype"], e["rows"], e["cols"], (e["qs"][1], scales, False))
    assert qs.numel() == e["qs"][1] and d.numel() == scales and m.numel() == 0


def test_total_size_is_capped_in_bytes(tmp_path, cache_dir, monkeypatch):
    a = tiny_random(tmp_path / "a.gguf", "Q4_1", seed=1)
    b = tiny_random(tmp_path / "b.gguf", "Q4_1", seed=2)
    load_model(str(a))
    pack_cache.wait()     # the cache file is written in the background
    (first,) = cache_dir.glob("*.kvpack")
    monkeypatch.setenv("KVSERVE_PACK_CACHE_MAX_BYTES", str(first.stat().st_size + 1))
    load_model(str(b))
    pack_cache.wait()     # the cache file is written in the background
    (kept,) = cache_dir.glob("*.kvpack")            # a's entry went: both do not fit the cap
    assert kept != first
    monkeypatch.setenv("KVSERVE_PACK_CACHE_MAX_BYTES", "1")
    load_model(str(a))
    pack_cache.wait()     # the cache file is written in the background
    assert len(list(cache_dir.glob("*.kvpack"))) == 1    # the newest stays even past the cap


def resident(t) -> float:
    """The share of `t`'s pages mapped into this process (/proc/self/pagemap's present bit)."""
    import mmap as _mmap
    page = _mmap.PAGESIZE
    first, last = t.data_ptr() // page, (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    present = [int.from_bytes(raw[i:i + 8], "little") >> 63 for i in range(0, len(raw), 8)]
    return sum(present) / len(present)


def test_an_untied_embedding_table_is_not_mapped_whole(tmp_path, cache_dir):
    """A load from the cache brings in every projection's pages at once but leaves the untied
    embedding table's to the rows a token reads (a 3B Q4_K_M file's table is 220 MB of RSS)."""
    import os

    if not os.path.exists("/proc/self/pagemap"):
        pytest.skip("no /proc/self/pagemap here")
    path = tiny_random(tmp_path / "r.gguf", "Q4_1")
    load_model(str(path))
    pack_cache.wait()
    again = load_model(str(path))           # from the cache
    net = again.model
    assert net.packed_embed is not None and net.packed_embed is not net.lm_head
    emb = net.packed_embed.qs
    assert emb.numel() >= 64 * 4096        # pages enough that the edges do not decide
    assert resident(emb) < 0.5, resident(emb)   # a warm-up's rows, with the kernel's fault-around (64 KiB)
    layer = [m.qs for m in net.layers[0].modules() if getattr(m, "qs", None) is not None]
    assert layer
    for w in (net.lm_head.qs, *layer):
        assert resident(w) == 1.0
    before = resident(emb)
    assert greedy(again.model, again.tokenizer) == greedy(*old_load(path))   # the rows are read on demand
    assert resident(emb) >= before
