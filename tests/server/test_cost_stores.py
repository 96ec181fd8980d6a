"""Issue 49.4: the stores a key can write have per-owner quotas (count, bytes, expiry), a stored
response's `metadata` has OpenAI's caps, and an arena vote needs both answers generated. Each
store's quota runs on SQLite and PostgreSQL (the one rule in stores/quota.py)."""

from __future__ import annotations

import pathlib
import sys
import time

import httpx
import pytest
from servers import InProcessServer

from kvserve.server.settings import ServerSettings
from kvserve.server.stores.arena import ArenaStore
from kvserve.server.stores.quota import QuotaExceeded, QuotaLimits
from kvserve.server.stores.responses import ResponseNotFound, ResponseStore

ALICE = {"X-KVServe-Client": "cost-alice-00001"}


@pytest.fixture(params=("sqlite", "postgres"))
def where(request, tmp_path):
    if request.param == "postgres":
        return request.getfixturevalue("postgres_server").new_database()
    return tmp_path / "kvserve.db"


def test_stored_responses_have_a_count_bytes_and_expiry_quota(where):
    store = ResponseStore(where, QuotaLimits(max_items=3, max_bytes=4000, ttl_s=3600))
    try:
        for i in range(3):
            store.put("key:a", {"id": f"resp_{i}"}, [{"role": "user", "content": "hi"}])
        with pytest.raises(QuotaExceeded) as e:
            store.put("key:a", {"id": "resp_3"}, [])
        assert e.value.status == 413 and "3 stored responses" in e.value.message
        store.put("key:a", {"id": "resp_2", "v": 2}, [])        # replacing one is not one more
        store.put("key:b", {"id": "resp_b"}, [])                # another owner has their own quota
        store.delete("key:a", "resp_0")
        with pytest.raises(QuotaExceeded, match="bytes"):
            store.put("key:a", {"id": "resp_big"}, [{"role": "user", "content": "x" * 5000}])
        store.quota.limits = QuotaLimits(ttl_s=0.2)             # OpenAI's 30 days, shortened
        time.sleep(0.3)
        with pytest.raises(ResponseNotFound):
            store.get("key:a", "resp_1")
        store.put("key:a", {"id": "resp_new"}, [])               # the write drops the expired rows
        assert store.get("key:a", "resp_new") == {"id": "resp_new"}
    finally:
        store.close()


def test_open_arena_battles_have_a_quota_and_votes_need_both_answers(where):
    store = ArenaStore(where, QuotaLimits(max_items=2, max_bytes=10_000, ttl_s=3600))
    try:
        a = store.create("o", "p", "x", "y")
        store.create("o", "p", "x", "y")
        with pytest.raises(QuotaExceeded):
            store.create("o", "p", "x", "y")
        with pytest.raises(QuotaExceeded, match="bytes"):
            store.create("p", "p" * 10_001, "x", "y")
        store.answered(a, "a")
        with pytest.raises(Exception) as e:
            store.vote("o", a, "a")
        assert e.value.status == 409
        store.answered(a, "b")
        assert store.vote("o", a, "a")["winner"] == "a"
        store.create("o", "p", "x", "y")      # a voted battle is no longer an open one
        store.record("import", "x", "y", "tie")   # imports vote at once (and hold no open battle)
        assert len(store.votes()) == 2
    finally:
        store.close()


@pytest.fixture(scope="module")
def small_quota_gateway(tmp_path_factory):
    settings = ServerSettings(load_model=False, data_dir=tmp_path_factory.mktemp("cost-stores"),
                              quotas={"arena": "items=2"})
    with InProcessServer(settings) as srv:
        yield srv


@pytest.mark.parametrize(("metadata", "param"), [
    ({"x": "v" * 1_000_000}, "metadata.x"),
    ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ({"k" * 65: "v"}, "metadata"),
    ({"n": 3}, "metadata.n"),
    ("text", "metadata"),
])
def test_response_metadata_has_openai_caps(small_quota_gateway, metadata, param):
    r = httpx.post(small_quota_gateway.base_url + "/v1/responses", json={"input": "hi", "metadata": metadata})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param


def test_arena_battles_past_the_quota_are_refused_over_http(small_quota_gateway):
    url = small_quota_gateway.base_url + "/v1/kvserve/arena/battles"
    codes = [httpx.post(url, json={"prompt": "Name a colour."}, headers=ALICE).status_code for _ in range(3)]
    assert codes == [200, 200, 413]
    battle = httpx.post(url, json={"prompt": "x"}, headers={"X-KVServe-Client": "cost-bob-00000001"}).json()
    r = httpx.post(f"{url}/{battle['id']}/vote", json={"winner": "a"}, headers={"X-KVServe-Client": "cost-bob-00000001"})
    assert r.status_code == 409


def test_quota_flags_parse():
    q = QuotaLimits.parse("items=5,bytes=2MiB,ttl=30d", QuotaLimits(max_items=1, max_bytes=1))
    assert q == QuotaLimits(max_items=5, max_bytes=2 << 20, ttl_s=30 * 86400.0)
    assert QuotaLimits.parse("ttl=none", q).ttl_s is None
    assert ServerSettings(quotas={"responses": "items=7"}).quota("responses").max_items == 7
    with pytest.raises(Exception, match="quota"):
        QuotaLimits.parse("items=many")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "model"))
    from ggufmaker import make_tiny_llama_gguf

    root = tmp_path_factory.mktemp("cost-tiny")
    tiny = make_tiny_llama_gguf(root / "tiny.gguf", ctx=1024)
    settings = ServerSettings(model=str(tiny), served_model_name="tiny", data_dir=root, semantic_cache=False)
    with InProcessServer(settings) as s:
        deadline = time.monotonic() + 120
        while httpx.get(s.base_url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the tiny model did not load"
            time.sleep(0.1)
        yield s


def test_a_vote_counts_once_both_answers_were_streamed(tiny_server):
    url = tiny_server.base_url + "/v1/kvserve/arena/battles"
    battle = httpx.post(url, json={"prompt": "Name a colour."}, headers=ALICE).json()["id"]

    def answer(side: str) -> None:
        with httpx.stream("POST", f"{url}/{battle}/answers/{side}", headers=ALICE, timeout=120) as r:
            assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")

    answer("b")
    assert httpx.post(f"{url}/{battle}/vote", json={"winner": "b"}, headers=ALICE).status_code == 409
    answer("a")   # the vote right after the stream's last byte
    assert httpx.post(f"{url}/{battle}/vote", json={"winner": "b"}, headers=ALICE).status_code == 200
