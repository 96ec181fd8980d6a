"""The default model's logits are bitwise the same however a prompt is chunked, through the
whole-stack C forward or the per-layer path, and on every x86-64 CPU: the int8
kernels' arithmetic is defined per output and the AVX2 and AVX-512 VNNI tiles both follow it, and
the rest of the C code is one AVX2 build. The second check runs the same prompt in a child process
with the lower ISA forced and compares the bits."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from kvserve.model.attention import AttentionMetadata
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.loader import load_model

BACKEND = KernelBackend.detect()
pytestmark = pytest.mark.skipif(not BACKEND.batch_invariant, reason=f"no batch-invariant kernels here: {BACKEND.describe()}")

BLOCK = 16
PROMPT = ("The history of the bicycle begins in 1817, when Karl Drais rode his running machine through "
          "Mannheim. Over the following century the design changed again and again: pedals on the front "
          "wheel, the penny-farthing, chain drives and pneumatic tyres. Today")


def last_logits(model, ids: list[int], chunk: int, kv_dtype=torch.float16) -> torch.Tensor:
    """Prefill `ids` in chunks of `chunk` tokens through the paged path; logits of the last one."""
    cfg = model.config
    nblocks = (len(ids) + BLOCK - 1) // BLOCK
    table = list(range(nblocks))[::-1]                 # blocks in reverse order: a real gather
    kv = [torch.zeros(2, nblocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=kv_dtype)
          for _ in range(cfg.num_hidden_layers)]
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            e = min(s + chunk, len(ids))
            meta = AttentionMetadata.build([e - s], [e], [table], BLOCK)
            hidden = model(torch.tensor(ids[s:e]), torch.arange(s, e), meta, kv)
        return model.compute_logits(hidden[-1:])[0]


@pytest.fixture(scope="module")
def default_model():
    loaded = load_model(None)
    return loaded.model, loaded.tokenizer.encode(PROMPT)


def test_chunking_does_not_change_a_bit(default_model):
    model, ids = default_model
    assert len(ids) > 40
    whole = last_logits(model, ids, len(ids))
    base = model.backend
    try:
        for fused_max in (None, 16, 0):   # one C call per step; up to 16 tokens; per-layer C glue
            model.backend = replace(base, fused_max_tokens=fused_max)
            for chunk in (1, 5, 16, 17, 33, len(ids)):
                assert torch.equal(last_logits(model, ids, chunk), whole), (fused_max, chunk)
    finally:
        model.backend = base


def test_a_deep_decode_among_short_ones_gets_its_bits_alone(default_model):
    """A step of lone queries: short decodes and one deep in its context (a long prompt's token).
    The deep one's KV heads run as separate items, the short ones' heads together; every query's
    output is still the bits it gets alone."""
    model, _ = default_model
    cfg = model.config
    lens = [30, 41, 17, 52, 1500]                      # the last: more than the team's share
    need = [(n + BLOCK - 1) // BLOCK for n in lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(3)).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    g = torch.Generator().manual_seed(5)
    kv = [torch.randn(2, sum(need), BLOCK, cfg.num_key_value_heads, cfg.head_dim, generator=g).half()
          for _ in range(cfg.num_hidden_layers)]
    ids = torch.tensor([100 + 7 * j for j in range(len(lens))])
    pos = torch.tensor([n - 1 for n in lens])

    def run(rows: list[int]) -> torch.Tensor:
        meta = AttentionMetadata.build([1] * len(rows), [lens[r] for r in rows], [tables[r] for r in rows], BLOCK)
        cache = [c.clone() for c in kv]               # each run writes its rows' own K/V
        with torch.inference_mode():
            return model(ids[rows], pos[rows], meta, cache)

    batched = run(list(range(len(lens))))
    for r in range(len(lens)):
        assert torch.equal(run([r])[0], batched[r]), lens[r]


_CHILD = """
import sys, torch
sys.path.insert(0, {here!r})
from test_same_bits import last_logits
from kvserve.model.loader import load_model
loaded = load_model(None)
model = loaded.model
assert model.backend.isa == "avx2" and model.backend.gemm_isa == 0, model.backend.describe()
ids = loaded.tokenizer.encode({prompt!r})
torch.save(torch.stack([last_logits(model, ids, len(ids)), last_logits(model, ids, 7)]), {out!r})
"""


def forced_avx2_logits(child: str, prompt: str, tmp_path) -> torch.Tensor:
    """What `child` (code that saves logits to `{out}`) saves in a process forced onto the AVX2
    build; skips on an AVX2-only CPU, where that process would be this one."""
    if BACKEND.isa == "avx2":
        pytest.skip("this CPU is AVX2-only: the forced-AVX2 run would be this run")
    out = tmp_path / "avx2.pt"
    env = {**os.environ, "KVSERVE_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    code = child.format(here=os.path.dirname(__file__), prompt=prompt, out=str(out))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    return torch.load(out, weights_only=True)


def test_avx2_build_gives_the_same_bits(default_model, tmp_path):
    model, ids = default_model
    avx2 = forced_avx2_logits(_CHILD, PROMPT, tmp_path)
    assert torch.equal(avx2[0], last_logits(model, ids, len(ids)))
    assert torch.equal(avx2[1], avx2[0])
