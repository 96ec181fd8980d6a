"""The draft's built-in prompts: distinct, reproducible, of every kind, and never the bench's."""

from kvserve.bench.spec_latency import OPEN_PROMPTS
from kvserve.train.draft_prompts import WEIGHTS, _space, chat_prompts


def test_prompts_are_distinct_and_reproducible():
    a = chat_prompts(3000, seed=1)
    assert len(a) == 3000 and len(set(a)) == 3000
    assert a == chat_prompts(3000, seed=1)
    assert a != chat_prompts(3000, seed=2)
    every = chat_prompts()
    assert len(every) == len(set(every)) > 9000      # the whole space, once each


def test_every_kind_is_drawn_and_none_dominates():
    kinds = {p[0] for p in _space()}
    assert kinds == set(WEIGHTS)
    first = chat_prompts(400)
    stories = sum(p.startswith("Write a short story about") for p in first)
    howtos = sum(p.startswith(("How do I", "How can I")) for p in first)
    assert 25 <= stories <= 100 and 5 <= howtos <= 60


def test_the_bench_prompts_and_subjects_are_not_trained_on():
    every = chat_prompts()
    assert not set(OPEN_PROMPTS) & set(every)
    for words in (("robot", "paint"), ("bicycle",), ("rainy Sunday",), ("working from home",)):
        assert not [p for p in every if all(w in p for w in words)], words
