"""Issue 60, files and batches at the gateway (no model; SQLite, then PostgreSQL): what an upload
may cost (parts, lines, concurrent uploads), the lines checked as the interactive route checks a
body, JSONL split on "\\n" only, expiry, the per-key batch quotas and the stored-bytes gauges."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from servers import InProcessServer

from kvserve.server.api.files import UPLOADS_PER_KEY
from kvserve.server.settings import ServerSettings
from kvserve.server.stores.keys import KeyStore

BOUNDARY = "kvservetestboundary"
CT = f"multipart/form-data; boundary={BOUNDARY}"


def form(file: bytes, purpose: str = "batch", extra: dict[str, str] | None = None) -> bytes:
    out = b""
    for name, value in {"purpose": purpose, **(extra or {})}.items():
        out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").encode()
    out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode() + file + f"\r\n--{BOUNDARY}--\r\n".encode()
    return out


def line(i: int, content: str = "hi", url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url,
                       "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 2}},
                      ensure_ascii=False)   # U+2028 and friends raw in the line, as a JSONL writer may leave them


@pytest.fixture(scope="module", params=("sqlite", "postgres"))
def server(request, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("files-limits")
    url = request.getfixturevalue("postgres_server").new_database() if request.param == "postgres" else None
    store = KeyStore(url or data_dir / "kvserve.db")
    keys = {n: store.create(n) for n in ("a", "busy", "quota", "lines", "metrics")}
    store.close()
    settings = ServerSettings(load_model=False, data_dir=data_dir, database_url=url,
                              quotas={"batches": "active=2,lines=5"})
    with InProcessServer(settings) as srv:
        srv.keys = keys
        yield srv


def upload(server, who: str, body: bytes, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/files", content=body, timeout=timeout,
                      headers={"authorization": f"Bearer {server.keys[who]}", "content-type": CT})


def test_a_million_empty_parts_is_refused_at_the_part_cap(server):
    part = f"--{BOUNDARY}\r\n\r\n\r\n".encode()
    body = part * 1_200_000 + f"--{BOUNDARY}--\r\n".encode()
    r = upload(server, "a", body)
    assert r.status_code == 400 and "parts" in r.json()["error"]["message"]


def test_lines_are_checked_like_a_request_body(server):
    surrogate = ('{"custom_id": "r0", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
                 '[{"role": "user", "content": "\\ud800"}]}}\n')
    r = upload(server, "a", form(surrogate.encode()))
    assert r.status_code == 400 and "Line 1" in r.json()["error"]["message"]
    deep = ('{"custom_id": "r0", "method": "POST", "url": "/v1/chat/completions", "body": {"x": '
            + "[" * 100_000 + "]" * 100_000 + "}}\n")
    r = upload(server, "a", form(deep.encode()))
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    long_line = line(0, "x" * (2 << 20)) + "\n"
    r = upload(server, "a", form(long_line.encode()))
    assert r.status_code == 400 and "longer than" in r.json()["error"]["message"]


def test_jsonl_splits_on_newline_only(server):
    text = line(0, "one\u2028two\u0085three\u2029four\x1cfive") + "\n" + line(1) + "\r\n"
    assert len(text.splitlines()) > 2   # what the old split made of it
    r = upload(server, "a", form(text.encode()))
    assert r.status_code == 200, r.text
    got = httpx.get(server.base_url + f"/v1/files/{r.json()['id']}/content",
                    headers={"authorization": f"Bearer {server.keys['a']}"})
    assert got.content == text.encode()


def test_concurrent_uploads_per_key_are_capped(server):
    """UPLOADS_PER_KEY uploads that stall mid-body hold the key's slots: the next one is a 429
    with Retry-After and x-ratelimit-*-uploads; once they are gone a new upload goes through."""
    held = []
    body = form(("\n".join(line(i) for i in range(50)) + "\n").encode())
    try:
        for _ in range(UPLOADS_PER_KEY):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall((f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.keys['busy']}\r\n"
                       f"Content-Type: {CT}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body[:200])
            held.append(s)
        for _ in range(100):   # until both stalled uploads hold their slots
            r = upload(server, "busy", body)
            if r.status_code == 429:
                break
            time.sleep(0.05)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_uploads"
        assert r.headers["retry-after"] and r.headers["x-ratelimit-remaining-uploads"] == "0"
        assert upload(server, "a", body).status_code == 200   # another key is not held up
    finally:
        for s in held:
            s.close()
    for _ in range(100):
        r = upload(server, "busy", body)
        if r.status_code == 200:
            break
        time.sleep(0.05)
    assert r.status_code == 200


def test_expires_after_on_uploads(server):
    text = (line(0) + "\n").encode()
    r = upload(server, "a", form(text, extra={"expires_after[anchor]": "created_at",
                                              "expires_after[seconds]": "3600"}))
    assert r.status_code == 200 and r.json()["expires_at"] == r.json()["created_at"] + 3600
    r = upload(server, "a", form(text, extra={"expires_after[anchor]": "created_at", "expires_after[seconds]": "5"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "expires_after"


def batch(server, who: str, n: int) -> httpx.Response:
    auth = {"authorization": f"Bearer {server.keys[who]}"}
    f = upload(server, who, form(("\n".join(line(i) for i in range(n)) + "\n").encode())).json()
    return httpx.post(server.base_url + "/v1/batches", headers=auth, json={
        "input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})


def test_active_batches_per_key_are_capped(server):
    """`--quota batches:active=2`: a key's third running batch is a 429 with x-ratelimit-*-batches."""
    for _ in range(2):
        assert batch(server, "quota", 1).status_code == 200
    r = batch(server, "quota", 1)
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_active_batches"
    assert r.headers["x-ratelimit-limit-batches"] == "2" and r.headers["retry-after"]


def test_lines_in_flight_per_key_are_capped(server):
    """`--quota batches:lines=5`: a batch whose lines pass the key's waiting lines fails validation."""
    auth = {"authorization": f"Bearer {server.keys['lines']}"}
    b = batch(server, "lines", 6).json()
    for _ in range(200):
        got = httpx.get(server.base_url + f"/v1/batches/{b['id']}", headers=auth).json()
        if got["status"] != "validating":
            break
        time.sleep(0.05)
    assert got["status"] == "failed" and got["errors"]["data"][0]["code"] == "lines_quota_exceeded"


def test_stored_bytes_are_in_metrics(server):
    r = upload(server, "metrics", form((line(0) + "\n").encode()))
    assert r.status_code == 200
    for _ in range(300):
        text = httpx.get(server.base_url + "/metrics", headers={"authorization": f"Bearer {server.keys['a']}"}).text
        value = [ln for ln in text.splitlines() if ln.startswith("kvserve:files_stored_bytes ")]
        if value and float(value[0].split()[1]) >= r.json()["bytes"]:
            break
        time.sleep(0.05)
    assert value and float(value[0].split()[1]) >= r.json()["bytes"]
    assert "kvserve:batch_lines_stored" in text
