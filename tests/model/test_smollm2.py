"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), against transformers loading the same
file: last-position logits within 1e-3, and the same 32 greedy tokens."""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.registry import resolve

TIE_GAP = 2e-3   # twice the logit tolerance of test_last_position_logits_match
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
    """Token for token, except where transformers' own top-2 logits are within TIE_GAP (a near tie
    that rounding may break either way; the generations then part and the rest is not compared).
    The closest steps of these two answers are 0.03 and 0.07 nats apart, so in practice all 32
    tokens must agree."""
    for text in PROMPTS[:2]:
        ids = _chat_ids(llm, text)
        ours = llm.generate({"prompt_token_ids": ids},
                            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                    output_scores=True, return_dict_in_generate=True)
        got, want = ours[0].outputs[0].token_ids, ref.sequences[0, len(ids):].tolist()
        assert len(got) == len(want) == 32
        for j, (a, b) in enumerate(zip(got, want)):
            if a != b:
                gap = (ref.scores[j][0, b] - ref.scores[j][0, a]).item()
                assert gap < TIE_GAP, f"{text!r}: greedy token {j} differs ({a} vs {b}) with a logit gap of {gap:.2e}"
                print(f"{text!r}: near tie at token {j} (gap {gap:.1e}); the rest is not compared")
                break


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
