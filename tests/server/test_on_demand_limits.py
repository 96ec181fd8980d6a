"""Models on demand under the chat routes' limits (issue 60): a refused request neither loads nor
pins a model, keep_alive is finite and only the operator shortens it, lookups load nothing, and a
file that fails to load says so without the server's paths and is not retried at once.

One real server on loopback serves a directory of two models (`alpha`, `beta`: the default GGUF
under two names) with a memory budget for one of them and a 2 s keep-alive, so a model pinned by
a leaked hold would block every load of the other. Keys: `tight` (1,000 tokens a minute),
`tenant` (no limit) and the operator's `--api-key`.
"""

from __future__ import annotations

import time

import httpx
import pytest
from servers import ModelServer

KV = "64MiB"
OPERATOR = "operator-secret-key"
CHAT = {"messages": [{"role": "user", "content": "Name one colour."}], "max_tokens": 4, "temperature": 0}
LONG = " ".join(["colour"] * 60)     # about 60 prompt tokens
LOADS = 3                            # loads a minute per key on the `limited` server (`loader` goes past it)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Loads per key effectively unlimited: the other tests load and unload all along (a fast run
    loads more than a few times a minute with one key)."""
    yield from _serve(tmp_path_factory, 1000)


@pytest.fixture()
def limited(tmp_path_factory):
    yield from _serve(tmp_path_factory, LOADS)


def _serve(tmp_path_factory, loads: int):
    from kvserve.model.registry import resolve
    from kvserve.server.routing.residency import model_bytes
    from kvserve.server.stores.keys import KeyStore

    root = tmp_path_factory.mktemp("on-demand-limits")
    d = root / "models"
    d.mkdir()
    src = resolve(None).path
    for name in ("alpha", "beta"):
        (d / f"{name}.gguf").symlink_to(src)
    (d / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 64)     # a file that cannot load
    store = KeyStore(root / "kvserve.db")
    keys = {"tight": store.create("tight", tpm=1000), "tenant": store.create("tenant"),
            "loader": store.create("loader")}
    store.close()
    budget = int(model_bytes(str(src), {"kv_cache_memory": KV}) * 1.5)     # one model, never two
    srv = ModelServer(root, "--models-dir", str(d), "--models-memory", str(budget), "--keep-alive", "2s",
                      "--kv-cache-memory", KV, "--max-model-len", "1024", "--api-key", OPERATOR,
                      "--model-loads-per-minute", str(loads))
    srv.start()
    srv.keys = keys | {"operator": OPERATOR}
    srv.dir = d
    yield srv
    srv.stop()


def _auth(server, who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.keys[who]}"}


def _states(server) -> dict[str, str]:
    cards = httpx.get(server.base_url + "/v1/models", headers=_auth(server, "operator"), timeout=30).json()["data"]
    return {c["id"]: c["kvserve_state"] for c in cards if "kvserve_state" in c}


def _until(check, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def _chat(server, who: str, model: str, timeout: float = 300, **extra) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", json=CHAT | {"model": model} | extra,
                      headers=_auth(server, who), timeout=timeout)


def _unloaded(server, model: str = "alpha") -> None:
    _until(lambda: _states(server)[model] == "unloaded", timeout=60)


# ---- finding 1 and 2: a refusal gives back what it took, and a refusal by a gate loads nothing ----

REFUSED_BEFORE_LOAD = {
    "tpm: max_tokens past the key's bucket (429)": ("tight", {"max_tokens": 2000}, 429),
    "caps: temperature out of range (400)": ("tenant", {"temperature": 50}, 400),
    "caps: too many sequences (400)": ("tenant", {"n": 10_000}, 400),
}


@pytest.mark.parametrize("kind", list(REFUSED_BEFORE_LOAD))
def test_a_request_refused_by_a_gate_loads_nothing(server, kind):
    _unloaded(server)
    who, extra, status = REFUSED_BEFORE_LOAD[kind]
    r = _chat(server, who, "alpha", **extra)
    assert r.status_code == status, r.text
    assert _states(server)["alpha"] == "unloaded"


REFUSED_AFTER_LOAD = {
    # passes the bound (920 <= 1000) but prompt (~90) + max_tokens does not fit: the lease's reservation
    "tpm: prompt + max_tokens past the key's bucket (429, the lease)": (
        "tight", {"max_tokens": 920, "messages": [{"role": "user", "content": LONG}]}, 429),
    "context: the prompt does not fit the window (400)": (
        "tenant", {"max_tokens": 4, "messages": [{"role": "user", "content": " ".join(["colour"] * 1500)}]}, 400),
    "kv budget / sampling: max_tokens past the window (400)": ("tenant", {"max_tokens": 5000}, 400),
}


@pytest.mark.parametrize("kind", list(REFUSED_AFTER_LOAD))
def test_a_refusal_after_the_load_does_not_pin_the_model(server, kind):
    """The reproduced hang: alpha refused after its load must still expire with its keep-alive,
    and a request for beta (no room for both) must then be answered."""
    _unloaded(server)
    who, extra, status = REFUSED_AFTER_LOAD[kind]
    r = _chat(server, who, "alpha", **extra)
    assert r.status_code == status, r.text
    _unloaded(server, "alpha")                      # keep-alive 2 s: unloaded, not pinned
    r = _chat(server, "operator", "beta", timeout=120)
    assert r.status_code == 200, r.text
    _unloaded(server, "beta")


def test_a_client_that_hangs_up_does_not_pin_the_model(server):
    _unloaded(server)
    body = CHAT | {"model": "alpha", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body,
                      headers=_auth(server, "operator"), timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_lines())                         # the stream started: hang up now
    _unloaded(server, "alpha")
    assert _chat(server, "operator", "beta", timeout=120).status_code == 200


# ---- finding 2: keep_alive finite, clamped, and only the operator shortens it -------------

@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_keep_alive_must_be_finite(server, bad):
    raw = f'{{"model": "alpha", "prompt": "hi", "stream": false, "keep_alive": {bad}}}'
    r = httpx.post(server.base_url + "/api/generate", content=raw, headers=_auth(server, "tenant") |
                   {"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert httpx.get(server.base_url + "/api/ps", headers=_auth(server, "tenant"), timeout=30).status_code == 200


def test_a_huge_keep_alive_is_clamped_and_ps_still_answers(server):
    r = httpx.post(server.base_url + "/api/generate", json={"model": "alpha", "keep_alive": 1e12},
                   headers=_auth(server, "tenant"), timeout=300)
    assert r.status_code == 200, r.text
    ps = httpx.get(server.base_url + "/api/ps", headers=_auth(server, "tenant"), timeout=30)
    assert ps.status_code == 200, ps.text
    (alpha,) = [m for m in ps.json()["models"] if m["name"].startswith("alpha")]
    assert alpha["expires_at"]
    r = httpx.post(server.base_url + "/api/generate", json={"model": "alpha", "keep_alive": 0},
                   headers=_auth(server, "operator"), timeout=60)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
    _unloaded(server)


def test_only_the_operator_unloads_a_shared_model(server):
    assert _chat(server, "tenant", "alpha").status_code == 200
    r = httpx.post(server.base_url + "/api/generate", json={"model": "alpha", "keep_alive": 0},
                   headers=_auth(server, "tight"), timeout=60)
    assert r.status_code == 403, r.text
    assert "api-key" in r.text
    # a tenant's keep_alive lengthens (up to the maximum), never shortens
    r = httpx.post(server.base_url + "/api/chat", json={"model": "alpha", "keep_alive": "10m", "stream": False,
                   "messages": CHAT["messages"], "options": {"num_predict": 2}}, headers=_auth(server, "tenant"),
                   timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(server.base_url + "/api/chat", json={"model": "alpha", "keep_alive": "1s", "stream": False,
                   "messages": CHAT["messages"], "options": {"num_predict": 2}}, headers=_auth(server, "tight"),
                   timeout=120)
    assert r.status_code == 200, r.text
    time.sleep(4)                                    # past both 1 s and the server's 2 s
    assert _states(server)["alpha"] == "loaded"
    r = httpx.post(server.base_url + "/api/generate", json={"model": "alpha", "keep_alive": 0},
                   headers=_auth(server, "operator"), timeout=60)
    assert r.status_code == 200, r.text
    _unloaded(server)


# ---- finding 2: lookups load nothing -----------------------------------------------------

def test_tokenize_and_count_tokens_do_not_load(server):
    _unloaded(server)
    r = httpx.post(server.base_url + "/tokenize", json={"model": "alpha", "prompt": "hi"},
                   headers=_auth(server, "tenant"), timeout=30)
    assert r.status_code == 503, r.text
    r = httpx.post(server.base_url + "/v1/messages/count_tokens", headers=_auth(server, "tenant"), timeout=30,
                   json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 529, r.text            # Anthropic's "overloaded"
    time.sleep(1)
    assert _states(server)["alpha"] == "unloaded"


# ---- finding 2 and 3: a broken file: no paths to the client, no retry storm ---------------

def test_a_broken_file_answers_without_paths_and_backs_off(server):
    r = _chat(server, "tight", "broken", timeout=120)
    assert r.status_code >= 500, r.text
    assert str(server.dir) not in r.text and "/tmp" not in r.text, r.text
    again = _chat(server, "tight", "broken", timeout=120)
    assert again.status_code == 503 and again.headers.get("retry-after"), again.text   # not tried again
    assert str(server.dir) not in again.text



def test_loads_per_key_are_rate_limited(limited):
    """A key cycling through the directory's models (room for one: every request a load and an
    eviction) gets a 429 past its loads a minute; the operator's key does not."""
    statuses = [_chat(limited, "loader", ("alpha", "beta")[i % 2], timeout=120).status_code for i in range(LOADS + 3)]
    assert statuses[:2] == [200, 200] and 429 in statuses, statuses     # refills one load per 20 s; a load cycle is ~5 s
    assert _chat(limited, "operator", "alpha" if statuses and _states(limited)["beta"] == "loaded" else "beta",
                 timeout=120).status_code == 200
