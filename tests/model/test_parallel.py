"""Tensor parallelism (model/parallel.py): SmolLM2 split over two gloo processes (its 3 KV heads as
2 + 1, its MLP columns in halves) gives the logits of the unsplit float32 model within float32
tolerance, on prompt chunks and decode steps through the paged KV cache, and the engine's greedy
answers are the same token for token."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.attention import AttentionMetadata
from kvserve.model.parallel import launch, split
from kvserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tp2():
    torch.set_num_threads(1)
    loaded, rank0 = launch(None, 2, num_threads=1)
    yield loaded, rank0
    rank0.close()


def test_split_is_even_and_covers_everything():
    assert split(3, 2) == [(0, 2), (2, 3)]
    assert split(1536, 2) == [(0, 768), (768, 1536)]
    assert [b - a for a, b in split(10, 4)] == [3, 3, 2, 2]


def _caches(model, num_blocks: int) -> list[torch.Tensor]:
    cfg = model.config
    shape = (2, num_blocks, 16, cfg.num_key_value_heads, cfg.head_dim)
    return [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]


@torch.inference_mode()
def test_tp2_logits_equal_tp1(tp2):
    loaded, rank0 = tp2
    full, tok = loaded.model, loaded.tokenizer
    assert [layer.num_kv_heads for layer in rank0.layers[:1]] == [2]
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n    ")]
    caches = {"tp1": _caches(full, 8), "tp2": _caches(rank0, 8)}
    tables = [[0, 1, 2], [4, 5, 6]]
    got = {}
    for name, model in (("tp1", full), ("tp2", rank0)):
        ids = torch.tensor(prompts[0] + prompts[1])
        pos = torch.tensor(list(range(len(prompts[0]))) + list(range(len(prompts[1]))))
        meta = AttentionMetadata.build([len(p) for p in prompts], [len(p) for p in prompts], tables, 16)
        prefill = model.compute_logits(model(ids, pos, meta, caches[name]))
        nxt = prefill[[len(prompts[0]) - 1, -1]].argmax(-1)           # one decode step for both
        meta = AttentionMetadata.build([1, 1], [len(p) + 1 for p in prompts], tables, 16)
        step = model.compute_logits(model(nxt, torch.tensor([len(p) for p in prompts]), meta, caches[name]))
        got[name] = (prefill, step)
    for a, b in zip(got["tp1"], got["tp2"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-4)
    assert got["tp1"][0].abs().max() > 1      # real logits, not zeros


def test_tp2_engine_greedy_equals_tp1(tp2):
    from kvserve import LLM

    loaded, rank0 = tp2
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for name, model in (("tp1", loaded.model), ("tp2", rank0)):
        llm = LLM(model, tokenizer=loaded.tokenizer, kv_cache_memory="32MiB", kv_cache_dtype="fp32")
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats()["num_steps"] > 0          # the engine's introspection works on a shard too
    assert outs["tp2"] == outs["tp1"]
