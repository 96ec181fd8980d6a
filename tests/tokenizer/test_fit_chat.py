"""`truncate: "oldest"`: the same messages dropped as one at a time, in O(log M) renders."""

from __future__ import annotations

import random

import pytest

from kvserve.tokenizer.chat_template import FittedChat, fit_chat


class CountingTokenizer:
    """Renders `role: content` lines; a token is a character. Counts renders and encodes."""

    def __init__(self):
        self.renders = 0
        self.encoded_chars = 0

    def apply_chat_template(self, msgs, add_generation_prompt=True, tools=None):
        self.renders += 1
        return "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + ("assistant: " if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        self.encoded_chars += len(text)
        return list(range(len(text)))


def one_at_a_time(tokenizer, messages, budget, drop_oldest=True, suffix=""):
    """The loop fit_chat replaced: drop the oldest non-system message and render again."""
    msgs = list(messages)

    def render():
        text = tokenizer.apply_chat_template(msgs) + suffix
        return text, tokenizer.encode(text)

    text, ids = render()
    dropped = 0
    while len(ids) > budget and drop_oldest:
        victim = next((i for i, m in enumerate(msgs[:-1]) if m["role"] != "system"), None)
        if victim is None:
            break
        del msgs[victim]
        dropped += 1
        text, ids = render()
    return FittedChat(text, ids, dropped, len(ids) <= budget)


@pytest.mark.parametrize("seed", range(200))
def test_same_result_as_dropping_one_at_a_time(seed):
    rng = random.Random(seed)
    roles = ["system", "user", "assistant", "tool"]
    msgs = [{"role": rng.choice(roles), "content": "x" * rng.randint(0, 30)} for _ in range(rng.randint(1, 25))]
    budget = rng.randint(5, 400)
    drop = rng.random() < 0.8
    got = fit_chat(CountingTokenizer(), msgs, budget, drop_oldest=drop, suffix="<s>")
    assert got == one_at_a_time(CountingTokenizer(), msgs, budget, drop_oldest=drop, suffix="<s>")


def test_dropping_most_of_256_messages_takes_a_logarithmic_number_of_renders():
    msgs = [{"role": "system", "content": "be brief"}]
    msgs += [{"role": ("user", "assistant")[i % 2], "content": "y" * 1000} for i in range(255)]
    tok = CountingTokenizer()
    got = fit_chat(tok, msgs, budget=10_000)
    assert got.fits and got.dropped_messages == 246
    assert tok.renders <= 2 + 8            # 0, all, then bisection over 254 droppable messages
    assert tok.encoded_chars <= 10 * len(tok.apply_chat_template(msgs))
