"""The gateway without a model: keys DB, buckets, admission, validation and auth over real HTTP.

The stores run on each backend: embedded (SQLite + memory) and shared (PostgreSQL + Redis, real
servers started by the fixtures), and the HTTP tests run against a gateway on each."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3

import httpx
import pytest
from typer.testing import CliRunner

from kvserve.errors import InvalidRequest, Overloaded, RateLimitError
from kvserve.server.cli import keys_app
from kvserve.server.gates.admission import Admission, ladder_decision
from kvserve.server.settings import ServerSettings

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def gateway(gateway_on_each_backend):
    return gateway_on_each_backend


# ---- keys and ledger ------------------------------------------------------------------------

def test_keys_stored_only_as_hashes(key_stores):
    store = key_stores.open()
    assert not store.auth_required()
    key = store.create("alice", rpm=10, tier="free")
    assert store.auth_required()
    assert store.lookup(key).name == "alice" and store.lookup(key).tier == "free"
    assert store.lookup(key).rpm == 10   # a second lookup comes from the cache when there is one
    assert store.lookup(key + "x") is None and store.lookup("") is None
    store.close()
    raw = key_stores.raw()
    assert key.encode() not in raw and key[8:].encode() not in raw
    with pytest.raises(InvalidRequest) as e:
        key_stores.open().create("alice")
    assert e.value.param == "name"


def test_revoke_keeps_auth_on_and_rejects_key(key_stores):
    store = key_stores.open()
    key = store.create("bob")
    assert store.lookup(key).name == "bob"
    other = key_stores.open()  # a second connection (the CLI) revokes
    assert other.revoke("bob") and not other.revoke("bob")
    assert store.lookup(key) is None  # the server's cache notices the other connection's commit
    assert store.auth_required()


def test_usage_ledger_accumulates_per_key_per_day(key_stores):
    store = key_stores.open()
    store.record_usage("alice", 10, 5, 2)
    key_stores.open().record_usage("alice", 1, 1, 0)   # another replica adds to the same row
    store.record_usage(None, 3, 3, 0)
    rows = {r["key_name"]: r for r in store.usage()}
    assert rows["alice"]["requests"] == 2 and rows["alice"]["prompt_tokens"] == 11
    assert rows["alice"]["completion_tokens"] == 6 and rows["alice"]["cached_tokens"] == 2
    assert rows["(anonymous)"]["prompt_tokens"] == 3
    assert [r["key_name"] for r in store.usage("alice")] == ["alice"]


def test_keys_cli(key_stores):
    runner = CliRunner()
    dd = key_stores.cli_args()
    r = runner.invoke(keys_app, ["create", "--name", "carol", "--rpm", "5", "--tier", "free", *dd])
    assert r.exit_code == 0, r.output
    key = r.stdout.strip().splitlines()[0]
    assert key.startswith("kvs-")
    assert key_stores.open().lookup(key).name == "carol"   # the server's store sees the CLI's key
    r = runner.invoke(keys_app, ["list", *dd])
    assert "carol" in r.stdout and key not in r.stdout
    assert runner.invoke(keys_app, ["create", "--name", "carol", *dd]).exit_code == 1
    assert runner.invoke(keys_app, ["revoke", "carol", *dd]).exit_code == 0
    assert "revoked" in runner.invoke(keys_app, ["list", *dd]).stdout
    assert runner.invoke(keys_app, ["revoke", "nobody", *dd]).exit_code == 1


# ---- rate limits and admission --------------------------------------------------------------

def test_request_bucket(make_limiter):
    limiter = make_limiter()
    limiter.acquire_request("k", 2)
    make_limiter().acquire_request("k", 2)   # with Redis: another replica, the same bucket
    with pytest.raises(RateLimitError) as e:
        limiter.acquire_request("k", 2)
    assert 0 < e.value.retry_after <= 30
    limiter.acquire_request("other", 2)  # buckets are per key
    limiter.acquire_request("k", None)  # no limit
    headers = dict(limiter.headers("k", 2, None))
    assert headers[b"x-ratelimit-limit-requests"] == b"2" and headers[b"x-ratelimit-remaining-requests"] == b"0"


def test_token_bucket_reserve_and_refund(make_limiter):
    limiter = make_limiter()
    assert limiter.reserve_tokens("k", 100, 80) == 80
    with pytest.raises(RateLimitError):
        make_limiter().reserve_tokens("k", 100, 30)
    limiter.refund_tokens("k", 100, 50)  # the request used 30 of its 80
    assert make_limiter().reserve_tokens("k", 100, 30) == 30
    with pytest.raises(RateLimitError) as e:
        limiter.reserve_tokens("k", 100, 101)  # can never fit: do not retry
    assert e.value.should_retry is False and e.value.param == "max_tokens"


def test_ladder_steps():
    s = ServerSettings(load_model=False, max_waiting=10, ladder_cap_at=4, ladder_cap_max_tokens=7,
                       ladder_reject_free_at=6)
    assert ladder_decision(0, "free", s).max_tokens_cap is None
    assert ladder_decision(4, "free", s).max_tokens_cap == 7
    assert ladder_decision(6, "paid", s).max_tokens_cap == 7
    with pytest.raises(Overloaded):
        ladder_decision(6, "free", s)
    with pytest.raises(Overloaded) as e:
        ladder_decision(10, "paid", s)
    assert e.value.retry_after > 0


def test_admission_serves_paid_before_free_and_bounds_queue():
    async def run() -> list[str]:
        adm = Admission(ServerSettings(load_model=False, max_running=1, max_waiting=2))
        order: list[str] = []
        first = await adm.acquire(0)

        async def waiter(name: str, prio: int) -> None:
            ticket = await adm.acquire(prio)
            order.append(name)
            ticket.release()

        free = asyncio.create_task(waiter("free", 1_000_000))
        await asyncio.sleep(0)
        paid = asyncio.create_task(waiter("paid", 0))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await adm.acquire(0)  # two already waiting
        first.release()
        first.release()  # idempotent
        await asyncio.gather(free, paid)
        assert adm.running == 0 and adm.num_waiting == 0
        return order

    assert asyncio.run(run()) == ["paid", "free"]


# ---- over HTTP ------------------------------------------------------------------------------

@pytest.mark.parametrize("body,param", [
    ({**CHAT, "max_token": 5}, "max_token"),
    ({**CHAT, "n": 99}, "n"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "stop": [str(i) for i in range(17)]}, "stop"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}] * 257}, "messages"),
    ({"max_tokens": 5}, "messages"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "truncate": "newest"}, "truncate"),
])
def test_chat_validation_400_with_param(gateway, body, param):
    r = httpx.post(gateway.base_url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"max_tokens": 2}, "prompt"),
])
def test_completion_validation_400_with_param(gateway, body, param):
    r = httpx.post(gateway.base_url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_malformed_bodies_are_400(gateway):
    url = gateway.base_url + "/v1/chat/completions"
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        r = httpx.post(url, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, (content, r.text)
    r = httpx.post(url, content=b" " * (2 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_generation_is_503_while_no_model(gateway):
    r = httpx.post(gateway.base_url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert httpx.get(gateway.base_url + "/health").status_code == 503


def test_request_id_is_honoured_or_made(gateway):
    r = httpx.get(gateway.base_url + "/version", headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(gateway.base_url + "/version", headers={"x-request-id": "bad id\twith spaces"})
    assert r.headers["x-request-id"] != "bad id\twith spaces" and len(r.headers["x-request-id"]) == 32


def raw_get(port: int, target: str, host: str = "127.0.0.1", headers: str = "") -> tuple[int, bytes]:
    """One HTTP/1.1 request with the request target sent byte for byte (no client normalisation)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def test_auth_cannot_be_bypassed(gateway, tmp_path):
    key = gateway.state.keystore.create("gate-alice")
    port = gateway.port
    assert raw_get(port, "/health")[0] == 503  # public (no model here), never 401
    assert raw_get(port, "/v1/models")[0] == 401
    ok, body = raw_get(port, "/v1/models", headers=f"Authorization: Bearer {key}\r\n")
    assert ok == 200 and b'"object":"list"' in body
    attempts = [
        ("/v1/models", "127.0.0.1", ""),
        ("/v1/models", "localhost/health", ""),
        ("/v1/models", "127.0.0.1", "X-Forwarded-Prefix: /health\r\nX-Original-URL: /health\r\n"),
        ("//v1/models", "127.0.0.1", ""),
        ("/v1//models", "127.0.0.1", ""),
        ("/v1/models/", "127.0.0.1", ""),
        ("/v1/models/.", "127.0.0.1", ""),
        ("/health/../v1/models", "127.0.0.1", ""),
        ("/health%2F..%2Fv1%2Fmodels", "127.0.0.1", ""),
        ("/%76%31/models", "127.0.0.1", ""),
        ("/static/../v1/models", "127.0.0.1", ""),
        ("/static/..%2F..%2Fv1%2Fmodels", "127.0.0.1", ""),
        ("http://127.0.0.1/health/../v1/models", "127.0.0.1", ""),
        ("/v1/models?x=/health", "127.0.0.1", ""),
        ("/v1/models#/health", "127.0.0.1", ""),
        ("/metrics", "127.0.0.1", ""),
        ("/v1/kvserve/conversations", "127.0.0.1", "X-KVServe-Client: abcdefgh1234\r\n"),
        ("/v1/models", "127.0.0.1", "Authorization: Bearer \r\n"),
        ("/v1/models", "127.0.0.1", f"Authorization: Bearer {key}x\r\n"),
        ("/v1/models", "127.0.0.1", f"Authorization: Basic {key}\r\n"),
    ]
    for target, host, headers in attempts:
        status, body = raw_get(port, target, host, headers)
        assert status in (400, 401, 404), (target, host, headers, status, body)
        assert b'"object":"list"' not in body and b"kvserve:" not in body and b'"conversations"' not in body
    # a revoked key stops working at once
    gateway.state.keystore.revoke("gate-alice")
    assert raw_get(port, "/v1/models", headers=f"Authorization: Bearer {key}\r\n")[0] == 401
    assert raw_get(port, "/")[0] == 200  # the web page stays public
    r = httpx.get(gateway.base_url + "/v1/models")
    assert r.status_code == 401 and json.loads(r.text)["error"]["code"] == "invalid_api_key"


def test_stores_are_durable(gateway):
    """SQLite in WAL mode; in PostgreSQL, each store's schema at its latest migration."""
    url = gateway.state.settings.database_url
    if url:
        import psycopg

        from kvserve.server.stores import (
            arena,
            batches,
            conversations,
            files,
            keys,
            moderation_policies,
            responses,
        )

        with psycopg.connect(url) as conn:
            versions = dict(conn.execute("SELECT component, version FROM kvserve_schema_version").fetchall())
        stores = (keys.KeyStore, conversations.ConversationStore, arena.ArenaStore, responses.ResponseStore,
                  moderation_policies.PolicyStore, files.FileStore, batches.BatchStore)
        assert versions == {s.component: len(s.steps) for s in stores}
        return
    with sqlite3.connect(gateway.state.settings.db_path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
