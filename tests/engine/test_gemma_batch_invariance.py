"""Batch invariance for Gemma 2 and Gemma 3 on the fast path (issue 58), through the engine: the
local layers' own KV pool (engine/kv_hybrid.py) and the whole-stack C forward with sliding windows,
soft-capping and q/k norm. Random-weight GGUFs of the tiny Gemma shapes (window 16, so the prompts
and continuations run past it); a request's tokens and logprobs are exactly the same batched as
alone, in 16-token prompt chunks as in one step, and from the prefix cache as cold."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.gguf_random import write
from kvserve.model.kernels.backend import KernelBackend

pytestmark = pytest.mark.skipif(not KernelBackend.detect().batch_invariant,
                                reason="the backend is not batch-invariant (no C kernels or KVSERVE_BATCH_INVARIANT=0)")


@pytest.fixture(scope="module", params=[("gemma2-tiny", "Q8_0"), ("gemma3-tiny", "Q4_0")], ids=lambda p: p[0])
def gguf(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gemma") / f"{request.param[0]}.gguf"
    write(path, request.param[0], request.param[1], seed=2)
    return str(path)


def _prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 4000, (length,), generator=g).tolist() for length in (5, 12, 23, 40, 61, 90)[:n]]


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob,
             [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in o.outputs[0].logprobs]) for o in outs]


def test_batched_equals_alone_and_chunked(gguf):
    llm = LLM(gguf, kv_cache_memory="32MiB", block_size=4)
    assert llm.engine.block_size == 4
    prompts = _prompts()
    batched = _run(llm, prompts)
    for i, p in enumerate(prompts):
        assert _run(llm, [p])[0] == batched[i], f"prompt {i} ({len(p)} tokens): batched vs alone"
    chunked = _run(LLM(gguf, kv_cache_memory="32MiB", block_size=4, max_num_batched_tokens=16), prompts)
    assert chunked == batched
    assert len({tuple(b[0]) for b in batched}) == len(prompts)   # the model says different things
