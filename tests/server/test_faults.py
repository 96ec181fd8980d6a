"""Fault tests on real processes, each bounded in time (generous timeouts, no timing assertions):

* SIGKILL of the server while generation and conversation writes are in flight, on SQLite and on
  PostgreSQL (`--database-url`): the SQLite file passes `PRAGMA integrity_check`, every generation
  that got its response is in the usage ledger, every conversation append that got a 200 is
  stored, the keys are as they were, and a server restarted on the same store accepts the key,
  refuses the revoked one and returns the whole conversation;
* SIGTERM with a stream in flight: the server stops accepting, the stream finishes, the process
  exits 0 and the request is in the ledger;
* the engine process killed (`--engine-process`): in-flight requests end with a retryable 503,
  /health says so, and the server restarts the engine and serves again;
* KV exhaustion: more concurrent long requests than the KV cache holds are preempted and
  recomputed, none fails, and each answer equals the one the request got alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import pathlib
import signal
import sqlite3
import threading
import time

import httpx
import psycopg
import pytest
from servers import ModelServer

from kvserve.server.stores.factory import open_key_backend
from kvserve.server.stores.keys import KeyStore

HELLO = [{"role": "user", "content": "Name a colour."}]


def make_keys(data_dir: pathlib.Path, *names: str) -> dict[str, str]:
    store = KeyStore(data_dir / "kvserve.db")
    keys = {n: store.create(n) for n in names}
    store.close()
    return keys


def hdr(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_sigkill_with_writes_in_flight(tmp_path, model_server, request, store):
    database = request.getfixturevalue("postgres_server").new_database() if store == "postgres" else None
    extra = ("--database-url", database) if database else ()
    keys_store = open_key_backend(tmp_path / "kvserve.db", database)
    keys = {n: keys_store.create(n) for n in ("w", "gone")}
    keys_store.revoke("gone")
    keys_before = keys_store.list()
    srv = model_server(tmp_path, "--max-model-len", "256", *extra)
    answered, appended, stop = [], [], threading.Event()
    conv = httpx.post(srv.base_url + "/v1/kvserve/conversations", json={"title": "log"}, headers=hdr(keys["w"]),
                      timeout=60).json()["id"]

    def generate() -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                try:
                    r = http.post(srv.base_url + "/v1/chat/completions", headers=hdr(keys["w"]),
                                  json={"messages": HELLO, "max_tokens": 3, "ignore_eos": True})
                except httpx.HTTPError:
                    return
                if r.status_code == 200:
                    answered.append(r.json()["usage"]["completion_tokens"])

    def write(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not stop.is_set():
                text = f"writer {i} message {n} " + "x" * 2000
                try:
                    r = http.post(srv.base_url + f"/v1/kvserve/conversations/{conv}/messages", headers=hdr(keys["w"]),
                                  json={"messages": [{"role": "user", "content": text}]})
                except httpx.HTTPError:
                    return
                if r.status_code == 200:
                    appended.append(text)
                n += 1

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate) for _ in range(2)] + [pool.submit(write, i) for i in range(2)]
        deadline = time.monotonic() + 120
        while (len(answered) < 8 or len(appended) < 8) and time.monotonic() < deadline:
            time.sleep(0.05)
        srv.kill()             # SIGKILL, requests and writes in flight
        stop.set()
        for f in futures:
            f.result()
    assert len(answered) >= 8 and len(appended) >= 8
    if database is None:
        with sqlite3.connect(tmp_path / "kvserve.db") as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            stored = {row[0] for row in conn.execute("SELECT content FROM messages")}
    else:
        with psycopg.connect(database) as conn:
            stored = {row[0] for row in conn.execute("SELECT content FROM messages")}
    ledger = {r["key_name"]: r for r in keys_store.usage()}["w"]
    assert ledger["requests"] >= len(answered)
    assert ledger["completion_tokens"] >= sum(answered)
    assert set(appended) <= stored
    assert keys_store.list() == keys_before   # keys intact (the revoked one still revoked)

    # restarted on the same store (its gateway; the model need not finish loading): the key
    # works, the revoked one does not, the conversation is whole
    srv = ModelServer(tmp_path, "--max-model-len", "256", *extra)
    try:
        srv.start(wait_for_model=False)
        assert httpx.get(srv.base_url + "/v1/models", headers=hdr(keys["w"]), timeout=60).status_code == 200
        assert httpx.get(srv.base_url + "/v1/models", headers=hdr(keys["gone"]), timeout=60).status_code == 401
        got = httpx.get(srv.base_url + f"/v1/kvserve/conversations/{conv}", headers=hdr(keys["w"]), timeout=60)
        assert len(got.json()["messages"]) == len(stored)
    finally:
        srv.stop()
        keys_store.close()


def test_sigterm_finishes_the_stream_then_exits_0(tmp_path, model_server):
    keys = make_keys(tmp_path, "t")
    srv = model_server(tmp_path, "--max-model-len", "256", "--shutdown-grace", "120")
    chunks: list[dict] = []
    with httpx.Client(timeout=120) as http, http.stream(
            "POST", srv.base_url + "/v1/chat/completions", headers=hdr(keys["t"]),
            json={"messages": HELLO, "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                break
        srv.proc.send_signal(signal.SIGTERM)
        done = False
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    assert done and chunks[-1]["usage"]["completion_tokens"] == 24
    assert srv.proc.wait(timeout=120) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.base_url + "/health", timeout=5)
    ledger = {r["key_name"]: r for r in KeyStore(tmp_path / "kvserve.db").usage()}["t"]
    assert ledger["requests"] == 1 and ledger["completion_tokens"] == 24


def engine_children(pid: int) -> list[int]:
    out = []
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"kvserve.engine.process" in cmd:
            out.append(int(d.name))
    return out


def test_engine_process_killed_is_a_retryable_503_and_restarted(tmp_path, model_server):
    keys = make_keys(tmp_path, "e")
    srv = model_server(tmp_path, "--max-model-len", "512", engine="process")
    [engine_pid] = engine_children(srv.proc.pid)
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, srv.base_url + "/v1/chat/completions", headers=hdr(keys["e"]),
                          json={"messages": HELLO, "max_tokens": 400, "ignore_eos": True, "temperature": 0}, timeout=300)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:   # until the request runs in the engine
            text = httpx.get(srv.base_url + "/metrics", headers=hdr(keys["e"]), timeout=60).text
            if any(line.startswith("kvserve:num_requests_running") and not line.endswith(" 0.0")
                   for line in text.splitlines()):
                break
            time.sleep(0.05)
        os.kill(engine_pid, signal.SIGKILL)
        r = fut.result()
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] and r.json()["error"]["code"] == "engine_error"
    seen = set()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        h = httpx.get(srv.base_url + "/health", timeout=30)
        seen.add(h.json()["status"])
        if h.status_code == 200:
            break
        time.sleep(0.2)
    assert h.status_code == 200 and "loading" in seen, seen
    [new_pid] = engine_children(srv.proc.pid)
    assert new_pid != engine_pid
    r = httpx.post(srv.base_url + "/v1/chat/completions", headers=hdr(keys["e"]),
                   json={"messages": HELLO, "max_tokens": 2}, timeout=300)
    assert r.status_code == 200, r.text


def test_kv_exhaustion_preempts_and_outputs_match_an_unloaded_run(tmp_path, model_server):
    keys = make_keys(tmp_path, "k")
    per_block = 2 * 16 * 3 * 64 * 2 * 30     # fp16 K and V, 16 tokens, 3 KV heads x 64, 30 layers (SmolLM2)
    srv = model_server(tmp_path, "--max-model-len", "256", "--kv-cache-memory", str(24 * per_block))
    url = srv.base_url + "/v1/completions"
    prompts = [f"Story {i}: once upon a time, in a village by the {w}," for i, w in
               enumerate(["sea", "forest", "river", "mountain", "desert", "lake"])]

    def complete(prompt: str) -> httpx.Response:
        return httpx.post(url, headers=hdr(keys["k"]), timeout=600,
                          json={"prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True})

    alone = [complete(p).json()["choices"][0]["text"] for p in prompts]   # one at a time: no pressure
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(complete, prompts))                      # 6 x ~80 tokens > 24 x 16
    assert [r.status_code for r in together] == [200] * len(prompts)
    assert [r.json()["choices"][0]["text"] for r in together] == alone
    text = httpx.get(srv.base_url + "/metrics", headers=hdr(keys["k"]), timeout=60).text
    preemptions = [float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("kvserve:num_preemptions") and not line.startswith("#")]
    assert preemptions and max(preemptions) > 0, text[:2000]
    used = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvserve:kv_cache_usage_perc")]
    assert used == [0.0]
    # n sequences that could never be resident at once (prompt + 8 x 64 > 24 x 16 tokens): a clear 400
    r = httpx.post(url, headers=hdr(keys["k"]), timeout=60, json={"prompt": prompts[0], "max_tokens": 64, "n": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "KV cache" in r.json()["error"]["message"]
