"""What only the shared backends do: buckets shared atomically by replicas, the key cache's
invalidation, migrations, and a clear answer when Redis or PostgreSQL is not there."""

from __future__ import annotations

import threading

import httpx
import psycopg
import pytest
from servers import InProcessServer, free_port
from typer.testing import CliRunner

from kvserve.errors import InvalidRequest, KVServeError, RateLimitError
from kvserve.server.cli import keys_app
from kvserve.server.settings import ServerSettings
from kvserve.server.stores.common import StateStoreUnavailable, redact
from kvserve.server.stores.conversations import ConversationStore
from kvserve.server.stores.factory import open_backends, open_key_backend
from kvserve.server.stores.keys import KeyStore
from kvserve.server.stores.postgres import PostgresDatabase, migrate
from kvserve.server.stores.redis_state import RedisRateLimiter, connect_redis


def test_replicas_hammering_one_bucket_get_exactly_its_capacity(redis_server):
    """8 threads on 4 clients (replicas) race for a 50-request bucket: exactly 50 are let through."""
    url = redis_server.fresh_url()
    clients = [connect_redis(url) for _ in range(4)]
    limiters = [RedisRateLimiter(c) for c in clients]
    granted, refused = [], []

    def worker(i: int) -> None:
        for _ in range(20):
            try:
                limiters[i % 4].acquire_request("hot", 50)
                granted.append(1)
            except RateLimitError as e:
                refused.append(e.retry_after)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    # 160 attempts; the bucket refills 50/60 per second, so a slow run may earn a few more
    assert 50 <= len(granted) <= 55 and len(granted) + len(refused) == 160
    assert all(0 < r <= 60 / 50 + 0.01 for r in refused)


def test_bucket_lives_in_redis_and_follows_a_changed_limit(redis_server):
    url = redis_server.fresh_url()
    a, b = RedisRateLimiter(connect_redis(url)), RedisRateLimiter(connect_redis(url))
    assert a.reserve_tokens("k", 1000, 900) == 900
    with pytest.raises(RateLimitError) as e:
        b.reserve_tokens("k", 1000, 200)
    assert 5 < e.value.retry_after < 13   # 100 missing at 1000/60 per second
    b.refund_tokens("k", 1000, 800)
    assert dict(a.headers("k", None, 1000))[b"x-ratelimit-remaining-tokens"] in (b"900", b"901")
    a.reserve_tokens("k", 10, 5)   # the key's tpm was lowered: a fresh bucket at the new size


def test_key_cache_sees_changes_from_any_process(redis_server, postgres_server, tmp_path):
    db_url, r_url = postgres_server.new_database(), redis_server.fresh_url()
    server_a = open_key_backend(None, db_url, r_url)
    server_b = open_key_backend(None, db_url, r_url)
    key = server_a.create("dana", rpm=3)
    assert server_b.lookup(key).rpm == 3 and server_b.lookup(key).name == "dana"   # miss, then hit
    runner = CliRunner()
    args = ["--database-url", db_url, "--redis-url", r_url, "--data-dir", str(tmp_path)]
    assert runner.invoke(keys_app, ["revoke", "dana", *args]).exit_code == 0
    assert server_a.lookup(key) is None and server_b.lookup(key) is None
    # a negative answer is cached too, and a new key is still seen at once
    new = runner.invoke(keys_app, ["create", "--name", "erin", *args]).stdout.strip()
    assert server_b.lookup(new).name == "erin"
    server_a.close()
    server_b.close()


def test_migrations_are_versioned_and_run_once(postgres_server):
    url = postgres_server.new_database()
    db = PostgresDatabase(url)
    steps = [("CREATE TABLE m1 (x INT)",), ("ALTER TABLE m1 ADD COLUMN y INT", "CREATE TABLE m2 (z INT)")]
    assert migrate(db, "demo", steps[:1]) == 1
    assert migrate(db, "demo", steps) == 2
    assert migrate(db, "demo", steps) == 2   # nothing re-run (would fail: m2 exists)
    with pytest.raises(KVServeError, match="newer than this kvserve"):
        migrate(db, "demo", steps[:1])
    # a failing step leaves neither its tables nor its version behind
    with pytest.raises(psycopg.Error):
        migrate(db, "demo", [*steps, ("CREATE TABLE m3 (a INT)", "CREATE TABLE m1 (x INT)")])
    with db.connection() as conn:
        assert conn.execute("SELECT to_regclass('m3') AS t").fetchone()["t"] is None
        assert conn.execute("SELECT version FROM kvserve_schema_version WHERE component = 'demo'"
                            ).fetchone()["version"] == 2
    db.close()


def test_replicas_starting_together_migrate_once(postgres_server):
    url = postgres_server.new_database()
    stores, errors = [], []

    def start() -> None:
        try:
            stores.append(KeyStore(url))
        except Exception as e:   # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(stores) == 4
    stores[0].create("x")
    assert [k.name for k in stores[3].list()] == ["x"]
    for s in stores:
        s.close()


def test_postgres_refuses_nul_with_a_400(postgres_server):
    store = ConversationStore(postgres_server.new_database())
    conv = store.create("o", "t")
    with pytest.raises(InvalidRequest) as e:
        store.put_messages("o", conv["id"], [{"role": "user", "content": "a\x00b"}])
    assert e.value.param == "messages[0].content"
    with pytest.raises(InvalidRequest):
        store.create("o", "a\x00")
    store.put_messages("o", conv["id"], [{"role": "user", "content": "ok", "meta": {"x": "\x00"}}])
    assert store.get("o", conv["id"])["messages"][0]["meta"] == {"x": "\x00"}
    store.close()


def test_bad_or_unreachable_urls_are_one_line_errors(tmp_path):
    dead = free_port()
    with pytest.raises(InvalidRequest, match="--database-url must be a postgresql://"):
        open_key_backend(tmp_path / "k.db", "mysql://u:secret@h/db")
    with pytest.raises(StateStoreUnavailable, match="Cannot connect to PostgreSQL") as e:
        open_key_backend(tmp_path / "k.db", f"postgresql://u:secret@127.0.0.1:{dead}/db")
    assert "secret" not in e.value.message and "***" in e.value.message
    with pytest.raises(StateStoreUnavailable, match="Cannot reach Redis"):
        open_backends(ServerSettings(load_model=False, data_dir=tmp_path, redis_url=f"redis://127.0.0.1:{dead}/0"))
    assert redact("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    r = CliRunner().invoke(keys_app, ["list", "--data-dir", str(tmp_path), "--redis-url", "http://x"])
    assert r.exit_code == 1 and "--redis-url must be" in r.output and "Traceback" not in r.output


def test_redis_going_away_is_a_503_not_a_500(redis_server, postgres_server, tmp_path):
    """With the shared stores, a lost Redis turns authenticated requests into 503 + Retry-After:
    never a 500, never an open, unlimited door."""
    from state_servers import RedisServer

    own_redis = RedisServer()
    settings = ServerSettings(load_model=False, data_dir=tmp_path, database_url=postgres_server.new_database(),
                              redis_url=own_redis.fresh_url())
    try:
        with InProcessServer(settings) as srv:
            key = srv.state.keystore.create("frank", rpm=100)
            auth = {"Authorization": f"Bearer {key}"}
            r = httpx.get(srv.base_url + "/v1/models", headers=auth)
            assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "100"
            own_redis.stop()
            r = httpx.get(srv.base_url + "/v1/models", headers=auth)
            assert r.status_code == 503 and r.json()["error"]["code"] == "state_store_unavailable"
            assert int(r.headers["retry-after"]) >= 1
    finally:
        own_redis.stop()


def test_two_gateways_share_buckets_and_live_counters(redis_server, postgres_server, tmp_path):
    """Two gateways on one PostgreSQL + Redis: a key made through one works on the other, its
    3 requests/minute are shared, and both read the same live counters."""
    db_url, r_url = postgres_server.new_database(), redis_server.fresh_url()
    one = ServerSettings(load_model=False, data_dir=tmp_path / "a", database_url=db_url, redis_url=r_url)
    two = ServerSettings(load_model=False, data_dir=tmp_path / "b", database_url=db_url, redis_url=r_url)
    with InProcessServer(one) as a, InProcessServer(two) as b:
        key = a.state.keystore.create("gina", rpm=3)
        auth = {"Authorization": f"Bearer {key}"}
        codes = [httpx.get((a, b)[i % 2].base_url + "/v1/models", headers=auth).status_code for i in range(6)]
        assert sorted(codes) == [200, 200, 200, 429, 429, 429], codes
        assert a.state.backends.counters.snapshot() == b.state.backends.counters.snapshot()
        assert a.state.backends.counters.snapshot()["rate_limited"] == 3
        assert b.state.backends.counters.snapshot()["requests"] >= 3
        metrics = httpx.get(a.base_url + "/metrics", headers=auth)   # the key is limited: use the counters
        assert metrics.status_code == 429
        text = a.state.metrics.render().decode()
        assert 'kvserve:gateway_requests_total{outcome="rate_limited"} 4.0' in text


def test_sqlite_keys_are_not_shared_through_redis(redis_server, tmp_path):
    """Servers on their own SQLite files but one Redis (shared limits only) keep their own keys:
    a key of one is never accepted by the other through a shared cache."""
    url = redis_server.fresh_url()
    a, b = open_key_backend(tmp_path / "a.db", None, url), open_key_backend(tmp_path / "b.db", None, url)
    key = a.create("hank")
    assert a.lookup(key).name == "hank" and a.lookup(key).name == "hank"
    assert b.lookup(key) is None
    a.close()
    b.close()
