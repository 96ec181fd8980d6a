"""/v1/rerank with the `cohere` client (ClientV2 posts to /v2/rerank) and plain HTTP, and /v1/score
in vLLM's shape, over the server's sentence encoder; both charged to the key like embeddings."""

from __future__ import annotations

import cohere
import httpx
import pytest
from client_api_server import NO_CLIENT_WARNINGS, no_client_warnings  # noqa: F401 (an autouse fixture)
from servers import InProcessServer

from kvserve.server.settings import ServerSettings
from kvserve.server.stores.keys import KeyStore

DOCS = ["Paris is the capital of France.", "Bananas are rich in potassium.", "The Eiffel Tower is in Paris."]
ENCODER = "all-minilm-l6-v2"

pytestmark = NO_CLIENT_WARNINGS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("rerank")
    store = KeyStore(data_dir / "kvserve.db")
    keys = {"a": store.create("reader"), "tiny": store.create("tiny", tpm=30)}
    store.close()
    with InProcessServer(ServerSettings(load_model=False, data_dir=data_dir)) as srv:
        srv.keys = keys
        yield srv


def post(server, path: str, body: dict, who: str = "a") -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers={"Authorization": f"Bearer {server.keys[who]}"},
                      timeout=120)


def test_cohere_client_reranks(server):
    co = cohere.ClientV2(api_key=server.keys["a"], base_url=server.base_url)
    r = co.rerank(model=ENCODER, query="What is the capital of France?", documents=DOCS, top_n=2)
    assert r.results[0].index == 0 and len(r.results) == 2
    assert r.results[0].relevance_score >= r.results[1].relevance_score


def test_rerank_shape_and_options(server):
    body = {"query": "capital of France", "documents": [DOCS[1], {"text": DOCS[0]}], "model": ENCODER}
    r = post(server, "/v1/rerank", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [x["index"] for x in out["results"]] == [1, 0]
    assert out["results"][0]["document"] == {"text": DOCS[0]} and out["usage"]["total_tokens"] > 0
    r = post(server, "/rerank", {**body, "return_documents": False, "top_n": 1})
    assert r.json()["results"] == [{"index": 1, "relevance_score": out["results"][0]["relevance_score"]}]
    for bad, param in (({"documents": []}, "documents"), ({"model": "gpt-4"}, "model"), ({"top_n": 0}, "top_n"),
                       ({"documents": [""]}, "documents"), ({"rank_fields": ["x"]}, "rank_fields")):
        r = post(server, "/v1/rerank", {**body, **bad})
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_score_one_to_many_and_pairs(server):
    r = post(server, "/v1/score", {"model": ENCODER, "text_1": "capital of France", "text_2": DOCS})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and [d["index"] for d in out["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" for d in out["data"])
    scores = [d["score"] for d in out["data"]]
    assert scores[0] > scores[1] and out["usage"]["prompt_tokens"] > 0
    pairs = post(server, "/v1/score", {"text_1": ["capital of France", "fruit"], "text_2": [DOCS[0], DOCS[1]]}).json()
    assert abs(pairs["data"][0]["score"] - scores[0]) < 1e-4
    one = post(server, "/v1/score", {"text_1": "capital of France", "text_2": DOCS[0]}).json()
    assert len(one["data"]) == 1
    r = post(server, "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"


def test_charged_to_the_key(server):
    before = _prompt_tokens(server, "reader")
    tokens = post(server, "/v1/score", {"text_1": "capital of France", "text_2": DOCS}).json()["usage"]["total_tokens"]
    assert _prompt_tokens(server, "reader") == before + tokens
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        before = _prompt_tokens(server, "reader")
        tokens = post(server, path, {"query": "capital of France", "documents": DOCS}).json()["usage"]["total_tokens"]
        assert tokens > 0 and _prompt_tokens(server, "reader") == before + tokens, path
    r = post(server, "/v1/rerank", {"query": "q" * 40, "documents": DOCS}, who="tiny")   # over its 30 tokens/minute
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert httpx.post(server.base_url + "/v1/score", json={"text_1": "a", "text_2": "b"}).status_code == 401


def _prompt_tokens(server, name: str) -> int:
    return sum(u["prompt_tokens"] for u in server.state.keystore.usage(name))
