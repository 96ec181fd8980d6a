"""The 8-bit KV cache (model/kv_quant.py): rows of int8 values with their own fp16 scale.

- the row format: what quantize_rows writes, what readers widen, a zero row;
- the C decode attention over an int8 cache == PyTorch attention over the same rows widened;
- the default model's logits bitwise the same however the prompt is chunked (whole-stack C forward
  and per-layer C glue), and the same bits with the AVX2 build (a child with the ISA forced);
- the engine: a batch mixing 12 prompts == each alone, token for token and logprob for logprob;
  1.9x the tokens in the same KV memory, shown in stats() (what /metrics exports);
- held-out perplexity through the paged int8 cache within 1% of the fp16 cache.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_kernels import scattered_block_tables
from test_same_bits import forced_avx2_logits

from kvserve import LLM, SamplingParams
from kvserve.model.attention import AttentionMetadata, attend, gather_kv
from kvserve.model.kernels.backend import KernelBackend
from kvserve.model.kv_quant import bytes_per_token, cache_shape, dequantize_rows, quantize_rows
from kvserve.model.loader import load_model

BACKEND = KernelBackend.detect()
requires_invariant = pytest.mark.skipif(not BACKEND.batch_invariant,
                                        reason=f"no batch-invariant kernels here: {BACKEND.describe()}")
PROMPT = ("The history of the bicycle begins in 1817, when Karl Drais rode his running machine through "
          "Mannheim. Over the following century the design changed again and again: pedals on the front "
          "wheel, the penny-farthing, chain drives and pneumatic tyres. Today")
BLOCK = 16


def test_row_format():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[4, 0] = 0.0
    c = quantize_rows(x)
    assert c.dtype == torch.int8 and c.shape == (5, 3, 66)
    scale = c[..., 64:].contiguous().view(torch.float16).float()[..., 0]
    assert torch.equal(scale, (x.abs().amax(-1) / 127).half().float())
    assert c[..., :64].abs().max() <= 127 and (c[..., :64].abs().amax(-1)[scale > 0] == 127).all()
    back = dequantize_rows(c)
    assert torch.equal(back[4, 0], torch.zeros(64))                       # an all-zero row stays zero
    err = (back - x).abs() / scale[..., None].clamp(min=1e-30)
    assert err.max() <= 0.5 + 1e-2                                        # half a step (fp16 scale rounding)
    assert bytes_per_token(30, 3, 64, torch.int8) * 1.9 <= bytes_per_token(30, 3, 64, torch.float16)


@pytest.mark.skipif(BACKEND.lib is None, reason="compiled kernels unavailable")
@pytest.mark.parametrize("seq_lens", [[1], [37], [5, 16, 17, 130]])
def test_c_decode_attention_over_int8_rows(seq_lens):
    g = torch.Generator().manual_seed(len(seq_lens))
    hq, hkv, d = 9, 3, 64
    tables, nblocks = scattered_block_tables(seq_lens, BLOCK, g)
    kv = quantize_rows(torch.randn(2, nblocks, BLOCK, hkv, d, generator=g) * 2)
    assert kv.shape == cache_shape(nblocks, BLOCK, hkv, d, torch.int8)
    q = torch.randn(len(seq_lens), hq, d, generator=g)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, BLOCK)
    ref = torch.cat([attend(q[b:b + 1], *gather_kv(kv, meta.block_tables[b], n), 0.125)
                     for b, n in enumerate(seq_lens)])
    out = BACKEND.paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, 0.125)
    assert out is not None and torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


def last_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    cfg = model.config
    nblocks = (len(ids) + BLOCK - 1) // BLOCK
    table = list(range(nblocks))[::-1]
    kv = [torch.zeros(cache_shape(nblocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, torch.int8),
                      dtype=torch.int8) for _ in range(cfg.num_hidden_layers)]
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            e = min(s + chunk, len(ids))
            hidden = model(torch.tensor(ids[s:e]), torch.arange(s, e), AttentionMetadata.build([e - s], [e], [table], BLOCK),
                           kv)
        return model.compute_logits(hidden[-1:])[0]


@pytest.fixture(scope="module")
def default_model():
    loaded = load_model(None)
    return loaded, loaded.tokenizer.encode(PROMPT)


@requires_invariant
def test_int8_cache_chunking_does_not_change_a_bit(default_model):
    loaded, ids = default_model
    model = loaded.model
    whole = last_logits(model, ids, len(ids))
    base = model.backend
    try:
        for fused_max in (None, 0):      # one C call per step; per-layer C glue
            model.backend = replace(base, fused_max_tokens=fused_max)
            for chunk in (1, 17, len(ids)):
                assert torch.equal(last_logits(model, ids, chunk), whole), (fused_max, chunk)
    finally:
        model.backend = base


_CHILD = """
import sys, torch
sys.path.insert(0, {here!r})
from test_kv_int8 import last_logits
from kvserve.model.loader import load_model
loaded = load_model(None)
assert loaded.model.backend.isa == "avx2", loaded.model.backend.describe()
ids = loaded.tokenizer.encode({prompt!r})
torch.save(torch.stack([last_logits(loaded.model, ids, len(ids)), last_logits(loaded.model, ids, 1)]), {out!r})
"""


@requires_invariant
def test_int8_cache_avx2_build_gives_the_same_bits(default_model, tmp_path):
    loaded, ids = default_model
    avx2 = forced_avx2_logits(_CHILD, PROMPT, tmp_path)
    assert torch.equal(avx2[0], last_logits(loaded.model, ids, len(ids)))
    assert torch.equal(avx2[1], avx2[0])


@requires_invariant
def test_engine_batch_invariant_and_holds_more_tokens(default_model):
    loaded, _ = default_model
    fp16 = LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory="64MiB")
    llm = LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory="64MiB", kv_cache_dtype="int8",
              max_num_batched_tokens=64)
    a, b = fp16.stats(), llm.stats()
    assert (a["kv_cache_dtype"], b["kv_cache_dtype"]) == ("float16", "int8")
    assert b["kv_cache_bytes_per_token"] == 2 * 30 * 3 * 66 and a["kv_cache_bytes_per_token"] == 2 * 30 * 3 * 128
    assert b["kv_cache_capacity_tokens"] >= 1.9 * a["kv_cache_capacity_tokens"]
    tok = loaded.tokenizer
    questions = ["Name the capital city of France.", "Write a haiku about the sea.", "List three prime numbers.",
                 "What is 17 times 3?", "Why is the sky blue?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for q in questions]
    prompts.append(tok.encode(PROMPT * 3))        # ~150 tokens: prefilled in chunks of 64 next to decodes
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def sig(o):
        c = o.outputs[0]
        return c.token_ids, [sorted((t, lp.logprob) for t, lp in p.items()) for p in c.logprobs]

    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, batched):
        alone = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        assert sig(out) == sig(alone)


def test_bad_kv_cache_dtype_is_a_clean_error():
    from kvserve.engine.config import EngineConfig
    from kvserve.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="kv_cache_dtype must be one of auto, fp16, bf16, fp32, int8"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig(kv_cache_dtype="auto").torch_kv_dtype == torch.float16


def test_perplexity_within_one_percent_of_fp16_cache():
    from kvserve.train.data import load_corpus, split_documents
    from kvserve.train.evaluate import perplexity

    text = "\n\n".join(split_documents(load_corpus())[1][:3])
    r = {kv: perplexity(None, text, seq_len=128, max_windows=3, weight_format="auto", paged_chunk=16, kv_cache_dtype=kv)
         for kv in ("fp16", "int8")}
    assert r["fp16"].tokens == r["int8"].tokens == 384
    assert abs(r["int8"].perplexity / r["fp16"].perplexity - 1) < 0.01, (r["int8"].perplexity, r["fp16"].perplexity)
