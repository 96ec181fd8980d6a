"""Models on demand (`--models-dir`): loaded by the first request naming them, unloaded when idle
or to make room, within a memory budget (server/routing/residency.py).

One real server on loopback serves a directory of three models: the default Q4_1 GGUF, a copy of
it under another name, and the same model dequantized to an fp32 Hugging Face directory (another
format, another size), with a memory budget that holds any two of them and never all three. No
model is pinned, so the server is healthy at once and loads nothing until asked.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import time

import httpx
import ollama
import pytest
from servers import ModelServer

KV = "64MiB"
NAMES = ("alpha", "bravo", "fp32")
CHAT = {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 4, "temperature": 0}


def _models_dir(root):
    from kvserve.model.registry import resolve
    from kvserve.train.quantize import dequantize_to_hf

    src = resolve(None).path
    d = root / "models"
    d.mkdir()
    (d / "alpha.gguf").symlink_to(src)
    shutil.copyfile(src, d / "bravo.gguf")
    dequantize_to_hf(None, d / "fp32")
    return d


def _budget(d) -> int:
    """Room for the two largest models, not for all three (sizes as the server counts them)."""
    from kvserve.server.routing.residency import model_bytes

    sizes = sorted(model_bytes(str(p), {"kv_cache_memory": KV}) for p in d.iterdir())
    return sizes[-1] + sizes[-2] + sizes[0] // 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("on-demand")
    d = _models_dir(root)
    config = root / "models.json"
    config.write_text(json.dumps({"models_dir": str(d), "models_memory": _budget(d), "keep_alive": -1}))
    srv = ModelServer(root, "--models-config", str(config), "--kv-cache-memory", KV)
    srv.start()
    yield srv
    srv.stop()


def _states(base: str) -> dict[str, str]:
    cards = httpx.get(base + "/v1/models", timeout=30).json()["data"]
    return {c["id"]: c["kvserve_state"] for c in cards if "kvserve_state" in c}


def _metric(base: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        m = re.match(rf"{re.escape(name)}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _chat(base: str, model: str, timeout: float = 300) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=CHAT | {"model": model}, timeout=timeout)


def _until(check, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def _unload_all(base: str) -> None:
    for name in NAMES:
        r = httpx.post(base + "/api/generate", json={"model": name, "keep_alive": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
    _until(lambda: set(_states(base).values()) == {"unloaded"})


def test_nothing_loaded_at_start_and_all_listed(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert _states(server.base_url) == dict.fromkeys(NAMES, "unloaded")
    tags = {m["name"] for m in httpx.get(server.base_url + "/api/tags", timeout=120).json()["models"]}   # hashes files once
    assert set(NAMES) <= tags
    assert httpx.get(server.base_url + "/api/ps").json()["models"] == []


def test_three_models_in_a_budget_for_two(server):
    base = server.base_url
    _unload_all(base)
    loads0, evicted0 = _metric(base, "kvserve:model_loads_total"), _metric(base, "kvserve:model_unloads_total",
                                                                          reason="evicted")
    for name in NAMES * 2:
        r = _chat(base, name)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        states = _states(base)
        assert states[name] == "loaded"
        assert sum(s == "loaded" for s in states.values()) <= 2, states
        assert _metric(base, "kvserve:models_loaded") <= 2
    # a, b, c (evicts a), a (evicts b), b (evicts c), c (evicts a): every turn after the second loads
    assert _metric(base, "kvserve:model_loads_total") - loads0 == 6
    assert _metric(base, "kvserve:model_unloads_total", reason="evicted") - evicted0 == 4
    assert _metric(base, "kvserve:model_load_seconds_count") >= 6


def test_keep_alive_zero_unloads(server):
    base = server.base_url
    r = httpx.post(base + "/api/generate", json={"model": "alpha"}, timeout=300)      # Ollama's preload
    assert r.json()["done_reason"] == "load"
    assert _states(base)["alpha"] == "loaded"
    r = httpx.post(base + "/api/generate", json={"model": "alpha", "keep_alive": 0}, timeout=60)
    assert r.json()["done_reason"] == "unload"
    assert _states(base)["alpha"] == "unloaded"
    # a generation with keep_alive 0: answered, then unloaded
    r = httpx.post(base + "/api/chat", json={"model": "alpha", "stream": False, "keep_alive": 0,
                                             "messages": CHAT["messages"], "options": {"num_predict": 4}},
                   timeout=300)
    assert r.status_code == 200, r.text
    _until(lambda: _states(base)["alpha"] == "unloaded")
    ps = httpx.post(base + "/api/generate", json={"model": "alpha", "keep_alive": "bad"}, timeout=60)
    assert ps.status_code == 400


def test_concurrent_first_requests_load_once_and_wait(server):
    base = server.base_url
    _unload_all(base)
    before = _metric(base, "kvserve:model_loads_total", model_name="bravo")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = pool.submit(_chat, base, "bravo")
        _until(lambda: _states(base)["bravo"] != "unloaded" or first.done())
        rest = [pool.submit(_chat, base, "bravo") for _ in range(3)]    # sent while it loads: they wait
        answers = [f.result() for f in [first, *rest]]
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert _metric(base, "kvserve:model_loads_total", model_name="bravo") - before == 1


def test_ollama_client(server):
    client = ollama.Client(host=server.base_url, timeout=300)
    assert set(NAMES) <= {m.model for m in client.list().models}
    r = client.chat(model="fp32:latest", messages=CHAT["messages"], options={"num_predict": 4}, keep_alive="10m")
    assert r.done
    assert "fp32" in {m.model for m in client.ps().models}
    assert client.generate(model="fp32", prompt="", keep_alive=0).done_reason == "unload"
    assert "fp32" not in {m.model for m in client.ps().models}
    r = client.generate(model="alpha", prompt="Say hi.", options={"num_predict": 4}, keep_alive=-1)
    assert r.done and r.response is not None
    # num_ctx caps the answer by the model's window, so it needs the model: an unloaded one loads first
    assert client.generate(model="bravo", prompt="", keep_alive=0).done_reason == "unload"
    r = client.chat(model="bravo", messages=CHAT["messages"], options={"num_predict": 4, "num_ctx": 256},
                    keep_alive="10m")
    assert r.done and r.message.content is not None
    assert "bravo" in {m.model for m in client.ps().models}
    ps = {m.model: m for m in client.ps().models}
    # alpha: keep_alive -1, "forever", clamped to --keep-alive-max (1 h; issue 60): later than bravo's 10 m
    assert ps["bravo"].expires_at < ps["alpha"].expires_at and ps["alpha"].expires_at.year < 2300


def test_a_request_waits_for_the_load_then_gets_503(tmp_path):
    """Past the load timeout a request is a 503 with Retry-After; the load goes on and a retry is served."""
    from kvserve.model.registry import resolve

    d = tmp_path / "models"
    d.mkdir()
    (d / "solo.gguf").symlink_to(resolve(None).path)
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models_dir": str(d), "model_load_timeout": 0.001}))
    srv = ModelServer(tmp_path, "--models-config", str(config), "--kv-cache-memory", KV)
    try:
        srv.start()
        r = _chat(srv.base_url, "solo")
        assert r.status_code == 503 and r.headers["Retry-After"], r.text
        assert r.json()["error"]["code"] == "model_not_ready"
        _until(lambda: _states(srv.base_url)["solo"] == "loaded", timeout=300)
        assert _chat(srv.base_url, "solo").status_code == 200
        assert _chat(srv.base_url, "").json()["model"] == "solo"     # the first model is the default
    finally:
        srv.stop()


def test_engine_process_models_load_and_unload(tmp_path):
    """With --engine-process each model on demand is an engine process: started at first use,
    stopped when unloaded, started again by the next request."""
    from kvserve.model.registry import resolve

    d = tmp_path / "models"
    d.mkdir()
    (d / "solo.gguf").symlink_to(resolve(None).path)
    srv = ModelServer(tmp_path, "--models-dir", str(d), "--kv-cache-memory", KV, "--keep-alive", "1h",
                      engine="process")
    try:
        srv.start()
        base = srv.base_url
        assert _chat(base, "solo").status_code == 200
        assert _states(base)["solo"] == "loaded"
        r = httpx.post(base + "/api/chat", json={"model": "solo", "messages": [], "keep_alive": 0}, timeout=60)
        assert r.json()["done_reason"] == "unload"
        assert _states(base)["solo"] == "unloaded"
        assert _chat(base, "solo").status_code == 200
        assert _metric(base, "kvserve:model_loads_total", model_name="solo") == 2
    finally:
        srv.stop()


def test_a_model_answering_is_never_evicted(tmp_path):
    """Budget for one model: a request for the second while the first streams waits for that
    stream's end, then loads in its place; the stream is whole."""
    from kvserve.model.registry import resolve
    from kvserve.server.routing.residency import model_bytes

    d = tmp_path / "models"
    d.mkdir()
    for name in ("one", "two"):
        (d / f"{name}.gguf").symlink_to(resolve(None).path)
    size = model_bytes(str(d / "one.gguf"), {"kv_cache_memory": KV})
    srv = ModelServer(tmp_path, "--models-dir", str(d), "--kv-cache-memory", KV, "--models-memory", str(size * 3 // 2),
                      "--keep-alive", "-1")
    try:
        srv.start()
        base = srv.base_url
        body = CHAT | {"model": "one", "max_tokens": 48, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=300) as c, c.stream("POST", base + "/v1/chat/completions", json=body) as stream, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))     # "one" is answering
            second = pool.submit(_chat, base, "two")     # waits: evicting "one" would cut this stream
            rest = [line for line in lines if line.startswith("data: ")]
            assert second.result().status_code == 200, second.result().text
        chunks = [json.loads(x[6:]) for x in [first, *rest] if x != "data: [DONE]"]
        assert "error" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(bool(c["choices"][0]["delta"].get("content")) for c in chunks) > 1
        assert _states(base) == {"one": "unloaded", "two": "loaded"}
        assert _metric(base, "kvserve:model_unloads_total", model_name="one", reason="evicted") == 1
    finally:
        srv.stop()
