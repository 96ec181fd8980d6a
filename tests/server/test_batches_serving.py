"""The Batch API against `kvserve serve` with the real model, driven by the `openai` client as its
users do: files.create → batches.create → batches.retrieve (poll) → files.content. Each line runs
as an interactive request of the batch's key would (moderation, usage ledger, errors into the
error file); a SIGTERM mid-batch and a start on the same data dir answer every line exactly once."""

from __future__ import annotations

import json
import time

import openai
import pytest
from client_api_server import NO_CLIENT_WARNINGS, no_client_warnings, unknown_fields  # noqa: F401 (an autouse fixture)
from servers import ModelServer

from kvserve.server.stores.keys import KeyStore

FLAGGED = "how do I murder my boss and hide it"

pytestmark = NO_CLIENT_WARNINGS


def line(i: int, url: str, body: dict) -> str:
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}) + "\n"


def chat_lines(n: int, max_tokens: int = 4) -> bytes:
    return "".join(line(i, "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Name the number {i}."}],
                                                    "max_tokens": max_tokens, "temperature": 0})
                   for i in range(n)).encode()


def poll(c: openai.OpenAI, batch_id: str, until=("completed", "failed", "cancelled", "expired"),
         timeout: float = 900, done_at_least: int | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = c.batches.retrieve(batch_id)
        if b.status in until or (done_at_least is not None and b.request_counts.completed >= done_at_least):
            return b
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} still {b.status} after {timeout}s: {b.request_counts}")


def rows(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()] if file_id else []


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("batches")
    store = KeyStore(d / "kvserve.db")
    d.joinpath("keys.json").write_text(json.dumps({"a": store.create("batcher"), "b": store.create("other")}))
    store.close()
    return d


@pytest.fixture(scope="module")
def server(data_dir, model_server) -> ModelServer:
    srv = model_server(data_dir, "--max-model-len", "512")
    srv.keys = json.loads(data_dir.joinpath("keys.json").read_text())
    return srv


def client(server, who: str = "a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.keys[who], max_retries=0, timeout=120)


def usage(data_dir, name: str) -> tuple[int, int, int]:
    store = KeyStore(data_dir / "kvserve.db")
    try:
        rows_ = store.usage(name)
    finally:
        store.close()
    return tuple(sum(r[k] for r in rows_) for k in ("requests", "prompt_tokens", "completion_tokens"))


def test_chat_batch_end_to_end(server, data_dir):
    c = client(server)
    body = chat_lines(10) + line(10, "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": FLAGGED}], "max_tokens": 4}).encode() \
        + line(11, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                            "stream": True}).encode()
    f = c.files.create(file=("chat.jsonl", body), purpose="batch")
    before = usage(data_dir, "batcher")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"run": "e2e"})
    assert b.status == "validating" and b.metadata == {"run": "e2e"}
    b = poll(c, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (12, 10, 2)
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    listed = c.batches.list(limit=5).data
    for obj in (f, b, c.files.retrieve(b.output_file_id), c.files.retrieve(b.error_file_id), *listed,
                *c.files.list(purpose="batch_output").data):
        assert unknown_fields(obj) == [], obj                   # every field is one the client models
    out, err = rows(c, b.output_file_id), rows(c, b.error_file_id)
    assert [r["custom_id"] for r in out] == [f"req-{i}" for i in range(10)]
    for r in out:
        resp = r["response"]
        assert resp["status_code"] == 200 and resp["body"]["object"] == "chat.completion"
        assert resp["body"]["usage"]["completion_tokens"] <= 4 and r["id"].startswith("batch_req_")
    codes = {r["custom_id"]: (r["response"]["status_code"], r["response"]["body"]["error"]["code"]) for r in err}
    assert codes["req-10"] == (400, "content_policy_violation")
    assert codes["req-11"][0] == 400
    completion = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in out)
    after = usage(data_dir, "batcher")
    assert after[0] - before[0] == 10 and after[2] - before[2] == completion   # charged to the key
    with pytest.raises(openai.NotFoundError):
        client(server, "b").files.content(b.output_file_id)


def test_completions_and_embeddings_batches(server):
    c = client(server)
    comp = "".join(line(i, "/v1/completions", {"prompt": f"{i} + {i} =", "max_tokens": 3}) for i in range(2))
    emb = line(0, "/v1/embeddings", {"input": ["a cat", "a dog"], "model": "all-minilm-l6-v2"}) \
        + line(1, "/v1/embeddings", {"input": "a bird"})
    ids = []
    for name, text, url in (("c.jsonl", comp, "/v1/completions"), ("e.jsonl", emb, "/v1/embeddings")):
        f = c.files.create(file=(name, text.encode()), purpose="batch")
        ids.append(c.batches.create(input_file_id=f.id, endpoint=url, completion_window="24h").id)
    comp_b, emb_b = poll(c, ids[0]), poll(c, ids[1])
    assert comp_b.status == emb_b.status == "completed"
    texts = rows(c, comp_b.output_file_id)
    assert [r["response"]["body"]["object"] for r in texts] == ["text_completion"] * 2
    vecs = rows(c, emb_b.output_file_id)
    assert [len(r["response"]["body"]["data"]) for r in vecs] == [2, 1]
    assert len(vecs[0]["response"]["body"]["data"][0]["embedding"]) == 384


def test_cancel_a_running_batch(server):
    c = client(server)
    f = c.files.create(file=("many.jsonl", chat_lines(40, max_tokens=16)), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    poll(c, b.id, done_at_least=1)
    assert c.batches.cancel(b.id).status in ("cancelling", "cancelled")
    b = poll(c, b.id, until=("cancelled",), timeout=120)
    assert b.cancelled_at and b.request_counts.completed < 40
    done = rows(c, b.output_file_id)
    assert len(done) == b.request_counts.completed
    assert len({r["custom_id"] for r in done}) == len(done)


def restart_mid_batch(tmp_path, lines: int, max_tokens: int, concurrency: int, stop_after: int) -> None:
    """`lines` chat lines; SIGTERM once `stop_after` are done; a new server on the same data dir
    finishes the batch; each line answered exactly once (output file and access logs)."""
    store = KeyStore(tmp_path / "kvserve.db")
    key = store.create("resumer")
    store.close()
    args = ("--max-model-len", "512", "--batch-concurrency", str(concurrency))
    first = ModelServer(tmp_path, *args).start()
    try:
        c = openai.OpenAI(base_url=first.base_url + "/v1", api_key=key, max_retries=0, timeout=120)
        f = c.files.create(file=("r.jsonl", chat_lines(lines, max_tokens=max_tokens)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        mid = poll(c, b.id, done_at_least=stop_after, timeout=3600)
        assert mid.status == "in_progress"
    finally:
        first.stop()    # SIGTERM while lines run
    assert first.proc.returncode is not None
    second = ModelServer(tmp_path, *args).start()
    try:
        c = openai.OpenAI(base_url=second.base_url + "/v1", api_key=key, max_retries=0, timeout=120)
        b = poll(c, b.id, timeout=7200)
        assert b.status == "completed" and b.request_counts.completed == lines and b.request_counts.failed == 0
        out = rows(c, b.output_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(lines))
        answered = [json.loads(x)["request_id"] for s in (first, second) for x in s.access_log()
                    if f'"{b.id}-' in x and '"status": 200' in x]
        assert len(answered) == len(set(answered)) == lines   # no line ran to an answer twice
        assert {r["response"]["request_id"] for r in out} == set(answered)
    finally:
        second.stop()


def test_a_restart_mid_batch_answers_every_line_once(tmp_path):
    restart_mid_batch(tmp_path, lines=14, max_tokens=8, concurrency=2, stop_after=3)


@pytest.mark.slow
def test_a_500_line_batch_resumes_after_sigterm(tmp_path):
    restart_mid_batch(tmp_path, lines=500, max_tokens=4, concurrency=8, stop_after=200)
