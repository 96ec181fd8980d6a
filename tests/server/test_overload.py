"""Overload behaviour and crash safety, on a real server with a tiny admission queue.

The server runs one request at a time (`--max-running 1`) with a queue of 3 and a degradation
ladder that caps max_tokens from one waiting request and refuses the free tier from two.
Then it is SIGKILLed under load and restarted on the same data dir. Both with each engine client.
"""

from __future__ import annotations

import concurrent.futures as cf
import sqlite3
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.stores.keys import KeyStore

HELLO = [{"role": "user", "content": "Name a colour."}]
ARGS = ("--max-model-len", "512", "--max-running", "1", "--max-waiting", "3", "--ladder-cap-at", "1",
        "--ladder-cap-max-tokens", "2", "--ladder-reject-free-at", "2")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, model_server, engine_kind):
    data_dir = tmp_path_factory.mktemp(f"overload-{engine_kind}")
    store = KeyStore(data_dir / "kvserve.db")
    keys = {"paid": store.create("paid"), "free": store.create("free", tier="free")}
    store.close()
    server = model_server(data_dir, *ARGS, engine=engine_kind)
    yield data_dir, keys, server
    server.stop()


def hdr(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def waiting(base_url: str, key: str) -> float:
    text = httpx.get(base_url + "/metrics", headers=hdr(key), timeout=60).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvserve:gateway_requests_waiting":
                return s.value
    raise AssertionError("no gateway_requests_waiting metric")


def wait_for_waiting(base_url: str, key: str, n: int) -> None:
    deadline = time.monotonic() + 120
    while waiting(base_url, key) != n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_queue_ladder_and_503(setup):
    _, keys, srv = setup
    url = srv.base_url + "/v1/chat/completions"
    paid, free = hdr(keys["paid"]), hdr(keys["free"])
    with httpx.Client(timeout=300) as http, cf.ThreadPoolExecutor(4) as pool:
        # A holds the only engine slot: a long stream we read one chunk of, then hang up on.
        body = {"messages": HELLO, "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
        with http.stream("POST", url, json=body, headers=paid) as a:
            assert a.status_code == 200
            lines = a.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(lines)
            short = {"messages": HELLO, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
            b = pool.submit(httpx.post, url, json=short, headers=paid, timeout=300)
            wait_for_waiting(srv.base_url, keys["paid"], 1)
            c = pool.submit(httpx.post, url, json=short, headers=paid, timeout=300)  # ladder rung 1: capped
            wait_for_waiting(srv.base_url, keys["paid"], 2)
            d = httpx.post(url, json=short, headers=free, timeout=60)  # rung 2: free tier refused
            assert d.status_code == 503 and int(d.headers["retry-after"]) >= 1
            assert d.json()["error"]["code"] == "overloaded"
            e = pool.submit(httpx.post, url, json=short, headers=paid, timeout=300)
            wait_for_waiting(srv.base_url, keys["paid"], 3)
            f = httpx.post(url, json=short, headers=paid, timeout=60)  # queue full: everyone refused
            assert f.status_code == 503 and f.headers["x-should-retry"] == "true"
        # A hung up: the queue drains
        rb, rc, re_ = b.result(), c.result(), e.result()
    assert rb.status_code == rc.status_code == re_.status_code == 200
    assert "x-kvserve-max-tokens-capped" not in rb.headers and rb.json()["usage"]["completion_tokens"] == 8
    assert rc.headers["x-kvserve-max-tokens-capped"] == "2" and rc.json()["usage"]["completion_tokens"] == 2
    assert waiting(srv.base_url, keys["paid"]) == 0


def test_sigkill_under_load_keeps_keys_and_ledger(setup, model_server):
    data_dir, keys, srv = setup
    url = srv.base_url + "/v1/chat/completions"
    before = {r["key_name"]: r for r in KeyStore(data_dir / "kvserve.db").usage()}
    assert before["paid"]["requests"] >= 4  # written by the previous test's requests
    pool = cf.ThreadPoolExecutor(4)
    # long enough that the first still runs when the fourth arrives on a loaded machine (with 30 tokens
    # it could finish first, and the queue never showed 3)
    body = {"messages": HELLO, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    for _ in range(4):
        pool.submit(httpx.post, url, json=body, headers=hdr(keys["paid"]), timeout=120)
    wait_for_waiting(srv.base_url, keys["paid"], 3)
    srv.kill()  # SIGKILL with requests running and waiting
    pool.shutdown(wait=True)
    with sqlite3.connect(data_dir / "kvserve.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    restarted = model_server(data_dir, *ARGS, engine=srv.engine)   # stopped by the factory if this fails
    r = httpx.get(restarted.base_url + "/v1/models", headers=hdr(keys["paid"]), timeout=60)
    assert r.status_code == 200
    assert httpx.get(restarted.base_url + "/v1/models", timeout=60).status_code == 401
    after = {r["key_name"]: r for r in KeyStore(data_dir / "kvserve.db").usage()}
    assert after["paid"]["requests"] >= before["paid"]["requests"]
    assert after["paid"]["completion_tokens"] >= before["paid"]["completion_tokens"]
    r = httpx.post(restarted.base_url + "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2},
                   headers=hdr(keys["free"]), timeout=120)
    assert r.status_code == 200
    with sqlite3.connect(data_dir / "kvserve.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    restarted.stop()
