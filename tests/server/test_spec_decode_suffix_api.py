"""Suffix decoding through a real server (issue 63): one cache scope's answers become its later
requests' drafts (`draft_source: "other"` in the trace), and never another scope's. The scopes are
the prefix cache's: here two clients' `cache_salt`s on a server without auth (with keys, each key's
salt; docs/api.md). Greedy answers are the same in every scope, drafted or not."""

from __future__ import annotations

import httpx
import pytest

QUESTION = "Give a JSON plan with keys goal and steps to water the plants in the office."


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_server):
    return model_server(tmp_path_factory.mktemp("suffix"), "--speculative", "suffix", "--num-speculative-tokens", "6")


def ask(url: str, salt: str) -> tuple[str, list[dict]]:
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0, "max_tokens": 48, "kvserve_trace": True, "cache_salt": salt})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["kvserve_trace"]["output_tokens"]


def test_drafts_from_earlier_answers_stay_in_their_scope(server):
    url = server.base_url
    first, toks = ask(url, "alice")
    assert not any(t.get("draft_source") == "other" for t in toks)
    again, toks = ask(url, "alice")
    assert again == first
    assert sum(t.get("draft_source") == "other" for t in toks) >= 10, toks
    other, toks = ask(url, "bob")                       # the same question from another scope
    assert other == first
    assert not any(t.get("draft_source") == "other" for t in toks), [t for t in toks if t["drafted"]]
