"""LoRA adapters over HTTP, on a real server with the default model: `serve --lora NAME=PATH`,
/v1/models with `parent`, a request choosing an adapter by "model", the admin key guarding
/v1/load_lora_adapter and /v1/unload_lora_adapter, 404 model_not_found for an unknown adapter,
and a one-line error for an adapter made for another base."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import httpx
import pytest

from kvserve.model.config import ModelConfig
from kvserve.train.lora import random_adapter

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]

ADMIN, USER = "admin-secret-key", "user-key"


def _default_config() -> ModelConfig:
    from kvserve.model.gguf_loader import config_from_gguf, open_gguf
    from kvserve.model.registry import resolve

    src = resolve(None)
    return config_from_gguf(open_gguf(src.path), src.name)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, model_server):
    d = tmp_path_factory.mktemp("lora_srv")
    cfg = _default_config()
    paths = {n: random_adapter(d / n, cfg, i, rank=4) for i, n in enumerate(("sql", "poet", "late"))}
    server = model_server(d, "--lora", f"sql={paths['sql']}", "--lora", f"poet={paths['poet']}", "--max-loras", "2",
                          "--admin-key", ADMIN, "--api-key", USER)
    server.paths, server.dir, server.cfg = paths, d, cfg
    return server


def _chat(server, model, key=USER):
    return httpx.post(server.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "messages": [{"role": "user", "content": "Name a color."}],
                      "max_tokens": 8, "temperature": 0}, timeout=120)


def test_models_and_requests(lora_server):
    h = {"Authorization": f"Bearer {USER}"}
    models = httpx.get(lora_server.base_url + "/v1/models", headers=h).json()["data"]
    base = models[0]["id"]
    assert {(m["id"], m["parent"]) for m in models if m.get("parent")} == {("sql", base), ("poet", base)}
    card = httpx.get(lora_server.base_url + "/v1/models/sql", headers=h).json()
    assert card["parent"] == base
    outs = {m: _chat(lora_server, m) for m in (base, "sql", "poet")}
    assert all(r.status_code == 200 for r in outs.values()), {m: r.text for m, r in outs.items()}
    assert outs["sql"].json()["model"] == "sql"
    texts = {m: r.json()["choices"][0]["message"]["content"] for m, r in outs.items()}
    assert texts["sql"] != texts[base] or texts["poet"] != texts[base]
    assert _chat(lora_server, "sql").json()["choices"][0]["message"]["content"] == texts["sql"]
    r = _chat(lora_server, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_admin_load_unload(lora_server):
    url = lora_server.base_url
    body = {"lora_name": "late", "lora_path": str(lora_server.paths["late"])}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 401
    assert httpx.post(url + "/v1/load_lora_adapter", json=body,
                      headers={"Authorization": f"Bearer {USER}"}).status_code == 401
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    assert _chat(lora_server, "late").status_code == 200
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=admin)
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    from dataclasses import replace
    small = random_adapter(lora_server.dir / "small", replace(lora_server.cfg, hidden_size=64), 0, rank=2,
                           targets=["q_proj"])
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "small", "lora_path": str(small)}, headers=admin)
    assert r.status_code == 400 and "another base" in r.json()["error"]["message"]
    assert "\n" not in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=admin)
    assert r.status_code == 200
    assert _chat(lora_server, "late").status_code == 404
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=admin)
    assert r.status_code == 404


def test_bad_adapter_at_startup_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvserve.server", "serve", "--port", "0", "--data-dir",
                           str(tmp_path), "--lora", f"bad={tmp_path / 'missing'}"], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert err and "missing" in err[0] and "does not exist" in err[0], proc.stderr[-2000:]


@contextlib.contextmanager
def adapter_of(lora_server, owner: str):
    """The adapter `late` loaded for a new key named `owner` (yielded), unloaded after."""
    from kvserve.server.stores.keys import KeyStore

    store = KeyStore(lora_server.dir / "kvserve.db")
    key = store.create(owner)
    store.close()
    url, admin = lora_server.base_url, {"Authorization": f"Bearer {ADMIN}"}
    body = {"lora_name": "late", "lora_path": str(lora_server.paths["late"]), "kvserve_owner": owner}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body, headers=admin, timeout=60).status_code == 200
    try:
        yield key
    finally:
        httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=admin)


def test_an_adapter_loaded_for_one_key_is_that_keys_alone(lora_server):
    """Issue 49.10: `kvserve_owner` scopes an adapter to one key; --lora adapters stay everyone's."""
    url = lora_server.base_url
    with adapter_of(lora_server, "bob") as bob:
        def listed(key):
            return {m["id"] for m in httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]}
        assert "late" in listed(bob) and "late" not in listed(USER)
        assert "sql" in listed(bob) and "sql" in listed(USER)
        assert _chat(lora_server, "late", key=bob).status_code == 200
        other = _chat(lora_server, "late")
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        assert httpx.get(url + "/v1/models/late", headers={"Authorization": f"Bearer {USER}"}).status_code == 404


def test_client_apis_see_the_adapters_of_their_key(lora_server):
    """Issue 50: /api/tags and /api/show see the adapters /v1/models shows the same key, no others; a
    num_ctx cap and Anthropic's count_tokens resolve a key's own adapter, not another's."""
    url = lora_server.base_url
    with adapter_of(lora_server, "carol") as carol:
        for key in (carol, USER):
            auth = {"Authorization": f"Bearer {key}"}
            models = [m["id"] for m in httpx.get(url + "/v1/models", headers=auth, timeout=60).json()["data"]]
            assert [m["model"] for m in httpx.get(url + "/api/tags", headers=auth, timeout=60).json()["models"]] == models
            shown = httpx.post(url + "/api/show", json={"model": "late"}, headers=auth, timeout=60)
            assert shown.status_code == (200 if key == carol else 404), shown.text
        assert shown.json() == {"error": "model 'late' not found"}
        tags = httpx.get(url + "/api/tags", headers={"Authorization": f"Bearer {carol}"}, timeout=60).json()["models"]
        late = next(m for m in tags if m["model"] == "late")
        assert late["details"]["parent_model"] and late["details"]["family"] == "llama" and late["size"] == 0
        ask = {"model": "late", "messages": [{"role": "user", "content": "Hi"}]}
        for key, status in ((carol, 200), (USER, 404)):
            auth = {"Authorization": f"Bearer {key}"}
            r = httpx.post(url + "/api/chat", headers=auth, timeout=120,
                           json={**ask, "stream": False, "options": {"num_ctx": 64, "num_predict": 2}})
            assert r.status_code == status, r.text
            assert httpx.post(url + "/v1/messages/count_tokens", json=ask, headers=auth, timeout=60).status_code == status


PROBES = [   # every route that takes a model name, with a body that is valid otherwise
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 1, "store": False}),
    ("POST", "/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("POST", "/api/chat", {"messages": [{"role": "user", "content": "Hi"}], "stream": False,
                           "options": {"num_predict": 1, "num_ctx": 256}}),
    ("POST", "/api/generate", {"prompt": "Hi", "stream": False, "options": {"num_predict": 1}}),
    ("POST", "/api/generate", {}),                                         # Ollama's "load the model"
    ("POST", "/api/show", {}),
    ("POST", "/api/embed", {"input": "Hi"}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/v1/embeddings", {"input": "Hi"}),
    ("POST", "/v1/rerank", {"query": "Hi", "documents": ["a", "b"]}),
    ("POST", "/v1/score", {"text_1": "Hi", "text_2": "a"}),
    ("GET", "/v1/models/{model}", None),
]


def same_but_ids(a: str, b: str) -> bool:
    """Two error bodies equal once request ids (random per answer) are left out."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("id", "request_id")}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return strip(json.loads(a)) == strip(json.loads(b))


def test_another_keys_adapter_cannot_be_used_or_probed_by_name(lora_server):
    """Issue 49.10: every route that takes a model name answers another key's adapter exactly as a
    name that does not exist (status and body, the name aside); its owner tokenizes with it."""
    url = lora_server.base_url

    def ask(method: str, path: str, body: dict | None, model: str, key: str) -> httpx.Response:
        field = "name" if path == "/api/show" else "model"
        return httpx.request(method, url + path.format(model=model), headers={"Authorization": f"Bearer {key}"},
                             json=None if body is None else {**body, field: model}, timeout=120)

    with adapter_of(lora_server, "dave") as dave:
        for method, path, probe in PROBES:
            theirs, missing = ask(method, path, probe, "late", USER), ask(method, path, probe, "gone", USER)
            assert theirs.status_code == missing.status_code and theirs.status_code >= 400, (path, theirs.text)
            assert same_but_ids(theirs.text.replace("late", "gone"), missing.text), (path, theirs.text, missing.text)
        for probe in PROBES:
            if probe[1] in ("/tokenize", "/detokenize"):
                mine = ask(*probe, "late", dave)
                assert mine.status_code == 200, mine.text
                assert mine.json().get("model", "late") == "late"
