"""Many LoRA adapters over the default model (packed GGUF, C kernels): a batch mixing 4 adapters
and the bare base gives each prompt the tokens and logprobs it gets alone; the prefix cache never
serves one adapter's blocks to another; the LRU keeps at most max_loras resident; an unknown
adapter is ModelNotFound."""

from __future__ import annotations

import pytest

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.errors import ModelNotFound
from kvserve.train.lora import random_adapter

PROMPTS = ["Name the capital city of France.", "Write a haiku about the sea.", "List three prime numbers.",
           "What is 17 times 3?", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    engine = LLM(None, kv_cache_memory="256MiB", max_loras=3)
    if not engine.engine.core.runner.model.backend.batch_invariant:
        pytest.skip("backend is not batch-invariant here")
    cfg = engine.engine.core.model_config
    targets = [None, ["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj", "k_proj"]]
    for i, t in enumerate(targets):
        engine.add_lora(f"a{i}", str(random_adapter(d / f"a{i}", cfg, i, rank=4 + 4 * (i % 2), targets=t)))
    return engine


def _run(llm, prompts, loras, max_tokens=8):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
    outs = llm.generate(list(prompts), sp, use_tqdm=False,
                        lora_request=loras)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def test_mixed_batch_equals_alone(llm):
    loras = ["a0", None, "a1", "a2", "a3"]
    mixed = _run(llm, PROMPTS, loras)
    alone = [_run(llm, [p], [lr])[0] for p, lr in zip(PROMPTS, loras)]
    assert mixed == alone           # tokens and logprobs, float ==
    base = _run(llm, PROMPTS, None)
    assert all(m != b for i, (m, b) in enumerate(zip(mixed, base)) if i != 1)   # the adapters change the
    assert sum(m[0] != b[0] for m, b in zip(mixed, base)) >= 2                    # numbers and answers
    assert mixed[1] == base[1]


def test_prefix_cache_keyed_by_adapter(llm):
    core = llm.engine.core
    p = "The quick brown fox jumps over the lazy dog. " * 6
    base = _run(llm, [p], [None], 4)[0]
    hits = core.kv.prefix_cache_hits
    lora = _run(llm, [p], ["a0"], 4)[0]
    assert core.kv.prefix_cache_hits == hits        # the base's blocks are not the adapter's
    assert lora != base
    assert _run(llm, [p], ["a0"], 4)[0] == lora
    assert core.kv.prefix_cache_hits > hits          # the adapter's own blocks are hit


def test_lru_and_unknown(llm, tmp_path):
    lora = llm.engine.core.lora
    _run(llm, PROMPTS[:4], ["a0", "a1", "a2", "a3"], 2)
    assert len(lora.resident) <= 3 and lora.num_evictions >= 1
    again = _run(llm, [PROMPTS[0]], ["a0"], 6)     # evicted ones come back from disk, same numbers
    assert again == _run(llm, [PROMPTS[0]], ["a0"], 6)
    with pytest.raises(ModelNotFound):
        _run(llm, [PROMPTS[0]], ["nope"], 2)
    cfg = llm.engine.core.model_config
    path = random_adapter(tmp_path / "late", cfg, 9, targets=["q_proj"])
    out = _run(llm, [PROMPTS[0]], [LoRARequest("late", 1, str(path))], 4)
    assert "late" in llm.list_loras() and out
    llm.remove_lora("late")
    with pytest.raises(ModelNotFound):
        _run(llm, [PROMPTS[0]], ["late"], 2)
