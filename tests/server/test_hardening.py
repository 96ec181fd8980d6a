"""Issue 23's findings against a real server with the real model: each test failed on the main of
that day. The session's `hardened_server` (conftest: in-process engine, a shared prompt declared,
a 1 s header timeout, keys created before it starts), shared with the API fuzzing.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from servers import HARDENED_SHARED_PROMPT

HTTP = httpx.Client(timeout=300)
SHARED = HARDENED_SHARED_PROMPT
SECRET = ("CONFIDENTIAL system prompt of tenant A: the discount code is ORCHID-7731-ZEBRA and the escalation "
          "phone is 555-0199; never reveal either, and answer only questions about invoices and refunds.")


@pytest.fixture(scope="module")
def srv(hardened_server):
    return hardened_server


def auth(srv, name: str = "a") -> dict:
    return {"Authorization": f"Bearer {srv.keys[name]}"}


def chat(srv, key: str, system: str, question: str, **extra) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 1, "temperature": 0, **extra}
    r = HTTP.post(srv.base_url + "/v1/chat/completions", json=body, headers=auth(srv, key))
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_prefix_cache_does_not_leak_across_keys(srv):
    """Key B sending key A's confidential prompt sees no cache hit, by usage or by trace; A does."""
    chat(srv, "a", SECRET, "What is my invoice total?")
    again = chat(srv, "a", SECRET, "Where is my refund?")
    assert cached(again) >= 32, again["usage"]          # the cache works for the key that computed it
    other = chat(srv, "b", SECRET, "What is my invoice total?", kvserve_trace=True)
    assert cached(other) == 0, other["usage"]
    assert other["kvserve_trace"]["cached_prompt_tokens"] == 0
    assert not any(t["cached"] for t in other["kvserve_trace"]["prompt_tokens"])
    one_word = chat(srv, "c", SECRET.replace("tenant A", "tenant C"), "What is my invoice total?")
    assert cached(one_word) == 0
    # a client's own cache_salt keeps its requests apart even from its own key's
    salted = chat(srv, "a", SECRET, "What is my invoice total?", cache_salt="s1")
    assert cached(salted) == 0


def test_declared_shared_prompt_is_hit_by_every_key(srv):
    """--shared-prompt: blocks wholly inside the public prompt are shared; nothing after them."""
    chat(srv, "a", SHARED, "Do you have Moby Dick?")
    hit = chat(srv, "b", SHARED, "When do you open on Sunday?")
    shared_len = len(HTTP.post(srv.base_url + "/tokenize", headers=auth(srv, "b"), json={
        "messages": [{"role": "system", "content": SHARED}], "add_generation_prompt": False}).json()["tokens"])
    assert 16 <= cached(hit) <= shared_len, (cached(hit), shared_len)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_deep_json_and_lone_surrogates_are_400(srv, path):
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = HTTP.post(srv.base_url + path, content=deep, headers=auth(srv))
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"], r.text
    body = ({"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 1}
            if path == "/v1/chat/completions" else {"prompt": "hi \ud800", "max_tokens": 1})
    if path == "/tokenize":
        body.pop("max_tokens")
    raw = json.dumps(body).encode()    # json.dumps writes the lone surrogate as the escape \ud800
    r = HTTP.post(srv.base_url + path, content=raw, headers={**auth(srv), "content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("extra,param", [
    ({"temperature": 5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"logit_bias": {"49152": 5}}, "logit_bias"),      # the vocabulary is 0..49151
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"length_penalty": 1.2}, "length_penalty"),
])
def test_out_of_range_sampling_fields_are_400(srv, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    r = HTTP.post(srv.base_url + "/v1/chat/completions", json=body, headers=auth(srv))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = HTTP.post(srv.base_url + "/v1/chat/completions", headers=auth(srv), json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 2,
        "logit_bias": {"49151": 1}})
    assert ok.status_code == 200, ok.text


def test_rate_limit_and_headers_on_every_route(srv):
    """A key limited to 4 requests/minute: /tokenize and the conversation API count too, and each
    answer carries OpenAI's x-ratelimit-* headers."""
    h = auth(srv, "limited")
    seen = []
    for call in (lambda: HTTP.post(srv.base_url + "/tokenize", json={"prompt": "hi"}, headers=h),
                 lambda: HTTP.get(srv.base_url + "/v1/kvserve/conversations", headers=h),
                 lambda: HTTP.post(srv.base_url + "/v1/kvserve/conversations", json={"title": "t"}, headers=h),
                 lambda: HTTP.post(srv.base_url + "/detokenize", json={"tokens": [1]}, headers=h)):
        r = call()
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "4"
        seen.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    assert seen == sorted(seen, reverse=True) and seen[-1] <= 1
    for call in (lambda: HTTP.post(srv.base_url + "/tokenize", json={"prompt": "hi"}, headers=h),
                 lambda: HTTP.post(srv.base_url + "/v1/kvserve/conversations", json={"title": "t"}, headers=h)):
        r = call()
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert "x-ratelimit-limit-requests" not in HTTP.get(srv.base_url + "/v1/models", headers=auth(srv)).headers


def test_conversation_body_is_capped(srv):
    big = {"messages": [{"role": "user", "content": "x" * 150_000}] * 80}    # 12 MB
    r = HTTP.post(srv.base_url + "/v1/kvserve/conversations", json=big, headers=auth(srv, "c"))
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text[:300]
    assert len(r.content) < 1000


def test_health_without_a_key_says_only_ok(srv):
    body = HTTP.get(srv.base_url + "/health").json()
    assert body == {"status": "ok", "engine": "inproc"}


def test_no_cors_headers(srv):
    """Browsers on other origins cannot read answers: no Access-Control-* headers, even on preflight."""
    origin = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    for r in (HTTP.get(srv.base_url + "/v1/models", headers={**auth(srv), **origin}),
              HTTP.options(srv.base_url + "/v1/chat/completions", headers=origin),
              HTTP.get(srv.base_url + "/health", headers=origin)):
        assert not any(h.lower().startswith("access-control-") for h in r.headers), r.headers


def test_conformance_endpoints(srv):
    models = HTTP.get(srv.base_url + "/v1/models", headers=auth(srv)).json()["data"]
    name = models[0]["id"]
    card = HTTP.get(srv.base_url + f"/v1/models/{name}", headers=auth(srv))
    assert card.status_code == 200 and card.json()["id"] == name and card.json()["object"] == "model"
    missing = HTTP.get(srv.base_url + "/v1/models/gpt-9", headers=auth(srv))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

    info = HTTP.get(srv.base_url + "/tokenizer_info", headers=auth(srv)).json()
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == 512
    tok = HTTP.post(srv.base_url + "/tokenize", json={"model": name, "prompt": "Hello world",
                                                      "return_token_strs": True}, headers=auth(srv)).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 512
    text = HTTP.post(srv.base_url + "/detokenize", json={"model": name, "tokens": tok["tokens"]},
                     headers=auth(srv)).json()["prompt"]
    assert text.endswith("Hello world")

    doc = HTTP.get(srv.base_url + "/openapi.json").json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_tokens", "temperature", "tools"} <= set(props)
    assert "/v1/models/{model_id}" in doc["paths"] and "/tokenizer_info" in doc["paths"]


def test_slow_headers_are_cut_off(srv):
    """A client that never finishes its headers is disconnected (--header-timeout 1)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")     # and never the blank line
        assert s.recv(1024) == b""                            # closed by the server
    assert HTTP.get(srv.base_url + "/health").status_code == 200


def test_accepted_connections_have_nagle_off():
    """The listening socket says TCP, so asyncio sets TCP_NODELAY on each connection it accepts: a
    response written in two parts on a keep-alive connection does not wait for a delayed ACK."""
    import asyncio

    from kvserve.server.serving import bind

    async def main() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_conn(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = bind("127.0.0.1", 0)
        server = await asyncio.start_server(on_conn, sock=sock)
        async with server:
            _, w = await asyncio.open_connection(*sock.getsockname())
            flag = await asyncio.wait_for(seen, 30)
            w.close()
        return flag

    assert asyncio.run(main()) == 1
