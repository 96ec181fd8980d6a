"""`fit_messages` turns away a chat that can never fit on its length alone (issue 60): a 0.5 MB chat
for a 512-token window is refused without rendering or tokenizing it (the hostile kind
`pii_heavy_input` cost 1 s of a core per request before), and with `truncate: "oldest"` the turns
that alone overflow are dropped before any tokenizing. The bound is checked to stay below the
real count on the real tokenizer."""

from __future__ import annotations

import random

import pytest

from kvserve.errors import ContextLengthExceeded
from kvserve.server.generation.context import fit_messages, longest_token_chars, min_tokens

PII = " ".join(f"user{i}.name@mail{i % 97}.example.com a.b.c.d@" for i in range(12_000))


@pytest.fixture(scope="module")
def tokenizer():
    from gguf import GGUFReader

    from kvserve.model.registry import resolve
    from kvserve.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_gguf(GGUFReader(resolve(None).path))


class Counting:
    """The real tokenizer, counting the characters it tokenizes and renders."""

    def __init__(self, tok):
        self.tok, self.hf, self.encoded, self.rendered = tok, tok.hf, 0, 0

    def encode(self, text, add_special_tokens=True):
        self.encoded += len(text)
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, msgs, **kw):
        self.rendered += sum(len(m["content"]) for m in msgs)
        return self.tok.apply_chat_template(msgs, **kw)


def test_a_huge_chat_is_refused_without_tokenizing(tokenizer):
    tok = Counting(tokenizer)
    with pytest.raises(ContextLengthExceeded, match="at least"):
        fit_messages(tok, [{"role": "user", "content": PII}], max_model_len=512, max_tokens=1, truncate=None)
    assert tok.encoded == 0 and tok.rendered == 0


def test_truncation_drops_what_alone_overflows_before_tokenizing(tokenizer):
    tok = Counting(tokenizer)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PII},
            {"role": "assistant", "content": "Too long."}, {"role": "user", "content": "Name one colour."}]
    fitted = fit_messages(tok, msgs, max_model_len=512, max_tokens=16, truncate="oldest")
    assert fitted.dropped_messages >= 1
    assert tok.encoded < len(PII) // 10         # the 0.5 MB turn was never tokenized
    plain = fit_messages(tokenizer, msgs[:1] + msgs[2:], max_model_len=512, max_tokens=16, truncate="oldest")
    assert fitted.token_ids == plain.token_ids   # the same prompt as without the huge turn


def test_the_bound_stays_below_the_real_count(tokenizer):
    rng = random.Random(60)
    alphabet = [chr(c) for c in (*range(32, 127), *range(0x400, 0x450), *range(0x4E00, 0x4E40), 0x1F600, 0x301)]
    texts = [PII[:20_000], "<|im_start|>" * 2000, " " * 10_000, "a" * 10_000,
             *("".join(rng.choice(alphabet) for _ in range(5000)) for _ in range(5))]
    assert longest_token_chars(tokenizer) > 1
    for text in texts:
        real = len(tokenizer.encode(text, add_special_tokens=False))
        assert min_tokens(tokenizer, [{"role": "user", "content": text}]) <= real


def test_the_plan_refuses_on_length_before_any_scan(tokenizer):
    """`refuse_by_length` (the plan's gate before input moderation) on a validated request."""
    from kvserve.server.generation.context import refuse_by_length
    from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

    huge = ChatCompletionRequest(messages=[{"role": "user", "content": PII}], max_tokens=1)
    with pytest.raises(ContextLengthExceeded, match="at least"):
        refuse_by_length(tokenizer, huge, 512)
    with pytest.raises(ContextLengthExceeded, match="at least"):
        refuse_by_length(tokenizer, CompletionRequest(prompt=["hi", PII], max_tokens=1), 512)
    old_turn = ChatCompletionRequest(truncate="oldest", max_tokens=16, messages=[
        {"role": "user", "content": PII}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "hi"}])
    refuse_by_length(tokenizer, old_turn, 512)                         # truncation may still fit it
    refuse_by_length(tokenizer, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), 512)
