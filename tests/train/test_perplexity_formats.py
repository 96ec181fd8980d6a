"""`kvserve eval perplexity` across weight formats and against llama.cpp on the same token windows,
at a tiny size (two windows of 32 tokens of the bundled held-out text)."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys

import pytest

from kvserve.train.data import load_corpus, split_documents
from kvserve.train.evaluate import perplexity, perplexity_table


@pytest.fixture(scope="module")
def heldout() -> str:
    return "\n\n".join(split_documents(load_corpus())[1][:3])


def test_weight_formats_score_the_same_tokens(heldout):
    rows = [(fmt, perplexity(None, heldout, seq_len=32, max_windows=2, weight_format=fmt))
            for fmt in ("fp32", "bf16", "auto")]
    ref = rows[0][1]
    for _, r in rows:
        assert (r.tokens, r.bytes) == (ref.tokens, ref.bytes) == (64, ref.bytes)
        assert math.isfinite(r.perplexity) and 1.0 < r.perplexity < 1000
        assert abs(r.perplexity / ref.perplexity - 1) < 0.05      # quantized formats hold quality
    table = perplexity_table(rows)
    assert table.splitlines()[2].startswith("| fp32 |") and "+0.00%" in table


def test_serving_path_scores_like_the_cache_free_pass(heldout):
    """--paged-chunk: the same windows through the paged KV cache, token by token (the decode path)
    and in chunks; with fp32 weights and an fp32 cache it is the cache-free number to fp32 rounding
    (different GEMM shapes per pass), a
    16-bit cache stays within a fraction of a percent."""
    ref = perplexity(None, heldout, seq_len=32, max_windows=2, weight_format="fp32")
    for chunk, kv, tol in ((1, "fp32", 5e-4), (7, "fp32", 5e-4), (1, "fp16", 5e-3), (5, "bf16", 1e-2)):
        r = perplexity(None, heldout, seq_len=32, max_windows=2, weight_format="fp32", paged_chunk=chunk,
                       kv_cache_dtype=kv)
        assert (r.tokens, r.bytes) == (ref.tokens, ref.bytes)
        assert abs(r.perplexity / ref.perplexity - 1) < tol, (chunk, kv, r.perplexity, ref.perplexity)
    auto = perplexity(None, heldout, seq_len=32, max_windows=2, weight_format="auto", paged_chunk=1)
    assert abs(auto.perplexity / ref.perplexity - 1) < 0.05


def test_unknown_weight_format_is_a_clean_error():
    p = subprocess.run([sys.executable, "-m", "kvserve.cli", "eval", "perplexity", "--max-windows", "1",
                        "--seq-len", "16", "--weight-format", "int3"],
                       check=False, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "unknown weight format 'int3'" in p.stderr


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_llama_cpp_peer_scores_the_same_windows():
    # A subprocess: a llama.cpp build with CPU features this machine lacks dies with SIGILL.
    p = subprocess.run([sys.executable, "-m", "kvserve.cli", "eval", "perplexity", "--max-windows", "2",
                        "--seq-len", "32", "--threads", "2", "--peer", "llama-cpp"],
                       check=False, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = {m[0]: (float(m[1]), int(m[2])) for m in re.findall(r"\| (kvserve fp32|llama\.cpp) \| ([\d.]+) \|.*\| (\d+) \|",
                                                                p.stdout)}
    assert rows["kvserve fp32"][1] == rows["llama.cpp"][1] == 64
    assert abs(rows["llama.cpp"][0] / rows["kvserve fp32"][0] - 1) < 0.05
