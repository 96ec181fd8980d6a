"""Suffix decoding through a real server (issue 63): one cache scope's answers become its later
requests' drafts (`draft_source: "other"` in the trace), and never another scope's. The scopes are
the prefix cache's: here two clients' `cache_salt`s on a server without auth (with keys, each key's
salt; docs/api.md), and two API keys on a server with keys. Greedy answers are the same in every
scope, drafted or not."""

from __future__ import annotations

import httpx
import pytest

QUESTION = "Give a JSON plan with keys goal and steps to water the plants in the office."


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_server):
    return model_server(tmp_path_factory.mktemp("suffix"), "--speculative", "suffix", "--num-speculative-tokens", "6")


def ask(url: str, salt: str | None, key: str | None = None) -> tuple[str, list[dict]]:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0, "max_tokens": 48, "kvserve_trace": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json=body,
                   headers={"Authorization": f"Bearer {key}"} if key else None)
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


def test_two_keys_never_draft_from_each_other(tmp_path, model_server):
    from kvserve.server.stores.keys import KeyStore

    store = KeyStore(tmp_path / "kvserve.db")
    keys = {n: store.create(n) for n in ("alice", "bob")}
    store.close()
    srv = model_server(tmp_path, "--speculative", "suffix", "--num-speculative-tokens", "6")
    first, toks = ask(srv.base_url, None, keys["alice"])
    again, toks = ask(srv.base_url, None, keys["alice"])
    assert again == first and sum(t.get("draft_source") == "other" for t in toks) >= 10, toks
    other, toks = ask(srv.base_url, None, keys["bob"])      # bob's scope holds none of alice's answers
    assert other == first
    assert not any(t.get("draft_source") == "other" for t in toks), [t for t in toks if t["drafted"]]
