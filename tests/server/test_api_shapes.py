"""Each API's error shape and the `x-api-key` header, on a gateway without a model (fast): the
mapping of error_shapes.py, then the gateway's own answers (503 while loading, 404, 400,
401) in OpenAI's, Anthropic's and Ollama's shapes over real HTTP."""

from __future__ import annotations

import httpx
import pytest
from servers import InProcessServer

from kvserve.server.error_shapes import api_of, shape_error
from kvserve.server.settings import ServerSettings
from kvserve.server.stores.keys import KeyStore

OPENAI = {"error": {"message": "m", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}
MESSAGES = {"model": "", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def test_shape_by_path():
    assert [api_of(p) for p in ("/v1/messages", "/v1/messages/count_tokens", "/api/chat", "/v1/chat/completions",
                                "/v1/messages/x", "/apix")] == ["anthropic", "anthropic", "ollama", "openai",
                                                                "openai", "openai"]
    assert shape_error("/v1/chat/completions", 429, OPENAI) == (429, OPENAI)
    assert shape_error("/api/chat", 429, OPENAI) == (429, {"error": "m"})
    assert shape_error("/v1/messages", 429, OPENAI) == (429, {"type": "error", "error": {
        "type": "rate_limit_error", "message": "m"}})
    assert shape_error("/v1/messages", 503, OPENAI)[0] == 529
    assert shape_error("/v1/messages", 503, OPENAI)[1]["error"]["type"] == "overloaded_error"
    assert shape_error("/v1/messages", 500, OPENAI)[1]["error"]["type"] == "api_error"


def test_gateway_answers_in_each_shape(gateway):
    url = gateway.base_url
    # no model loaded ("" is the default model): 503 on the other APIs
    r = httpx.post(url + "/v1/messages", json=MESSAGES, timeout=30)
    assert r.status_code == 529 and r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"
    assert r.headers["retry-after"]
    r = httpx.post(url + "/api/chat", json={"model": MESSAGES["model"], "messages": []}, timeout=30)
    assert r.status_code == 503 and set(r.json()) == {"error"}
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"]
    r = httpx.post(url + "/v1/messages", json={"model": "m", "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"] == {"type": "invalid_request_error",
                                                          "message": r.json()["error"]["message"]}
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.get(url + "/api/nowhere", timeout=30)
    assert r.status_code == 404 and set(r.json()) == {"error"}
    doc = httpx.get(url + "/openapi.json", timeout=30).json()
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/api/chat", "/api/generate", "/api/embed",
                 "/api/tags", "/api/show", "/api/ps", "/api/version"):
        assert path in doc["paths"], path
    assert "application/x-ndjson" in doc["paths"]["/api/chat"]["post"]["responses"]["200"]["content"]
    assert doc["paths"]["/v1/messages"]["post"]["responses"]["default"]["content"]["application/json"][
        "schema"]["$ref"].endswith("AnthropicErrorResponse")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("keyed")
    store = KeyStore(data_dir / "kvserve.db")
    key = store.create("k")
    store.close()
    with InProcessServer(ServerSettings(load_model=False, data_dir=data_dir)) as srv:
        srv.key = key
        yield srv


def test_x_api_key_authenticates_every_route(keyed):
    url = keyed.base_url
    for headers in ({"x-api-key": keyed.key}, {"Authorization": f"Bearer {keyed.key}"}):
        assert httpx.get(url + "/version", headers=headers, timeout=30).status_code == 200
    wrong = httpx.get(url + "/version", headers={"x-api-key": keyed.key + "x"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(url + "/v1/messages", json=MESSAGES, headers={"x-api-key": "nope"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(url + "/api/tags", timeout=30)
    assert r.status_code == 401 and set(r.json()) == {"error"}
