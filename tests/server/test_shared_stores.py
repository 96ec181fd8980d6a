"""Stored responses, moderation policies and the semantic cache on each backend: the embedded
SQLite stores and the shared ones (PostgreSQL for responses and policies, Redis for the cache) on
real servers started by the fixtures; and, for each shared store, two servers or stores on one
backend seeing each other's data."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import types
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from servers import InProcessServer
from typer.testing import CliRunner

from kvserve.errors import InvalidRequest
from kvserve.server.cli import keys_app
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.routing.semantic_cache import CacheOptions, Entry, SemanticCache, SQLiteBackend, make_plan
from kvserve.server.settings import ServerSettings
from kvserve.server.stores.moderation_policies import PolicyStore
from kvserve.server.stores.redis_cache import RedisCacheBackend
from kvserve.server.stores.responses import ResponseNotFound, ResponseStore


@pytest.fixture(params=("sqlite", "postgres"))
def db(request, tmp_path):
    """Opens stores on one backing: `db.responses()` / `db.policies()` (a second open is a restart)."""
    url = request.getfixturevalue("postgres_server").new_database() if request.param == "postgres" else None
    opened: list = []

    def opener(cls):
        def open_():
            store = cls(url or tmp_path / "kvserve.db")
            opened.append(store)
            return store
        return open_

    yield types.SimpleNamespace(url=url, responses=opener(ResponseStore),
                                policies=opener(PolicyStore))
    for store in opened:
        store.close()


def test_response_store_per_owner_and_across_restart(db):
    s = db.responses()
    resp = {"id": "resp_1", "object": "response", "output_text": "Hi \x00 there"}
    turns = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi \x00 there"}]
    s.put("key:a", resp, turns)
    assert s.get("key:a", "resp_1") == resp and s.messages("key:a", "resp_1") == turns
    with pytest.raises(ResponseNotFound):
        s.get("key:b", "resp_1")                        # another owner's id is a 404
    with pytest.raises(ResponseNotFound):
        s.delete("key:b", "resp_1")
    s.put("key:a", {**resp, "output_text": "again"}, turns)   # the same id again replaces it
    again = db.responses()                              # a restarted server
    assert again.get("key:a", "resp_1")["output_text"] == "again"
    again.delete("key:a", "resp_1")
    with pytest.raises(ResponseNotFound):
        s.messages("key:a", "resp_1")


def test_policy_store(db):
    store = db.policies()
    store.set("tier:free", {"thresholds": {"violence": 0.1}})
    store.set("k1", {"mode": "output"})
    assert store.for_caller("k1", "free") == [{"thresholds": {"violence": 0.1}}, {"mode": "output"}]
    with pytest.raises(InvalidRequest):
        store.set("k2", {"mode": "sideways"})
    assert store.delete("k1") and not store.delete("k1")
    assert db.policies().all() == {"tier:free": {"thresholds": {"violence": 0.1}}}


def test_two_servers_share_responses_and_policies_in_postgres(postgres_server, tmp_path):
    url = postgres_server.new_database()
    r = CliRunner().invoke(keys_app, ["moderation", "tier:free", "--mode", "off", "--database-url", url,
                                      "--data-dir", str(tmp_path / "cli")])
    assert r.exit_code == 0, r.output
    settings = [ServerSettings(load_model=False, data_dir=tmp_path / n, database_url=url) for n in ("a", "b")]
    with InProcessServer(settings[0]) as a, InProcessServer(settings[1]) as b:
        assert a.state.moderation.policies.all() == {"tier:free": {"mode": "off"}}
        a.state.backends.responses.put("anonymous", {"id": "resp_x", "object": "response"}, [])
        got = httpx.get(f"{b.base_url}/v1/responses/resp_x", timeout=10)
        assert got.status_code == 200 and got.json()["id"] == "resp_x"
        assert httpx.delete(f"{b.base_url}/v1/responses/resp_x", timeout=10).json()["deleted"] is True
        assert httpx.get(f"{a.base_url}/v1/responses/resp_x", timeout=10).status_code == 404
        b.state.moderation.policies.set("k1", {"pii_input": "redact"})   # seen by a within refresh_s
        deadline = time.monotonic() + 10
        while "k1" not in a.state.moderation.policies.all() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert a.state.moderation.policies.for_caller("k1", "free") == [{"mode": "off"}, {"pii_input": "redact"}]
    bad = CliRunner().invoke(keys_app, ["moderation", "--database-url", "mysql://x"])
    assert bad.exit_code == 1 and "--database-url must be" in bad.output


# ---- the semantic cache ---------------------------------------------------------------------

def _entry(i: int, partition: str, created: float) -> Entry:
    v = np.zeros(4, dtype=np.float32)
    v[i % 4] = 1
    return Entry(str(i), partition, f"q{i}", v, f"a{i}", "stop", 1, 1, created, created, token_ids=[i, 7, 9])


@pytest.fixture(params=("sqlite", "redis"))
def cache_backend(request, tmp_path):
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").fresh_url()
        make = lambda: RedisCacheBackend(url, ttl_s=1000)
    else:
        make = lambda: SQLiteBackend(tmp_path / "c.db")
    opened: list = []

    def open_():
        opened.append(make())
        return opened[-1]
    yield open_
    for b in opened:
        with contextlib.suppress(Exception):   # most were closed by the test
            b.close()


def _ids(b, partition: str, now: float) -> set[str]:
    """The ids the backend still answers with: each one of the 4 unit vectors asked once."""
    found = set()
    for i in range(4):
        v = np.zeros(4, dtype=np.float32)
        v[i] = 1
        got = b.nearest(partition, v, now=now, max_age_s=1000)
        if got is not None and got[1] > 0.99:
            found.add(got[0].id)
    return found


def test_cache_backend_ttl_lru_and_reopen(cache_backend):
    b = cache_backend()
    b.put(_entry(0, "p", 100.0), max_entries=3)
    b.put(_entry(1, "p", 200.0), max_entries=3)
    e, sim = b.nearest("p", np.array([1, 0, 0, 0], dtype=np.float32), now=250.0, max_age_s=1000)
    assert e.id == "0" and e.answer == "a0" and e.query == "q0" and sim == pytest.approx(1.0)
    assert e.token_ids == [0, 7, 9]       # the verification's draft, as generated (not re-tokenized)
    assert b.nearest("p", np.array([1, 0, 0, 0], dtype=np.float32), now=1150.0, max_age_s=1000)[0].id == "1"
    assert b.nearest("other", np.array([1, 0, 0, 0], dtype=np.float32), now=250.0, max_age_s=1000) is None
    b.touch(e, 300.0)                     # 0 is now the most recently used: 1 goes first
    b.put(_entry(2, "p", 301.0), max_entries=3)
    b.put(_entry(3, "p", 302.0), max_entries=3)
    assert _ids(b, "p", 310.0) == {"0", "2", "3"}
    b.close()
    assert _ids(cache_backend(), "p", 310.0) == {"0", "2", "3"}   # a restarted server keeps its answers


def test_redis_cache_expires_old_entries(redis_server):
    url = redis_server.fresh_url()
    b = RedisCacheBackend(url, ttl_s=100)
    b.put(_entry(0, "p", 1000.0), max_entries=10)
    b.put(_entry(1, "q", 1200.0), max_entries=10)     # sweeps 0 (older than the TTL)
    assert b.nearest("p", np.array([1, 0, 0, 0], dtype=np.float32), now=1000.0, max_age_s=100) is None
    assert b.client.zcard("kvserve:scache:lru") == 1 and b.client.pttl("kvserve:scache:vec:q") > 0
    b.close()


def _routing(settings: ServerSettings):
    from kvserve.server.routing.step import RoutingStep

    return RoutingStep.create(settings, pool=None, admission=None, registry=CollectorRegistry())


def test_two_servers_share_the_semantic_cache_in_redis(redis_server, tmp_path):
    url = redis_server.fresh_url()
    a = _routing(ServerSettings(data_dir=tmp_path / "a", redis_url=url))
    b = _routing(ServerSettings(data_dir=tmp_path / "b", redis_url=url))
    local = _routing(ServerSettings(data_dir=tmp_path / "c"))
    try:
        assert isinstance(a.cache.backend, RedisCacheBackend) and isinstance(local.cache.backend, SQLiteBackend)

        def plan(cache: SemanticCache, text: str):
            return make_plan(ChatCompletionRequest(messages=[{"role": "user", "content": text}], temperature=0),
                             "m", "alice", cache.options)

        first = plan(a.cache, "What is the capital of France?")
        assert asyncio.run(a.cache.lookup(first)) is None
        a.cache.store(first, "Paris.", "stop", 10, 2)
        hit = asyncio.run(b.cache.lookup(plan(b.cache, "Tell me the capital of France.")))
        assert hit is not None and hit.entry.answer == "Paris." and hit.similarity >= CacheOptions().threshold
        assert asyncio.run(local.cache.lookup(plan(local.cache, "Tell me the capital of France."))) is None
    finally:
        for f in (a, b, local):
            f.close()


def test_two_model_servers_share_cached_answers_and_responses(model_server, redis_server, postgres_server, tmp_path):
    """Over HTTP, two `kvserve serve --redis-url R --database-url D`: an answer one generated is the
    other's semantic hit, and a response created on one is continued and read on the other."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from ggufmaker import make_tiny_llama_gguf

    tiny = make_tiny_llama_gguf(tmp_path / "t.gguf", ctx=256)
    url = redis_server.fresh_url()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    db = postgres_server.new_database()
    servers = [model_server(tmp_path / name, "--model", f"t={tiny}", "--semantic-cache", "on", "--redis-url", url,
                            "--database-url", db) for name in ("a", "b")]
    try:
        def chat(srv, content: str) -> httpx.Response:
            return httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0})

        first = chat(servers[0], "What is the capital of Italy?")
        assert first.status_code == 200 and "x-kvserve-cache" not in first.headers
        second = chat(servers[1], "Which city is the capital of Italy?")
        assert second.status_code == 200 and second.headers.get("x-kvserve-cache") == "semantic"
        own = httpx.post(servers[1].base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Which city is the capital of Italy?"}], "max_tokens": 8,
            "temperature": 0, "cache": False})     # a hit is verified by the model: its answer is the model's
        assert second.json()["choices"][0]["message"]["content"] == own.json()["choices"][0]["message"]["content"]
        assert not (tmp_path / "b" / "semantic_cache.db").exists()

        def respond(srv, **body) -> dict:
            r = httpx.post(srv.base_url + "/v1/responses", timeout=120, json={"max_output_tokens": 4, **body})
            assert r.status_code == 200, r.text
            return r.json()

        made = respond(servers[0], input="My name is Zoltan.")
        cont = respond(servers[1], input="What is my name?", previous_response_id=made["id"])
        assert cont["usage"]["input_tokens"] > made["usage"]["input_tokens"] + 3   # the history came along
        assert httpx.get(f"{servers[0].base_url}/v1/responses/{cont['id']}", timeout=10).json()["id"] == cont["id"]
    finally:
        for srv in servers:
            srv.stop()
