"""The semantic cache on a real server with the default model (issue 47, issue 49's 5 and 8), in-process
and with --engine-process:

- over shared documents asked different questions, no request is answered with another
  question's answer (each answer is the model's own: what the same request gets with the cache off);
- a greedy hit is token for token what a miss gives, over many cached pairs (exact repeats,
  paraphrases, near misses), and an exact repeat is verified whole in one forward;
- paraphrases of short questions still find their entry (a candidate), and the trace says what
  matched, what the model kept of it and what that cost;
- `cache_salt` and `user` partition the cache: no hit across them, and no trace shows another
  partition's prompt;
- a sampled repeat keeps the stored answer by likelihood (`sampled_min_logprob`, the default): the
  kept prefix is exactly the stored tokens whose raw logprob (the first request's, same prompt)
  clears the threshold, whatever the draw.
"""

from __future__ import annotations

import httpx
import pytest

from kvserve.bench.semantic_heldout import DOCUMENTS, NEAR_MISSES, PARAPHRASES, doc_message
from kvserve.server.routing.semantic_cache import CacheOptions

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def srv(model_server, tmp_path_factory, engine_kind):
    return model_server(tmp_path_factory.mktemp("verify"), "--semantic-cache", "on", engine=engine_kind)


def ask(srv, content: str, **kw) -> tuple[httpx.Response, dict]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "kvserve_trace": True, **kw}
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r, r.json()


def tokens(body: dict) -> list[int]:
    return [t["id"] for t in body["kvserve_trace"]["output_tokens"]]


def test_shared_documents_never_get_another_questions_answer(srv):
    for doc, questions in DOCUMENTS[:2]:      # the two: a letter, a function
        for q in questions[:3]:
            _, got = ask(srv, doc_message(doc, q), cache_salt="docs")
            _, own = ask(srv, doc_message(doc, q), cache_salt="docs", cache=False)
            assert tokens(got) == tokens(own), (q, got["kvserve_trace"].get("semantic_cache"))
            sc = got["kvserve_trace"].get("semantic_cache")
            if sc is not None:        # a candidate from another question: what it matched is about this document
                assert sc["matched_query"] in questions and sc["verification"]["result"] != "verified"


# paraphrases of our own, beside the held-out set's (tests/server/test_semantic_cache.py: keys only)
OWN_PAIRS = [("How many hours are in a day?", "how many hours are there in a day"),
             ("How many minutes are in an hour?", "How many minutes are there in an hour?"),
             ("Who invented the telephone?", "Who was the inventor of the telephone?")]


def test_greedy_hit_is_token_for_token_a_miss(srv):
    pairs = [(a, a) for a, _ in PARAPHRASES[:2]] + PARAPHRASES[:6] + NEAR_MISSES[6:10] + OWN_PAIRS
    results = []
    for i, (first, second) in enumerate(pairs):
        salt = f"pair{i}"
        ask(srv, first, cache_salt=salt)
        r, got = ask(srv, second, cache_salt=salt)
        _, own = ask(srv, second, cache_salt=salt, cache=False)
        assert tokens(got) == tokens(own), (first, second)
        assert got["choices"][0]["message"]["content"] == own["choices"][0]["message"]["content"]
        sc = got["kvserve_trace"].get("semantic_cache")
        assert (r.headers.get("x-kvserve-cache") == "semantic") == (sc is not None)
        results.append(sc["verification"]["result"] if sc else None)
    assert results[:2] == ["verified"] * 2                 # exact repeats: the stored answer, whole
    hits = results[2:8] + results[12:]
    assert sum(h is not None for h in hits) >= 8, hits    # paraphrases still find their entry


def test_trace_of_a_verified_hit(srv):
    q = "What is the chemical symbol for silver?"
    ask(srv, q, cache_salt="trace")
    r, body = ask(srv, q, cache_salt="trace", stream=False)
    sc = body["kvserve_trace"]["semantic_cache"]
    assert r.headers["x-kvserve-cache"] == "semantic" and body["kvserve_cache"] == "semantic"
    assert sc["matched_query"] == q and sc["similarity"] > 0.99
    v, cost = sc["verification"], sc["cost"]
    assert v["result"] == "verified" and v["accepted_tokens"] == v["draft_tokens"] == len(tokens(body))
    assert cost["decoded_tokens"] == 0 and cost["draft_tokens_checked"] == v["draft_tokens"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0      # the prompt's blocks: prefix cache
    assert all(t["drafted"] for t in body["kvserve_trace"]["output_tokens"][1:-1])


def test_cache_salt_and_user_partition_and_traces_stay_inside(srv):
    secret = "What is the capital of Peru? My account number is 4417."
    ask(srv, secret, cache_salt="alice")
    for kw in ({"cache_salt": "bob"}, {"cache_salt": "alice", "user": "mallory"}):
        r, body = ask(srv, secret, **kw)
        assert "x-kvserve-cache" not in r.headers and "semantic_cache" not in body["kvserve_trace"], kw
        assert "4417" not in str(body["kvserve_trace"].get("semantic_cache"))
    r, body = ask(srv, secret, cache_salt="alice")
    assert r.headers.get("x-kvserve-cache") == "semantic"
    assert body["kvserve_trace"]["semantic_cache"]["matched_query"] == secret


def test_sampled_repeat_kept_by_likelihood(srv):
    threshold = CacheOptions().sampled_min_logprob
    assert threshold is not None
    checked = 0
    for i, q in enumerate(["Explain how a rainbow forms.", "Describe the water cycle.",
                           "Tell me about the history of Rome.", "How do airplanes fly?"]):
        kw = {"temperature": 0.7, "cache_salt": f"sampled{i}"}
        _, first = ask(srv, q, **kw)
        stored = first["kvserve_trace"]["output_tokens"]
        r, again = ask(srv, q, **kw)
        sc = again["kvserve_trace"].get("semantic_cache")
        if sc is None:      # not stored (seen once on a machine at load 20 with --engine-process): no check
            continue
        assert r.headers["x-kvserve-cache"] == "semantic" and sc["matched_query"] == q
        checked += 1
        drafts = stored[:min(len(stored), MAX_TOKENS - 1)]     # the last of max_tokens is the model's own
        want = next((j for j, t in enumerate(drafts) if t["logprob"] < threshold), len(drafts))
        got = again["kvserve_trace"]["output_tokens"]
        assert [t["id"] for t in got[:want]] == [t["id"] for t in stored[:want]], q
        assert sum(t["drafted"] for t in got) == want, (q, want, [t["logprob"] for t in stored])
    assert checked >= 2
