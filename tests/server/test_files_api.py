"""/v1/files and /v1/batches at the gateway (no model; SQLite, then PostgreSQL), with the `openai` client: per-key ownership
on every route, the key's request bucket on every route (with rerank's and score's), the upload
cap and quota, line checks, and a batch cancelled while it waits for the model (the runner
answers nothing it was not asked)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from client_api_server import NO_CLIENT_WARNINGS, no_client_warnings  # noqa: F401 (an autouse fixture)
from servers import InProcessServer

from kvserve.server.settings import ServerSettings
from kvserve.server.stores.keys import KeyStore

# every route of the two APIs, and the encoder's (rerank, score); one key limited to 1 request/minute each
LIMITED = (("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", "/v1/files/file-x"), ("GET", "/v1/files/file-x/content"),
           ("DELETE", "/v1/files/file-x"), ("GET", "/v1/batches"), ("POST", "/v1/batches"),
           ("GET", "/v1/batches/batch_x"), ("POST", "/v1/batches/batch_x/cancel"), ("POST", "/v1/rerank"),
           ("POST", "/v2/rerank"), ("POST", "/rerank"), ("POST", "/v1/score"))

pytestmark = NO_CLIENT_WARNINGS


def jsonl(n: int, url: str = "/v1/chat/completions") -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url,
                               "body": {"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 4}})
                   + "\n" for i in range(n)).encode()


@pytest.fixture(scope="module", params=("sqlite", "postgres"))
def server(request, tmp_path_factory):
    """The gateway on the embedded stores, then with every store in PostgreSQL."""
    data_dir = tmp_path_factory.mktemp("files")
    url = request.getfixturevalue("postgres_server").new_database() if request.param == "postgres" else None
    store = KeyStore(url or data_dir / "kvserve.db")
    keys = {"a": store.create("tenant-a"), "b": store.create("tenant-b"), "q": store.create("quota")}
    keys |= {route: store.create(f"limited{i}", rpm=1) for i, route in enumerate(LIMITED)}
    store.close()
    settings = ServerSettings(load_model=False, data_dir=data_dir, file_max_bytes=4000, file_quota_count=3,
                              database_url=url)
    with InProcessServer(settings) as srv:
        srv.keys = keys
        yield srv


def client(server, who: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.keys[who], max_retries=0)


def test_upload_list_retrieve_content_delete(server):
    a = client(server, "a")
    f = a.files.create(file=("in.jsonl", jsonl(3)), purpose="batch")
    assert (f.object, f.purpose, f.filename, f.bytes, f.status) == ("file", "batch", "in.jsonl", len(jsonl(3)),
                                                                    "processed")
    assert a.files.retrieve(f.id).bytes == f.bytes
    assert a.files.content(f.id).content == jsonl(3)
    assert f.id in [x.id for x in a.files.list(purpose="batch")]
    assert a.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(f.id)


def test_another_key_sees_nothing(server):
    a, b = client(server, "a"), client(server, "b")
    f = a.files.create(file=("in.jsonl", jsonl(2)), purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id), lambda: b.files.delete(f.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h"),
                 lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in b.files.list()]
    assert batch.id not in [x.id for x in b.batches.list()]
    assert a.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    for method, path in (("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", f"/v1/files/{f.id}"),
                         ("GET", f"/v1/files/{f.id}/content"), ("DELETE", f"/v1/files/{f.id}"),
                         ("GET", "/v1/batches"), ("POST", "/v1/batches"), ("GET", f"/v1/batches/{batch.id}"),
                         ("POST", f"/v1/batches/{batch.id}/cancel"), ("POST", "/v1/rerank"), ("POST", "/v2/rerank"),
                         ("POST", "/rerank"), ("POST", "/v1/score")):
        assert httpx.request(method, server.base_url + path).status_code == 401, path   # no key


def test_list_pages_clamp_the_limit_and_follow_the_cursor(server):
    b = client(server, "b")
    made = [b.files.create(file=(f"p{i}.jsonl", jsonl(1)), purpose="user_data").id for i in range(2)]
    url, auth = server.base_url + "/v1/files", {"Authorization": f"Bearer {server.keys['b']}"}
    seen, after = [], None
    while True:   # limit 0 is clamped to 1: one file a page, `after` the cursor
        r = httpx.get(url, params={"purpose": "user_data", "order": "asc", "limit": 0,
                                   **({"after": after} if after else {})}, headers=auth).json()
        assert len(r["data"]) == 1 and r["first_id"] == r["last_id"] == r["data"][0]["id"]
        seen.append(after := r["last_id"])
        if not r["has_more"]:
            break
    assert seen == made
    whole = httpx.get(url, params={"purpose": "user_data", "limit": 2}, headers=auth).json()
    assert [f["id"] for f in whole["data"]] == made[::-1] and not whole["has_more"]
    for f in made:
        b.files.delete(f)


def test_size_cap_quota_and_line_checks(server):
    q = client(server, "q")
    with pytest.raises(openai.APIStatusError) as e:
        q.files.create(file=("big.jsonl", jsonl(40)), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    bad = {b'{"custom_id": "x"}\n': "url", b"not json\n": "JSON", b"": "no requests",
           jsonl(1) + jsonl(1): "repeats custom_id"}
    for content, words in bad.items():
        with pytest.raises(openai.BadRequestError) as e:
            q.files.create(file=("bad.jsonl", content), purpose="batch")
        assert words in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        q.files.create(file=("x.jsonl", jsonl(1)), purpose="fine-tune")
    ids = [q.files.create(file=(f"{i}.jsonl", jsonl(1)), purpose="batch").id for i in range(3)]
    with pytest.raises(openai.APIStatusError) as e:
        q.files.create(file=("4.jsonl", jsonl(1)), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "storage_quota_exceeded"
    q.files.delete(ids[0])
    q.files.create(file=("4.jsonl", jsonl(1)), purpose="user_data")
    with pytest.raises(openai.BadRequestError):   # not a batch file
        q.batches.create(input_file_id=q.files.list(purpose="user_data").data[0].id,
                         endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        q.batches.create(input_file_id=ids[1], endpoint="/v1/responses", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        q.batches.create(input_file_id=ids[1], endpoint="/v1/chat/completions", completion_window="1h")
    r = httpx.post(server.base_url + "/v1/files", json={"purpose": "batch"},
                   headers={"Authorization": f"Bearer {server.keys['q']}"})
    assert r.status_code == 400


def poll(c: openai.OpenAI, batch_id: str, until: tuple[str, ...], timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in until or time.monotonic() > deadline:
            return b
        time.sleep(0.2)


def test_a_batch_for_the_wrong_endpoint_fails_and_cancel_stops_one(server):
    a = client(server, "a")
    f = a.files.create(file=("e.jsonl", jsonl(2, url="/v1/embeddings")), purpose="batch")
    b = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"job": "wrong"})
    b = poll(a, b.id, ("failed",))
    assert b.status == "failed" and b.errors.data[0].code == "invalid_url" and b.errors.data[0].line == 1
    assert b.metadata == {"job": "wrong"}
    f = a.files.create(file=("c.jsonl", jsonl(3)), purpose="batch")   # no model: lines wait for it
    b = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    poll(a, b.id, ("in_progress",))
    assert a.batches.cancel(b.id).status == "cancelling"
    b = poll(a, b.id, ("cancelled",))
    assert b.status == "cancelled" and b.request_counts.total == 3 and b.request_counts.completed == 0
    assert b.output_file_id is None and b.cancelled_at
    listed = a.batches.list(limit=1)
    assert listed.data[0].id == b.id and listed.has_more


def test_openapi_covers_the_new_routes(server):
    doc = httpx.get(server.base_url + "/openapi.json").json()
    paths = doc["paths"]
    for path in ("/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches",
                 "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel", "/v1/rerank", "/v2/rerank", "/v1/score"):
        assert path in paths, path
    assert "multipart/form-data" in paths["/v1/files"]["post"]["requestBody"]["content"]
    body = paths["/v1/batches"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/BatchRequest"}
    assert "application/octet-stream" in paths["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]
    assert {"query", "documents", "top_n"} <= set(doc["components"]["schemas"]["RerankRequest"]["properties"])
    assert {"text_1", "text_2"} <= set(doc["components"]["schemas"]["ScoreRequest"]["properties"])


@pytest.mark.parametrize(("method", "path"), LIMITED)
def test_rate_limit_per_route(server, method, path):
    """The key's request bucket applies on every route: the second request of a 1/minute key is a 429
    in OpenAI's shape with Retry-After, whatever the first one answered."""
    headers = {"Authorization": f"Bearer {server.keys[(method, path)]}"}
    first = httpx.request(method, server.base_url + path, headers=headers, timeout=60)
    assert first.status_code in (200, 400, 404, 422), first.text
    second = httpx.request(method, server.base_url + path, headers=headers, timeout=60)
    assert second.status_code == 429 and second.headers["retry-after"], second.text
    assert second.json()["error"]["type"] == "rate_limit_error"
