"""Several models in one real server (`--models-config`: the default SmolLM2 as "smol" and a tiny
random GGUF as "tiny", each with its own engine, KV budget and price), the "auto" router, the
semantic cache over HTTP, and /v1/embeddings (float, base64, batch, errors)."""

from __future__ import annotations

import base64
import json
import re
import struct
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from ggufmaker import make_tiny_llama_gguf


@pytest.fixture(scope="module")
def srv(model_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tiny = make_tiny_llama_gguf(root / "tiny.gguf", ctx=256)
    config = root / "models.json"
    config.write_text(json.dumps({
        "models": [{"name": "smol", "path": "smollm2-135m-instruct", "kv_cache_memory": "96MiB",
                    "cost_per_1k_tokens": 2.0},
                   {"name": "tiny", "path": str(tiny), "kv_cache_memory": "16MiB", "cost_per_1k_tokens": 0.5}],
        "router": {"name": "auto", "levels": {"tiny": 0, "smol": 1}}}))
    return model_server(root, "--models-config", str(config), "--semantic-cache", "on")


def chat(srv, content: str, model: str | None = None, **kw) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, **kw}
    if model is not None:
        body["model"] = model
    return httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=120)


def test_models_listed_and_resolved(srv):
    ids = {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models").json()["data"]}
    assert {"smol", "tiny", "auto", "all-minilm-l6-v2"} <= set(ids)
    assert ids["tiny"]["max_model_len"] == 256 and ids["smol"]["max_model_len"] > 256
    assert ids["auto"]["routes_to"] == ["tiny", "smol"]           # cheapest first
    assert httpx.get(srv.base_url + "/v1/models/tiny").json()["id"] == "tiny"
    r = chat(srv, "Say hi", "tiny", cache=False)
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    assert r.json()["usage"]["kvserve_cost"] == pytest.approx(r.json()["usage"]["total_tokens"] * 0.5 / 1000)
    assert chat(srv, "Say hi", cache=False).json()["model"] == "smol"      # no model: the first one
    r = chat(srv, "Say hi", "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'smol', 'tiny'" in r.json()["error"]["message"]
    assert httpx.get(srv.base_url + "/v1/models/nope").status_code == 404


def test_router_sends_easy_to_cheap_and_hard_to_strong(srv):
    easy = chat(srv, "Hi, how are you?", "auto", cache=False, kvserve_trace=True)
    hard = chat(srv, "Write a thread pool in Rust with tests and explain every design choice.", "auto",
                cache=False, kvserve_trace=True)
    assert easy.json()["model"] == "tiny" and hard.json()["model"] == "smol"
    route = hard.json()["kvserve_trace"]["router"]
    assert route["reason"] == "classifier" and route["level"] == 1 and route["router_ms"] >= 0
    assert route["layers"] == 2     # the router's feature: the encoder's first two layers
    metrics = httpx.get(srv.base_url + "/metrics").text
    rows = dict(re.findall(r'^kvserve:router_decisions_total\{.*model_name="(\w+)".*\} (\S+)$', metrics, re.MULTILINE))
    assert float(rows["tiny"]) >= 1 and float(rows["smol"]) >= 1
    assert 'kvserve:request_success_total{finished_reason="length",model_name="tiny"}' in metrics
    for name in ("tiny", "smol"):      # each model's own engine, in the engine gauges and counters
        assert re.search(rf'^kvserve:generation_tokens_total{{model_name="{name}"}} [1-9]', metrics, re.MULTILINE)


def test_semantic_cache_over_http(srv):
    first = chat(srv, "What is the capital of Italy?", "smol")
    assert first.status_code == 200 and "x-kvserve-cache" not in first.headers
    # a candidate is verified by the model: the answer is the model's own for this wording
    answer = chat(srv, "Which city is the capital of Italy?", "smol", cache=False).json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=60, json={
            "model": "smol", "messages": [{"role": "user", "content": "Which city is the capital of Italy?"}],
            "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "kvserve_trace": True}) as r:
        assert r.headers["x-kvserve-cache"] == "semantic"
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(e["kvserve_cache"] == "semantic" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == answer
    assert events[-2]["kvserve_trace"]["semantic_cache"]["matched_query"] == "What is the capital of Italy?"
    assert events[-2]["kvserve_trace"]["semantic_cache"]["verification"]["draft_tokens"] > 0
    for miss in (chat(srv, "What is the capital of Greece?", "smol"),            # another entity
                 chat(srv, "What is the capital of Italy?", "smol", cache=False),  # opted out
                 chat(srv, "What is the capital of Italy?", "tiny"),             # another model
                 chat(srv, "What is the capital of Italy?", "smol", max_tokens=9),  # another answer-changing param
                 chat(srv, "Write a poem about the capital of Italy", "smol")):  # creative
        assert miss.status_code == 200 and "x-kvserve-cache" not in miss.headers
    metrics = httpx.get(srv.base_url + "/metrics").text
    assert re.search(r'kvserve:semantic_cache_hits_total\{model_name="smol"\} [1-9]', metrics)
    assert 'result="bypass_creative"' in metrics and 'result="bypass_opt_out"' in metrics
    assert "kvserve:embedding_latency_seconds_count" in metrics


def _embed_counts(srv) -> dict[str, float]:
    metrics = httpx.get(srv.base_url + "/metrics").text
    return {u: float(n) for u, n in re.findall(r'^kvserve:embedding_latency_seconds_count\{use="(\w+)"\} (\S+)$',
                                               metrics, re.MULTILINE)}


def test_routed_request_embeds_its_query_once(srv):
    before = _embed_counts(srv)
    r = chat(srv, "What is the population of Kenya?", "auto", kvserve_trace=True)
    assert r.status_code == 200 and r.json()["kvserve_trace"]["router"]["reason"] == "classifier"
    after = _embed_counts(srv)
    # one forward, by the router; the cache looked the same vector up (and stored it)
    assert after.get("router", 0) - before.get("router", 0) == 1
    assert after.get("semantic_cache", 0) == before.get("semantic_cache", 0)
    # cache bypassed: the router's forward stops at its depth, still one forward
    before = _embed_counts(srv)
    off = chat(srv, "What is the population of Chile?", "auto", cache=False, kvserve_trace=True)
    assert off.status_code == 200 and off.json()["kvserve_trace"]["router"]["layers"] == 2
    assert _embed_counts(srv).get("router", 0) - before.get("router", 0) == 1
    again = chat(srv, "How many people live in Kenya?", r.json()["model"], kvserve_trace=True)
    assert again.headers.get("x-kvserve-cache") == "semantic", again.json().get("kvserve_trace")
    own = chat(srv, "How many people live in Kenya?", r.json()["model"], cache=False)
    assert again.json()["choices"][0]["message"]["content"] == own.json()["choices"][0]["message"]["content"]


def test_completions_cached_like_chat(srv):
    url = srv.base_url + "/v1/completions"

    def complete(prompt, **kw):
        return httpx.post(url, json={"model": "smol", "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw},
                          timeout=120)
    first = complete("What is the capital of Norway?")
    assert first.status_code == 200 and "x-kvserve-cache" not in first.headers
    hit = complete("Which city is the capital of Norway?", kvserve_trace=True)
    body = hit.json()
    assert hit.headers["x-kvserve-cache"] == "semantic" and body["object"] == "text_completion"
    own = complete("Which city is the capital of Norway?", cache=False).json()["choices"][0]["text"]
    assert body["choices"][0]["text"] == own and body["kvserve_cache"] == "semantic"   # the model's, verified
    assert body["kvserve_trace"]["semantic_cache"]["matched_query"] == "What is the capital of Norway?"
    with httpx.stream("POST", url, timeout=60, json={"model": "smol", "prompt": "Tell me the capital of Norway.",
                                                     "max_tokens": 8, "temperature": 0, "stream": True}) as r:
        assert r.headers["x-kvserve-cache"] == "semantic"
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(e["object"] == "text_completion" for e in events)
    own = complete("Tell me the capital of Norway.", cache=False).json()["choices"][0]["text"]
    assert "".join(e["choices"][0]["text"] for e in events) == own
    for miss in (chat(srv, "What is the capital of Norway?", "smol"),          # chat and completions apart
                 complete("What is the capital of Norway?", echo=True),        # echo changes the answer
                 complete(["What is the capital of Norway?", "And of Chile?"]),  # not one prompt
                 complete("What is the capital of Norway?", cache=False)):
        assert miss.status_code == 200 and "x-kvserve-cache" not in miss.headers


def test_embeddings_endpoint(srv):
    url = srv.base_url + "/v1/embeddings"
    r = httpx.post(url, json={"input": ["The cat sat.", "A dog ran."], "model": "all-minilm-l6-v2"}, timeout=60)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "list" and body["model"] == "all-minilm-l6-v2"
    vecs = [d["embedding"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1] and len(vecs[0]) == 384
    assert abs(sum(x * x for x in vecs[0]) - 1) < 1e-4 and body["usage"]["prompt_tokens"] > 4
    b64 = httpx.post(url, json={"input": "The cat sat.", "encoding_format": "base64"}, timeout=60).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert max(abs(a - b) for a, b in zip(struct.unpack("<384f", raw), vecs[0])) < 1e-6
    for bad, code in (({"input": []}, 400), ({"input": [1, 2, 3]}, 400), ({"input": "x", "model": "smol"}, 404),
                      ({"input": "x", "dimensions": 10}, 400), ({"input": "x", "nope": 1}, 400), ({}, 400)):
        r = httpx.post(url, json=bad, timeout=60)
        assert r.status_code == code and r.json()["error"]["message"], bad


def test_semantic_cache_off_and_cli_errors(model_server, tmp_path):
    from ggufmaker import make_tiny_llama_gguf as make

    tiny = make(tmp_path / "t.gguf")
    srv = model_server(tmp_path, "--model", f"t={tiny}", "--semantic-cache", "off")
    assert next(m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]) == "t"
    for _ in range(2):
        r = chat(srv, "What is 2+2?")
        assert r.status_code == 200 and r.json()["model"] == "t" and "x-kvserve-cache" not in r.headers
    import subprocess

    bad = subprocess.run([sys.executable, "-m", "kvserve.server", "serve", "--model", "=x", "--port", "1"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "NAME=PATH" in bad.stderr
    config = tmp_path / "bad.json"
    config.write_text('{"models": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}')
    bad = subprocess.run([sys.executable, "-m", "kvserve.server", "serve", "--models-config", str(config),
                          "--port", "1", "--data-dir", str(tmp_path)], check=False, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0 and "share a name" in bad.stderr
