"""Suffix decoding across requests (issue 63, engine/spec_decode/suffix.py):

- the index stays inside its token budget when filled far past it (oldest requests' paths go,
  node counts stay consistent with a recount, and a fully evicted trie is empty);
- drafts never cross cache scopes: one salt's answers never become another salt's drafts;
- through the engine, greedy output is token for token the same with `suffix` and `ngram+suffix`,
  while drafts from earlier requests are accepted and marked as coming from "other".
"""

from __future__ import annotations

import random

import pytest

from kvserve.engine.request import Request
from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.suffix import SuffixDrafter, SuffixIndex
from kvserve.errors import InvalidRequest
from kvserve.sampling_params import SamplingParams

_seq = iter(range(1 << 30))


def req(prompt: list[int], out: list[int] = (), salt: str | None = None) -> Request:
    r = Request(f"r{next(_seq)}", list(prompt), SamplingParams(temperature=0), 0, cache_salt=salt)
    r.output_token_ids = list(out)
    return r


def recount(idx: SuffixIndex) -> int:
    n, stack = 0, list(idx.roots.values())
    while stack:
        node = stack.pop()
        for ch in (node.children or {}).values():
            assert 0 < ch.count <= max(node.count, ch.count)
            n += 1
            stack.append(ch)
    return n


def test_budget_holds_when_filled_past_it():
    rng = random.Random(0)
    idx = SuffixIndex(budget=600, depth=8)
    first = req([1, 2, 3], [rng.randrange(1000) for _ in range(40)])
    idx.sync(first)
    idx.finish(first, first.request_id)
    for i in range(200):                       # ~ 20x the budget, random and repeated material
        r = req([7, 8, 9, i % 5], [rng.randrange(50 if i % 2 else 1000) for _ in range(rng.randrange(10, 80))])
        for cut in range(5, len(r.output_token_ids) + 1, 17):      # live, a few tokens at a time
            part = req(r.prompt_token_ids, r.output_token_ids[:cut])
            part.request_id = r.request_id
            idx.sync(part)
            assert idx.num_tokens <= idx.budget
        idx.finish(r, r.request_id)
        assert idx.num_tokens <= idx.budget
        assert idx.num_nodes == recount(idx) <= idx.depth * idx.budget
    # the first request's unique output is gone from the trie
    _node, m = idx.match(idx.scope_of(first), first.output_token_ids[:6], 6)
    assert m < 6
    idx.budget = 0
    idx._evict()
    assert idx.num_tokens == 0 and idx.num_nodes == 0 and not idx.roots


def test_a_live_request_evicted_keeps_going():
    idx = SuffixIndex(budget=64, depth=4)
    r = req(list(range(10)))
    for n in range(0, 300, 7):
        r.output_token_ids = [(i * 7) % 31 for i in range(n)]
        idx.sync(r)
        assert idx.num_tokens <= 64 and idx.num_nodes == recount(idx)
    idx.finish(r, r.request_id)


def drafter(**kw) -> SuffixDrafter:
    return SuffixDrafter(k_max=8, budget=10_000, depth=24, threshold=0.3, lookup=None, **kw)


ANSWER = [500 + i for i in range(40)]


def test_drafts_come_from_earlier_answers_in_the_same_scope_only():
    d = drafter()
    for salt in ("key:a", "key:a"):
        done = req([1, 2, 3], ANSWER, salt)
        d.draft(done, 8, 0.0)
        d.finish(done, done.request_id)
    same = req([4, 5, 6], ANSWER[:10], "key:a")
    assert d.draft(same, 8, 0.0) == ANSWER[10:18]
    assert d.sources[same.request_id] == "other"
    for salt in ("key:b", None, "key:a\x00client:x"):
        other = req([4, 5, 6], ANSWER[:10], salt)
        assert d.draft(other, 8, 0.0) == [], salt
    # a request's own earlier output is a source too
    own = req([9, 9], ANSWER[:12] + [1, 2] + ANSWER[:5], "key:c")
    assert d.draft(own, 4, 0.0) == ANSWER[5:9]
    assert d.sources[own.request_id] == "request"


def test_the_break_even_bar_cuts_thin_evidence():
    d = drafter()
    done = req([1, 2, 3], ANSWER, "s")       # seen once: a probability of about one half per token
    d.draft(done, 8, 0.0)
    d.finish(done, done.request_id)
    r = req([7], ANSWER[:10], "s")
    assert 0 < len(d.draft(r, 8, 0.3)) < 8
    assert d.draft(req([7], ANSWER[:10], "s"), 8, 0.0) == ANSWER[10:18]


def test_config_forms():
    c = SpeculativeConfig.parse("ngram+suffix:2000", 6)
    assert (c.method, c.suffix_lookup, c.suffix_budget, c.num_speculative_tokens) == ("suffix", True, 2000, 6)
    assert SpeculativeConfig.parse("suffix").suffix_budget == 10_000
    for bad in ("suffix:lots", "suffix:3"):
        with pytest.raises(InvalidRequest):
            SpeculativeConfig.parse(bad)


TEMPLATES = ["Return a JSON plan (keys: goal, steps, tools) to {} for user {}.",
             "What are your opening hours? Asked by customer {} about store {}."]


@pytest.fixture(scope="module")
def loaded():
    from kvserve.model.loader import load_model
    return load_model(None)


@pytest.mark.parametrize("method", ["suffix", "ngram+suffix"])
def test_greedy_output_is_the_same_and_drafts_come_from_other_requests(loaded, method):
    from kvserve import LLM

    kw = {"tokenizer": loaded.tokenizer, "kv_cache_memory": "128MiB"}
    base = LLM(loaded.model, **kw)
    spec = LLM(loaded.model, speculative=method, num_speculative_tokens=6, **kw)
    tok = loaded.tokenizer
    p = SamplingParams(temperature=0, max_tokens=48)
    for i in range(4):
        for t in TEMPLATES:
            ids = tok.apply_chat_template([{"role": "user", "content": t.format(["book a trip", "file a bug"][i % 2],
                                                                                 f"u{i}")}], tokenize=True)
            a = base.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0].outputs[0]
            b = spec.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0].outputs[0]
            assert a.token_ids == b.token_ids
    st = spec.stats()
    assert st["spec_decode_num_accepted_tokens"] > 20, st
