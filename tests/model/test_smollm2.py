"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), against transformers loading the same
file: last-position logits within 1e-3, and the same 32 greedy tokens."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.registry import resolve

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.", "Explain gravity to a child in one sentence."]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = resolve(None).path
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(weight_format="fp32", kv_cache_memory="256MiB")


def _chat_ids(llm, text):
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=True)


def test_last_position_logits_match(hf_model, llm):
    model = llm.engine.core.runner.model
    for text in PROMPTS:
        ids = _chat_ids(llm, text)
        with torch.no_grad():
            ours = model.compute_logits(model(torch.tensor([ids]))[:, -1])[0]
            ref = hf_model(torch.tensor([ids])).logits[0, -1]
        assert (ours - ref).abs().max().item() <= 1e-3, text


def test_greedy_tokens_identical(hf_model, llm):
    for text in PROMPTS[:2]:
        ids = _chat_ids(llm, text)
        ours = llm.generate({"prompt_token_ids": ids},
                            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert ours[0].outputs[0].token_ids == ref[0, len(ids):].tolist(), text


def test_tokenizer_matches_transformers():
    from transformers import AutoTokenizer

    path = resolve(None).path
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    from kvserve.model.gguf_loader import open_gguf
    from kvserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(open_gguf(path))
    for text in ["Hello, world!", "  spaces   and\ttabs\n\nnew lines", "numbers 1234567 and 3.14",
                 "émojis 🙂🚀 and 中文字符", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
