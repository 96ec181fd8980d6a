"""The model runner's stages: prepare_inputs -> forward -> sample, each with typed inputs and
outputs, compose to `execute`, and nothing of a step is left on the model."""

from __future__ import annotations

import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.model_runner import StepInputs


def test_stages_compose_to_execute(loaded):
    llm = LLM(loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory="64MiB")
    engine = llm.engine
    prompts = [loaded.tokenizer.encode(t) for t in ("The capital of France is", "One, two, three,")]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=4, logprobs=2))
    sched = engine.core.scheduler.schedule()
    runner = engine.core.runner

    inputs = runner.prepare_inputs(sched)
    assert isinstance(inputs, StepInputs)
    total = sum(len(p) for p in prompts)
    assert inputs.input_ids.tolist() == prompts[0] + prompts[1]
    assert inputs.query_lens == [len(p) for p in prompts]
    assert inputs.logit_rows == [len(prompts[0]) - 1, total - 1]     # the last row of each prompt
    assert [r.request_id for r in inputs.sampled] == ["0", "1"]
    assert inputs.lora is None and inputs.masks is None and not inputs.spec and not inputs.prompt_lp

    with torch.inference_mode():
        hidden = runner.forward(inputs)
        staged = runner.sample(inputs, hidden)
    again = runner.execute(sched)       # the same step again: the same KV slots, the same numbers
    assert hidden.shape == (total, loaded.config.hidden_size)
    assert staged.req_ids == again.req_ids == ["0", "1"]
    assert staged.sampled_token_ids == again.sampled_token_ids
    assert [[(e.logprob, e.top_token_ids) for e in row] for row in staged.logprobs] == \
        [[(e.logprob, e.top_token_ids) for e in row] for row in again.logprobs]
    for attr in ("lora", "captured", "capture_layers"):      # a step's extras are arguments only
        assert not hasattr(loaded.model, attr)


def test_forward_features_returns_what_forward_returns(loaded):
    """forward_features(capture_layers=...) gives the same final rows as forward, and the inner
    layers' rows beside them; without layers, no second tensor."""
    from kvserve.model.attention import AttentionMetadata
    from kvserve.model.kv_quant import cache_shape

    m, cfg = loaded.model, loaded.config

    def caches():
        return [torch.zeros(cache_shape(4, 16, cfg.num_key_value_heads, cfg.head_dim, torch.float16),
                            dtype=torch.float16) for _ in range(cfg.num_hidden_layers)]

    ids, pos = torch.arange(200, 212), torch.arange(12)
    meta = AttentionMetadata.build([12], [12], [[0]], 16)
    with torch.inference_mode():
        h = m(ids, pos, meta, caches())
        h2, none = m.forward_features(ids, pos, meta, caches())
        h3, aux = m.forward_features(ids, pos, meta, caches(), capture_layers=(3,))
    assert none is None and aux.shape == (12, 1, cfg.hidden_size)
    assert torch.equal(h, h2) and torch.equal(h, h3)
