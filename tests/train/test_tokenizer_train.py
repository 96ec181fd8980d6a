import json

import pytest

from kvserve.errors import InvalidRequest
from kvserve.train.tokenizer_train import (
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    bytes_per_token,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

INLINE = ["the cat sat on the mat. " * 20, "the dog sat on the log! " * 20, "naïve café — déjà vu\n\tend"]


@pytest.mark.parametrize("text", [
    "plain words and  double  spaces\n\n\ttabs",
    "emoji 👋🏽 family 👨‍👩‍👧 flag 🇫🇷 and CJK 中文字 and RTL שלום",
    f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n",
    "<|endoftext|>text right after a special token<|im_end|>",
    "\x00 control \r\n bytes \u200b zero-width",
    "",
])
def test_round_trip_is_exact(tmp_path, text):
    tok = load_tokenizer(save_tokenizer(train_tokenizer(INLINE, vocab_size=300, min_frequency=1), tmp_path))
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids_and_chat_template_is_chatml(tmp_path):
    out = save_tokenizer(train_tokenizer(INLINE, vocab_size=300, min_frequency=1), tmp_path)
    tok = load_tokenizer(out)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.encode(t, add_special_tokens=False) == [i]
    assert tok.eos_token_id == tok.hf.token_to_id(IM_END)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in cfg["chat_template"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_compression_on_bundled_corpus(tok_dir):
    from kvserve.train.data import load_corpus, split_documents

    tok = load_tokenizer(tok_dir)
    held = "\n\n".join(split_documents(load_corpus(max_chars=400_000))[1])
    # 512 merges already compress English well beyond one byte per token
    assert bytes_per_token(tok, held) > 2.0


def test_vocab_too_small_is_a_user_error():
    with pytest.raises(InvalidRequest, match="vocab size"):
        train_tokenizer(INLINE, vocab_size=100)
