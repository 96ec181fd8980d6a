"""The draft's prompts: built in (distinct, reproducible, of every kind) or written by the target
(usable requests), and never the bench's."""

from kvserve.bench.spec_latency import OPEN_PROMPTS
from kvserve.train.draft_prompts import WEIGHTS, _space, _usable, chat_prompts, self_prompts


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


def test_self_written_requests_are_filtered():
    assert _usable("Can you suggest a recipe for a quick vegetable soup?")
    assert not _usable("Hello there")                                        # too short to be a request
    assert not _usable("Adresar za obrazovanji kakome jako, ajnči i mišlički služednost")   # drifted script
    assert not _usable("Can you explain how a bicycle gear works?")           # a bench subject
    assert not _usable("I'd love a story about a robot that paints.")


def test_the_target_writes_distinct_usable_requests():
    from kvserve import LLM
    from kvserve.model.loader import load_model

    lm = load_model(None)
    llm = LLM(lm.model, tokenizer=lm.tokenizer, kv_cache_memory="64MiB")
    a = self_prompts(llm, lm.tokenizer, 6, seed=3)
    assert len(a) == len(set(a)) == 6
    assert all(_usable(p) for p in a)
    assert not any(p.startswith(("<|", "system", "user")) for p in a)        # the request, not the template
    assert a == self_prompts(llm, lm.tokenizer, 6, seed=3)
    assert a != self_prompts(llm, lm.tokenizer, 6, seed=4)


def test_the_self_written_share_is_checked():
    import pytest

    from kvserve.errors import InvalidRequest
    from kvserve.train.draft import DraftConfig

    with pytest.raises(InvalidRequest, match="self_prompt_share"):
        DraftConfig(out="x", self_prompt_share=1.5)
    DraftConfig(out="x", self_prompt_share=0.5)
