"""Two real `kvserve serve` processes sharing one PostgreSQL and one Redis: a key made once works
on both, its rate limit is one bucket for both, and (with the model) both write one ledger.

The rate limit is taken by the gateway before any route runs, so the fast variant sends its
requests, one after the other, to an authenticated route that needs no model (`GET /v1/models`)
as soon as the two gateways listen; the slow variant waits for both models and sends chat
completions all at once."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest
from servers import ModelServer

from kvserve.server.stores.factory import open_key_backend

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}


@pytest.mark.parametrize("route", ["models", pytest.param("chat", marks=pytest.mark.slow)])
def test_two_servers_on_one_redis_share_a_10_rpm_limit(tmp_path, redis_server, postgres_server, route):
    db_url, redis_url = postgres_server.new_database(), redis_server.fresh_url()
    store = open_key_backend(None, db_url, redis_url)
    key = store.create("shared", rpm=10)
    auth = {"Authorization": f"Bearer {key}"}
    args = ("--database-url", db_url, "--redis-url", redis_url, "--max-model-len", "256")
    servers = [ModelServer(tmp_path / name, *args) for name in ("a", "b")]
    for s in servers:
        s.data_dir.mkdir()

    def ask(i: int) -> httpx.Response:
        url = servers[i % 2].base_url
        if route == "chat":
            return httpx.post(url + "/v1/chat/completions", json=CHAT, headers=auth, timeout=120)
        return httpx.get(url + "/v1/models", headers=auth, timeout=60)

    try:
        with cf.ThreadPoolExecutor(2) as pool:   # both start at once
            list(pool.map(lambda s: s.start(wait_for_model=route == "chat"), servers))
        # 20 requests alternating between the servers, all well within the bucket's refill time
        # (one request per 6 s): one after the other without the model (milliseconds each), sent
        # together with it (a generation takes longer)
        if route == "chat":
            with cf.ThreadPoolExecutor(20) as pool:
                answers = list(pool.map(ask, range(20)))
        else:
            answers = [ask(i) for i in range(20)]
    finally:
        for s in servers:
            s.stop()
    ok = [i for i, r in enumerate(answers) if r.status_code == 200]
    limited = [r for r in answers if r.status_code == 429]
    assert 9 <= len(ok) <= 11 and len(ok) + len(limited) == 20, [r.status_code for r in answers]
    if route == "models":   # in turn: the first 10 pass, 5 on each server, then none
        assert ok[:10] == list(range(10)), [r.status_code for r in answers]
    for r in limited:
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.headers["x-ratelimit-limit-requests"] == "10"
    if route == "chat":   # one ledger for both servers
        assert all(answers[i].json()["choices"][0]["message"]["content"] for i in ok)
        (row,) = store.usage("shared")
        assert row["requests"] == len(ok)
        assert row["completion_tokens"] == sum(answers[i].json()["usage"]["completion_tokens"] for i in ok)
    store.close()
