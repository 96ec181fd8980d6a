"""Prompts that cannot fit get ContextLengthExceeded naming the real limit: the model's context
window, or the KV cache when kv_cache_memory holds fewer tokens than that."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from ggufmaker import make_tiny_llama_gguf

from kvserve import LLM, SamplingParams
from kvserve.errors import ContextLengthExceeded


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", qtype="Q8_0", ctx=128)


def test_model_context_limit(tiny):
    llm = LLM(str(tiny), kv_cache_memory="64MiB")
    assert llm.engine.max_model_len == 128
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 128") as e:
        llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=50), use_tqdm=False)
    assert e.value.param == "max_tokens"


def test_kv_cache_limit(tiny):
    per_block = 2 * 2 * 16 * 2 * 64 * 2            # layers * (K, V) * block * kv heads * head_dim * fp16
    llm = LLM(str(tiny), kv_cache_memory=4 * per_block)
    assert llm.engine.max_model_len == 64
    with pytest.raises(ContextLengthExceeded, match="KV cache .* at most 64 tokens") as e:
        llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert e.value.param == "prompt"
    out = llm.generate({"prompt_token_ids": [5] * 40}, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
