"""The reasoning split (server/reasoning.py) on real strings: whole or in random pieces, the same
(reasoning, content)."""

from __future__ import annotations

import random

import pytest

from kvserve.server.stages.reasoning import ReasoningParser

CASES = [
    ("<think>\n2 + 2 is 4.\n</think>\n\nThe answer is 4.", "2 + 2 is 4.", "The answer is 4."),
    ("  <think>a<b</think>c", "a<b", "c"),
    ("No thinking here.", "", "No thinking here."),
    ("<thin", "", "<thin"),
    ("<think>cut off by max_tokens </thi", "cut off by max_tokens </thi", ""),
    ("<think></think>answer", "", "answer"),
    ("text <think>later</think>", "", "text <think>later</think>"),
    ("<think>x</think>\n\n", "x", ""),
]


def run(text: str, chunk: int | None, seed: int = 0) -> tuple[str, str]:
    p, r, c = ReasoningParser(), "", ""
    pieces = [text] if chunk is None else []
    if chunk is not None:
        rng, i = random.Random(seed), 0
        while i < len(text):
            k = rng.randint(1, chunk)
            pieces.append(text[i:i + k])
            i += k
    for piece in pieces:
        a, b = p.feed(piece)
        r, c = r + a, c + b
    a, b = p.finish()
    return r + a, c + b


@pytest.mark.parametrize("text, reasoning, content", CASES)
def test_split_whole_and_streamed(text, reasoning, content):
    assert run(text, None) == (reasoning, content)
    for seed in range(20):
        assert run(text, 4, seed) == (reasoning, content), seed
