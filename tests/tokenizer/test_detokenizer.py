"""IncrementalDetokenizer on the real SmolLM2 tokenizer: UTF-8 safe deltas, stop strings that
span tokens, held-back text, special tokens."""

from __future__ import annotations

import gguf
import pytest

from kvserve.model.registry import resolve
from kvserve.tokenizer import Tokenizer
from kvserve.tokenizer.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over 1234 lazy dogs.",
    "Héllo wörld: ça va? Grüße aus Köln.",
    "世界你好，今天天气很好。日本語のテキストも大丈夫です。한국어 문장입니다.",
    "Emoji: 🤖👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ✨🎉.",
    "Привет, мир! مرحبا بالعالم नमस्ते दुनिया שלום עולם Γειά σου κόσμε",
    "Combining: e\u0301 a\u0308 \u0928\u093f and math ∀x∈ℝ: x²≥0 — “quotes” … ok",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(resolve(None).path))


@pytest.fixture(scope="module")
def prompt(tok) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": "Say something."}], tokenize=True)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed ids in chunks until a stop string matches; return every delta, the flush last."""
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(detok.add_tokens(ids[i:i + chunk]))
        if detok.stopped:
            break
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_round_trip_is_exact_and_never_emits_a_partial_character(tok, prompt, text, chunk):
    ids = tok.encode(text, add_special_tokens=False)
    # The test is only meaningful if some characters really are split across tokens.
    if any(ord(c) > 0x7FF for c in text):
        assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids, chunk)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text == detok.emitted_text
    assert detok.stop_reason is None


def test_a_broken_utf8_tail_is_released_at_flush(tok, prompt):
    ids = tok.encode("ok 🤖", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    held = "".join(detok.add_tokens([i]) for i in ids[:-1])  # the emoji's last byte never arrives
    assert held == "ok"  # SmolLM2 merges the space with the emoji's first byte
    assert detok.flush() == tok.decode(ids[:-1])[len("ok"):]
    assert "\ufffd" in detok.text


def test_stop_string_spanning_tokens_cuts_exactly_there(tok, prompt):
    text = "The answer is 42, final answer. More text follows here."
    ids = tok.encode(text, add_special_tokens=False)
    stop = "is 42,"
    # The stop string spans several tokens (digits are single tokens in SmolLM2).
    assert not any(stop in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, prompt, stop=[stop])
    deltas = []
    for n, i in enumerate(ids, 1):
        deltas.append(detok.add_tokens([i]))
        if detok.stopped:
            break
    # It stopped on the very token that completes the stop string.
    assert stop in tok.decode(ids[:n]) and stop not in tok.decode(ids[:n - 1])
    assert detok.stop_reason == stop
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text == "The answer "
    assert detok.add_tokens(ids[n:]) == "" and detok.text == "The answer "


def test_include_stop_str_in_output(tok, prompt):
    ids = tok.encode("The answer is 42, final answer.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, stop="is 42", include_stop_str_in_output=True)
    assert "".join(stream(detok, ids)) == detok.text == "The answer is 42"
    assert detok.stop_reason == "is 42"


def test_multiple_stop_strings_first_to_complete_wins(tok, prompt):
    ids = tok.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    for chunk in (1, 2, len(ids)):
        detok = IncrementalDetokenizer(tok, prompt, stop=["delta", "gamma", "zeta", "beta gamma delta"])
        assert "".join(stream(detok, ids, chunk)) == "alpha beta "
        assert detok.stop_reason == "gamma"


def test_streamed_deltas_never_contain_text_a_stop_later_swallows(tok, prompt):
    text = "Counting: 1, 2, 3, 4, 5. Then we say STOP now and nothing else."
    ids = tok.encode(text, add_special_tokens=False)
    stops = ["STOP now", "3, 4, 6", "say STOP"]  # "3, 4, 6" partially matches then fails
    detok = IncrementalDetokenizer(tok, prompt, stop=stops)
    emitted = ""
    final = "Counting: 1, 2, 3, 4, 5. Then we "
    for i in ids:
        emitted += detok.add_tokens([i])
        assert final.startswith(emitted)
        if detok.stopped:
            break
    # While "3, 4, " could still become "3, 4, 6", it was held back, then released.
    assert emitted + detok.flush() == final == detok.text
    assert detok.stop_reason == "say STOP"


def test_held_back_text_is_released_by_flush_when_no_stop_matches(tok, prompt):
    ids = tok.encode("We end with 3, 4, ", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, stop=["3, 4, 6"])
    streamed = "".join(detok.add_tokens([i]) for i in ids)
    assert streamed == "We end with "
    assert detok.flush() == "3, 4, "
    assert detok.emitted_text == detok.text == "We end with 3, 4, "


def test_stop_string_inside_a_multibyte_character_run(tok, prompt):
    text = "机器人 🤖 says 你好 then 🎉 party"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, stop=["你好"])
    deltas = stream(detok, ids)
    assert "".join(deltas) == "机器人 🤖 says "
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped_or_kept(tok, prompt):
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and im_end[0] in tok.all_special_ids
    ids = tok.encode("Hi there", add_special_tokens=False) + im_end
    skipped = IncrementalDetokenizer(tok, prompt)
    assert "".join(stream(skipped, ids)) == "Hi there"
    kept = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "Hi there<|im_end|>"


def test_first_token_after_the_prompt_keeps_its_leading_space(tok):
    prompt_ids = tok.encode("Complete this:", add_special_tokens=False)
    ids = tok.encode(" a sentence", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    assert "".join(stream(detok, ids)) == " a sentence"
    assert IncrementalDetokenizer(tok, []).add_tokens(ids) == " a sentence"


def test_a_stop_token_text_is_left_out_unless_asked(tok, prompt):
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    newline = tok.encode("\n", add_special_tokens=False)
    ids = tok.encode("Hi there", add_special_tokens=False)
    for end, keep in ((im_end, "<|im_end|>"), (newline, "\n")):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
        text = detok.add_tokens(ids) + detok.add_tokens(end, stop_terminated=True) + detok.flush()
        assert text == detok.text == "Hi there"
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False, include_stop_str_in_output=True)
        text = detok.add_tokens(ids) + detok.add_tokens(end, stop_terminated=True) + detok.flush()
        assert text == "Hi there" + keep
