"""Loading a GGUF in place: the memory-mapped reader reads what gguf's GGUFReader reads, a model
loaded from the mapping (and from the pack cache, on its first and later loads) answers greedily
token for token as one built the old way (GGUFReader, every layer repacked), the cache follows
the file's content, and RSS after a load stays near the file's size (generous bounds, no times).
"""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from ggufmaker import make_tiny_llama_gguf

from kvserve.engine.llm import LLM
from kvserve.errors import ModelLoadError
from kvserve.model.decoder import DecoderLM
from kvserve.model.gguf_file import GGUFFile
from kvserve.model.gguf_loader import config_from_gguf, weights_from_gguf
from kvserve.model.kernels import pack_cache
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.loader import load_model
from kvserve.model.registry import resolve
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer

PROMPTS = ["The capital of France is", "def fib(n):"]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "packed"
    monkeypatch.setattr(pack_cache, "cache_root", lambda: root)
    return root


def greedy(model: DecoderLM, tok: Tokenizer, n: int = 12) -> list[list[int]]:
    llm = LLM(model, tokenizer=tok, kv_cache_memory="32MiB")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def old_load(path) -> tuple[DecoderLM, Tokenizer]:
    """Today's load before this change: gguf's reader, every packed layer repacked from it."""
    reader = gguf.GGUFReader(path)
    cfg = config_from_gguf(reader)
    with torch.no_grad():
        net = DecoderLM.from_weights(cfg, weights_from_gguf(reader, cfg), backend=KernelBackend.detect()).eval()
    return net, Tokenizer.from_gguf(reader)


def assert_same_file(path) -> None:
    a, b = gguf.GGUFReader(path), GGUFFile(path)
    assert list(a.fields) == list(b.fields)
    for key, fa in a.fields.items():
        fb = b.fields[key]
        assert fa.types == fb.types and len(fa.data) == len(fb.data), key
        assert fa.contents() == fb.contents(), key
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        assert (ta.name, ta.tensor_type, ta.n_bytes, ta.data_offset) == (tb.name, tb.tensor_type, tb.n_bytes,
                                                                          tb.data_offset)
        assert ta.data.shape == tb.data.shape and ta.data.dtype == tb.data.dtype, ta.name
        assert np.array_equal(ta.data, tb.data), ta.name


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_K"])
def test_reader_matches_gguf_reader(tmp_path, qtype):
    assert_same_file(make_tiny_llama_gguf(tmp_path / "m.gguf", qtype=qtype))


def test_reader_matches_gguf_reader_on_default_model():
    assert_same_file(resolve(None).path)


def tiny_random(path, qtype: str, seed: int = 0):
    from kvserve.bench.gguf_random import write

    return write(path, "tiny", qtype, seed)


@pytest.mark.parametrize("make", ["default", "Q4_1", "Q4_K", "Q8_0", "Q4_0"])
def test_same_greedy_tokens_as_the_old_load(tmp_path, cache_dir, monkeypatch, make):
    path = resolve(None).path if make == "default" else tiny_random(tmp_path / "r.gguf", make)
    want = greedy(*old_load(path))
    first = load_model(str(path))                 # repacks, writes the cache, maps it
    pack_cache.wait()     # the cache file is written in the background
    assert len(list(cache_dir.glob("*.kvpack"))) == 1
    assert greedy(first.model, first.tokenizer) == want
    from kvserve.model.kernels.gguf_linear import GGUFQuantLinear

    def no_repack(*_):
        raise AssertionError("repacked although cached")

    monkeypatch.setattr(GGUFQuantLinear, "_repack", no_repack)
    again = load_model(str(path))                 # maps the cache, repacks nothing
    assert greedy(again.model, again.tokenizer) == want


def test_cache_follows_the_file_content(tmp_path, cache_dir):
    path = tiny_random(tmp_path / "r.gguf", "Q4_1", seed=1)
    a = greedy(*old_load(path))
    load_model(str(path))
    tiny_random(path, "Q4_1", seed=2)            # same name and shapes, other weights
    b = greedy(*old_load(path))
    assert a != b
    loaded = load_model(str(path))
    assert greedy(loaded.model, loaded.tokenizer) == b
    pack_cache.wait()     # the cache file is written in the background
    assert len(list(cache_dir.glob("*.kvpack"))) == 2


def test_corrupt_cache_file_is_rebuilt(tmp_path, cache_dir):
    path = tiny_random(tmp_path / "r.gguf", "Q8_0")
    want = greedy(*old_load(path))
    load_model(str(path))
    pack_cache.wait()     # the cache file is written in the background
    (cached,) = cache_dir.glob("*.kvpack")
    cached.write_bytes(cached.read_bytes()[: cached.stat().st_size // 2])     # truncated
    loaded = load_model(str(path))
    assert greedy(loaded.model, loaded.tokenizer) == want
    assert cached.stat().st_size > 0 and load_model(str(path)) is not None


def test_cache_off(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("KVSERVE_PACK_CACHE", "0")
    path = tiny_random(tmp_path / "r.gguf", "Q4_1")
    loaded = load_model(str(path))
    assert greedy(loaded.model, loaded.tokenizer) == greedy(*old_load(path))
    assert not cache_dir.exists()


def test_truncated_tensor_data_is_a_clear_error(tmp_path):
    path = tiny_random(tmp_path / "r.gguf", "Q4_1")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(str(cut))


RSS_PROBE = """
import json, sys
import torch
from kvserve.model.kernels import pack_cache
from kvserve.model.loader import load_model
from pathlib import Path
pack_cache.cache_root = lambda: Path(sys.argv[2])
def rss():
    return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status")
            if l.startswith(("VmRSS", "RssAnon", "RssFile"))}
before = rss()
m = load_model(sys.argv[1])
print(json.dumps({"before": before, "after": rss()}))
"""


def test_rss_after_load_is_about_the_file(tmp_path):
    """A random model of 1024 wide, 4 layers and a 32k vocabulary (about 40 MB): what a load adds
    to the process's RSS is within 1.5x the file plus 64 MB, cold (repacked) and from the cache."""
    from kvserve.bench import gguf_random

    gguf_random.SHAPES["rss-test"] = (1024, 2816, 4, 16, 4, 32000)
    try:
        path = gguf_random.write(tmp_path / "m.gguf", "rss-test", "Q4_1")
    finally:
        del gguf_random.SHAPES["rss-test"]
    size = path.stat().st_size
    for run in ("repack", "cached"):
        out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(path), str(tmp_path / "packed")],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        added = r["after"]["VmRSS"] - r["before"]["VmRSS"]
        assert added <= 1.5 * size + (64 << 20), (run, added, size, r)


def test_cached_tokenizer_encodes_the_same(tmp_path, cache_dir):
    from kvserve.model.loader import _gguf_tokenizer

    path = resolve(None).path
    reader = GGUFFile(path)
    want = Tokenizer.from_gguf(reader)
    first, again = _gguf_tokenizer(path, reader), _gguf_tokenizer(path, reader)   # builds and writes; reads
    assert len(list(cache_dir.glob("*.tokenizer.json"))) == 1
    text = "<|im_start|>user\nHéllo wörld 12345, naïve café 🤖 def f(x): return x**2<|im_end|>"
    for tok in (first, again):
        assert tok.encode(text) == want.encode(text)
        assert tok.hf.get_vocab(with_added_tokens=True) == want.hf.get_vocab(with_added_tokens=True)
        assert (tok.eos_token_ids, tok.bos_token_id, tok.all_special_ids) == (
            want.eos_token_ids, want.bos_token_id, want.all_special_ids)
        assert tok.decode(want.encode(text)) == want.decode(want.encode(text))


def test_mismatched_cache_falls_back_to_the_file(tmp_path, cache_dir, monkeypatch):
    path = tiny_random(tmp_path / "r.gguf", "Q4_K")
    want = greedy(*old_load(path))
    load_model(str(path))
    real_take = pack_cache.PackSession.take

    def take(self, *a):
        if self.next == 3:
            raise pack_cache.PackMismatch("entry 3 does not fit")
        return real_take(self, *a)

    monkeypatch.setattr(pack_cache.PackSession, "take", take)
    loaded = load_model(str(path))
    assert greedy(loaded.model, loaded.tokenizer) == want


def test_cache_written_at_once_when_not_in_background(tmp_path, cache_dir, monkeypatch):
    """BACKGROUND off: the file is written before load_model returns and the layers map it."""
    monkeypatch.setattr(pack_cache, "BACKGROUND", False)
    path = tiny_random(tmp_path / "r.gguf", "Q4_0")
    want = greedy(*old_load(path))
    first = load_model(str(path))
    assert len(list(cache_dir.glob("*.kvpack"))) == 1
    assert greedy(first.model, first.tokenizer) == want
    again = load_model(str(path))
    assert greedy(again.model, again.tokenizer) == want


def test_file_identity_follows_the_file_version(tmp_path):
    """The cache key's file identity: stable for one version; another mtime or one changed byte
    in a sampled region (the header, here) gives another."""
    import os

    path = tiny_random(tmp_path / "r.gguf", "Q4_1")
    a = pack_cache.file_identity(path)
    assert pack_cache.file_identity(path) == a
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert pack_cache.file_identity(path) != a
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert pack_cache.file_identity(path) != a


def test_q4_0_minima_are_not_stored(tmp_path, cache_dir):
    """A Q4_0 minimum is -8 d: the cache file leaves it out (<= 1.1x the file) and a hit derives
    the same values (== : the padding rows' +0 and -0 alike)."""
    from kvserve.model.kernels.gguf_linear import GGUFQuantLinear

    path = tiny_random(tmp_path / "r.gguf", "Q4_0")
    first = load_model(str(path))
    pack_cache.wait()
    (cached,) = cache_dir.glob("*.kvpack")
    entries, _ = pack_cache._map(cached)
    assert entries and all(e["m"][1] == 0 and e["m_is_-8d"] for e in entries if e["qtype"] == 2)
    again = load_model(str(path))
    layers = [(a, b) for a, b in zip(first.model.modules(), again.model.modules(), strict=True)
              if isinstance(a, GGUFQuantLinear)]
    assert layers
    for a, b in layers:
        assert a.m.dtype == b.m.dtype and torch.equal(a.m, b.m) and torch.equal(a.d, b.d)
