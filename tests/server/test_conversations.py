"""The saved-conversation API through a tiny app that mounts only the page, on each store: a real
SQLite file and a real PostgreSQL database (started by the fixtures)."""

from __future__ import annotations

import sqlite3

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from kvserve.server.api.webui import CLIENT_HEADER, mount_webui
from kvserve.server.stores.conversations import ConversationStore, StoreLimits

ALICE = {CLIENT_HEADER: "browser-alice-0001"}
BOB = {CLIENT_HEADER: "browser-bob-000002"}


class Stores:
    """Opens stores on one backing (a new store on the same backing is a restart)."""

    def __init__(self, backend: str, tmp_path, request):
        self.backend = backend
        self.db_path = tmp_path / "conversations.db"
        self.url = request.getfixturevalue("postgres_server").new_database() if backend == "postgres" else None
        self.opened: list = []

    def open(self, limits: StoreLimits | None = None):
        if self.url is None:
            return None   # mount_webui opens the SQLite store at the path
        store = ConversationStore(self.url, limits)
        self.opened.append(store)
        return store

    def app(self, limits: StoreLimits | None = None) -> FastAPI:
        return make_app(self.db_path, limits, self.open(limits))


@pytest.fixture(params=("sqlite", "postgres"))
def stores(request, tmp_path):
    backing = Stores(request.param, tmp_path, request)
    yield backing
    for store in backing.opened:
        store.close()


def make_app(db_path, limits: StoreLimits | None = None, store=None) -> FastAPI:
    app = FastAPI()

    # Stands in for the server's auth middleware only in what it hands the page: the key name.
    @app.middleware("http")
    async def key_name_from_header(request: Request, call_next):
        request.state.key_name = request.headers.get("x-test-key-name")
        return await call_next(request)

    mount_webui(app, db_path, limits, store=store)
    return app


@pytest.fixture
def client(stores):
    with TestClient(stores.app()) as c:
        yield c


def test_create_list_get_rename_delete(client):
    r = client.post("/v1/kvserve/conversations", json={"title": "  First   chat ", "model": "m"}, headers=ALICE)
    assert r.status_code == 200, r.text
    conv = r.json()
    assert conv["title"] == "First chat" and conv["model"] == "m" and conv["messages"] == []

    listed = client.get("/v1/kvserve/conversations", headers=ALICE).json()["data"]
    assert [c["id"] for c in listed] == [conv["id"]]

    r = client.patch(f"/v1/kvserve/conversations/{conv['id']}", json={"title": "Renamed"}, headers=ALICE)
    assert r.status_code == 200 and r.json()["title"] == "Renamed"
    assert client.get(f"/v1/kvserve/conversations/{conv['id']}", headers=ALICE).json()["title"] == "Renamed"

    r = client.delete(f"/v1/kvserve/conversations/{conv['id']}", headers=ALICE)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert client.get("/v1/kvserve/conversations", headers=ALICE).json()["data"] == []
    assert client.get(f"/v1/kvserve/conversations/{conv['id']}", headers=ALICE).status_code == 404


def test_messages_append_replace_and_traces(client):
    conv = client.post("/v1/kvserve/conversations", json={}, headers=ALICE).json()
    url = f"/v1/kvserve/conversations/{conv['id']}/messages"
    trace = {"timings_ms": {"ttft": 12.5}, "output_tokens": [{"id": 1, "text": "<b>", "prob": 0.5}]}
    client.post(url, json={"messages": [{"role": "user", "content": "hi"}]}, headers=ALICE)
    r = client.post(url, json={"messages": [{"role": "assistant", "content": "one", "trace": trace}]},
                    headers=ALICE)
    # an append answers with what it wrote, not the whole conversation
    assert r.json()["start"] == 1 and r.json()["total"] == 2
    assert [(m["position"], m["role"]) for m in r.json()["messages"]] == [(1, "assistant")]
    assert "one" not in r.text
    got = client.get(f"/v1/kvserve/conversations/{conv['id']}", headers=ALICE).json()["messages"]
    assert [(m["position"], m["role"], m["content"]) for m in got] == [(0, "user", "hi"), (1, "assistant", "one")]
    assert got[1]["trace"] == trace

    # Regenerate: replace the answer at position 1.
    r = client.post(url, json={"start": 1, "messages": [{"role": "assistant", "content": "two",
                                                         "meta": {"stopped": True}}]}, headers=ALICE)
    msgs = client.get(f"/v1/kvserve/conversations/{conv['id']}", headers=ALICE).json()["messages"]
    assert [m["content"] for m in msgs] == ["hi", "two"]
    assert msgs[1]["trace"] is None and msgs[1]["meta"] == {"stopped": True}

    assert client.post(url, json={"start": 5, "messages": []}, headers=ALICE).status_code == 400


def test_owners_are_isolated_by_browser_and_by_key(client):
    conv = client.post("/v1/kvserve/conversations", json={"title": "secret"}, headers=ALICE).json()
    assert client.get("/v1/kvserve/conversations", headers=BOB).json()["data"] == []
    for method in ("get", "delete"):
        assert getattr(client, method)(f"/v1/kvserve/conversations/{conv['id']}", headers=BOB).status_code == 404
    r = client.patch(f"/v1/kvserve/conversations/{conv['id']}", json={"title": "x"}, headers=BOB)
    assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found"

    # With auth on, the key name decides, whatever browser id is sent.
    key_a = {**BOB, "x-test-key-name": "team-a"}
    client.post("/v1/kvserve/conversations", json={"title": "keyed"}, headers=key_a)
    other_browser_same_key = {**ALICE, "x-test-key-name": "team-a"}
    titles = [c["title"] for c in client.get("/v1/kvserve/conversations", headers=other_browser_same_key)
              .json()["data"]]
    assert titles == ["keyed"]
    assert [c["title"] for c in client.get("/v1/kvserve/conversations", headers=BOB).json()["data"]] == []


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "trace": [1]}]}, "messages[0].trace"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [], "start": -1}, "start"),
])
def test_bad_messages_are_rejected_with_the_param(client, body, param):
    conv = client.post("/v1/kvserve/conversations", json={}, headers=ALICE).json()
    r = client.post(f"/v1/kvserve/conversations/{conv['id']}/messages", json=body, headers=ALICE)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_missing_or_bad_client_id_and_bad_json(client):
    assert client.get("/v1/kvserve/conversations").status_code == 400
    r = client.get("/v1/kvserve/conversations", headers={CLIENT_HEADER: "../../etc"})
    assert r.status_code == 400 and r.json()["error"]["param"] == CLIENT_HEADER
    r = client.post("/v1/kvserve/conversations", content=b"{not json", headers=ALICE)
    assert r.status_code == 400
    r = client.post("/v1/kvserve/conversations", json={"title": "x" * 500}, headers=ALICE)
    assert r.status_code == 400 and r.json()["error"]["param"] == "title"


def test_survives_a_restart_and_uses_wal(stores):
    with TestClient(stores.app()) as c:
        conv = c.post("/v1/kvserve/conversations", json={"title": "kept",
                                                            "messages": [{"role": "user", "content": "q"}]},
                      headers=ALICE).json()
    with TestClient(stores.app()) as c:
        got = c.get(f"/v1/kvserve/conversations/{conv['id']}", headers=ALICE).json()
    assert got["title"] == "kept" and got["messages"][0]["content"] == "q"
    if stores.url is None:
        assert sqlite3.connect(stores.db_path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_page_and_assets_are_served_with_a_strict_policy(client):
    r = client.get("/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert '<script type="module" src="/static/app.js"></script>' in r.text
    for asset in ("app.js", "markdown.js", "inspector.js", "style.css"):
        assert client.get(f"/static/{asset}").status_code == 200, asset
    assert "javascript" in client.get("/static/app.js").headers["content-type"]


def test_owner_quota_body_cap_and_json_limits(stores):
    """Per-owner storage quota (413 storage_quota_exceeded; deleting frees it), the body cap (413)
    and the JSON limits (deep nesting, lone surrogates: 400, never a 500)."""
    limits = StoreLimits(max_owner_bytes=10_000, max_body_bytes=50_000)
    with TestClient(stores.app(limits)) as c:
        conv = c.post("/v1/kvserve/conversations", json={}, headers=ALICE).json()
        url = f"/v1/kvserve/conversations/{conv['id']}/messages"
        big = [{"role": "user", "content": "x" * 4000}]
        assert c.post(url, json={"messages": big}, headers=ALICE).status_code == 200
        assert c.post(url, json={"messages": big}, headers=ALICE).status_code == 200
        r = c.post(url, json={"messages": big}, headers=ALICE)
        assert r.status_code == 413 and r.json()["error"]["code"] == "storage_quota_exceeded"
        # another owner has their own quota
        other = c.post("/v1/kvserve/conversations", json={"messages": big}, headers=BOB)
        assert other.status_code == 200, other.text
        # replacing a message frees what it replaced; deleting the conversation frees all of it
        assert c.post(url, json={"start": 1, "messages": big}, headers=ALICE).status_code == 200
        c.delete(f"/v1/kvserve/conversations/{conv['id']}", headers=ALICE)
        conv = c.post("/v1/kvserve/conversations", json={"messages": big + big}, headers=ALICE)
        assert conv.status_code == 200, conv.text

        r = c.post(url, content=b'{"messages": [' + b" " * 60_000 + b"]}", headers=ALICE)
        assert r.status_code == 413 and r.json()["error"]["param"] == "body"
        r = c.post("/v1/kvserve/conversations", content=b'{"title": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                   headers=ALICE)
        assert r.status_code in (400, 413), r.text
        r = c.post("/v1/kvserve/conversations", content=b'{"settings": ' + b'{"a":' * 200 + b"1" + b"}" * 201,
                   headers=ALICE)
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
        r = c.post("/v1/kvserve/conversations", content=b'{"title": "\\ud800"}',
                   headers=ALICE)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_data_files_are_private(tmp_path):
    """The database (keys, usage, conversations) is created 0600 in a folder created 0700."""
    import stat

    data = tmp_path / "data"
    with TestClient(make_app(data / "kvserve.db")) as c:
        c.post("/v1/kvserve/conversations", json={"messages": [{"role": "user", "content": "q"}]}, headers=ALICE)
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
        for f in data.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
