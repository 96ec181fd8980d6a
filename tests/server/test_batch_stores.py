"""The files and batches stores (server/stores/files.py, batches.py) on SQLite and PostgreSQL:
ownership, the size cap and quota, and a batch line answered exactly once whoever claims it."""

from __future__ import annotations

import json

import pytest

from kvserve.errors import InvalidRequest
from kvserve.server.stores.batches import BatchNotFound, BatchStore
from kvserve.server.stores.files import FileLimits, FileNotFound, FileQuotaExceeded, FileStore, FileTooLarge


@pytest.fixture(params=("sqlite", "postgres"))
def target(request, tmp_path):
    return request.getfixturevalue("postgres_server").new_database() if request.param == "postgres" \
        else tmp_path / "kvserve.db"


def test_files_are_per_owner_capped_and_under_quota(target):
    store = FileStore(target, FileLimits(max_file_bytes=100, max_owner_files=2, max_owner_bytes=150))
    try:
        f = store.put("key:a", "batch", "in.jsonl", "x" * 60)
        assert f["bytes"] == 60 and f["object"] == "file" and f["purpose"] == "batch"
        assert store.content("key:a", f["id"]) == "x" * 60
        for call in (store.get, store.content, store.delete):
            with pytest.raises(FileNotFound):
                call("key:b", f["id"])
        with pytest.raises(FileTooLarge):
            store.put("key:a", "batch", "big.jsonl", "x" * 101)
        with pytest.raises(FileQuotaExceeded):   # 60 + 91 bytes > 150
            store.put("key:a", "batch", "more.jsonl", "x" * 91)
        store.put("key:a", "batch", "two.jsonl", "y" * 10)
        with pytest.raises(FileQuotaExceeded):   # a third file
            store.put("key:a", "batch", "three.jsonl", "z")
        out = store.put("key:a", "batch_output", "out.jsonl", "o" * 500, file_id="file-out", quota=False)
        assert store.put("key:a", "batch_output", "out.jsonl", "other", file_id="file-out", quota=False) == out
        assert [x["id"] for x in store.list("key:a", purpose="batch_output")] == ["file-out"]
        assert store.list("key:b") == []
        store.delete("key:a", f["id"])
        with pytest.raises(FileNotFound):
            store.get("key:a", f["id"])
    finally:
        store.close()


def test_a_batch_line_is_answered_once(target):
    store = BatchStore(target)
    try:
        b = store.create("key:a", "/v1/chat/completions", "file-1", "24h", 86400.0, {"job": "x"})
        assert b["status"] == "validating" and b["metadata"] == {"job": "x"}
        with pytest.raises(BatchNotFound):
            store.get("key:b", b["id"])
        assert store.start(b["id"], [(f"r{i}", json.dumps({"i": i})) for i in range(3)])
        assert store.get("key:a", b["id"])["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
        one = store.claim(b["id"], "runner-1", 2)
        two = store.claim(b["id"], "runner-2", 2)
        assert [r["line"] for r in one] == [0, 1] and [r["line"] for r in two] == [2]
        assert store.claim(b["id"], "runner-3", 1) == []
        store.release("runner-2", "batch_other")        # another batch's lines only: line 2 stays held
        assert store.claim(b["id"], "runner-3", 1) == []
        store.heartbeat("runner-2", [(b["id"], 2)])
        assert store.claim(b["id"], "runner-3", 1, stale_s=30.0) == []   # kept fresh
        store.release("runner-2", b["id"], 2)          # a clean shutdown gives line 2 back
        three = store.claim(b["id"], "runner-3", 1)
        assert [r["line"] for r in three] == [2]
        assert not store.finish_line(b["id"], 2, "runner-2", True, {"late": True})   # not its claim any more
        assert store.finish_line(b["id"], 0, "runner-1", True, {"a": 0})
        assert not store.finish_line(b["id"], 0, "runner-1", True, {"a": "again"})
        assert store.finish_line(b["id"], 1, "runner-1", False, {"e": 1})
        assert store.claim(b["id"], "runner-4", 1, stale_s=0.0)[0]["line"] == 2   # a dead runner's stale claim
        assert store.finish_line(b["id"], 2, "runner-4", True, {"a": 2})
        assert store.pending(b["id"]) == 0
        assert store.results(b["id"], "done") == '{"a": 0}\n{"a": 2}\n'
        assert store.results(b["id"], "failed") == '{"e": 1}\n'
        assert store.get("key:a", b["id"])["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
        assert store.set_status(b["id"], "finalizing", when=("in_progress",))
        assert store.set_status(b["id"], "completed", when=("finalizing",), output_file_id="file-o")
        done = store.get("key:a", b["id"])
        assert done["status"] == "completed" and done["output_file_id"] == "file-o" and done["completed_at"]
        with pytest.raises(InvalidRequest):
            store.cancel("key:a", b["id"])
        c = store.create("key:a", "/v1/embeddings", "file-2", "24h", 86400.0, None)
        assert store.cancel("key:a", c["id"])["status"] == "cancelling"
        assert not store.start(c["id"], [("r", "{}")])    # cancelled while validating: never starts
        assert [x["id"] for x in store.list("key:a")] == [c["id"], b["id"]]
        assert [x["id"] for x in store.list("key:a", limit=1, after=c["id"])] == [b["id"]]
    finally:
        store.close()


def test_expired_files_and_finished_batches_are_purged(target):
    """Issue 60: a batch's output file expires 30 days after it is written (OpenAI's default), an
    upload after its `expires_after`; a finished batch is purged `ttl` after it ends (its lines
    with it); an active batch and a file without expiry stay. Expired files count against no one."""
    import time

    from kvserve.server.stores.files import OUTPUT_TTL_S
    from kvserve.server.stores.quota import QuotaLimits

    files = FileStore(target, FileLimits(max_owner_files=2))
    batches = BatchStore(target, QuotaLimits(max_items=10, ttl_s=86400.0))
    try:
        out = files.put("key:a", "batch_output", "out.jsonl", "o", quota=False)
        assert out["expires_at"] == out["created_at"] + OUTPUT_TTL_S
        short = files.put("key:a", "batch", "in.jsonl", "x", expires_s=3600)
        keep = files.put("key:b", "batch", "in.jsonl", "y")
        assert keep["expires_at"] is None
        later = time.time() + 3601
        assert files.purge(now=later) == 1                      # the upload; the output has 30 days
        with pytest.raises(FileNotFound):
            files.get("key:a", short["id"])
        assert files.purge(now=time.time() + OUTPUT_TTL_S + 1) == 1
        assert files.get("key:b", keep["id"])["id"] == keep["id"]

        done = batches.create("key:a", "/v1/chat/completions", "file-1", "24h", 86400.0, None)
        assert batches.start(done["id"], [("r0", json.dumps({}))])
        assert batches.set_status(done["id"], "finalizing") and batches.set_status(done["id"], "completed")
        running = batches.create("key:a", "/v1/chat/completions", "file-1", "24h", 86400.0, None)
        assert batches.purge(now=time.time() + 86401) == 1
        with pytest.raises(BatchNotFound):
            batches.get("key:a", done["id"])
        assert batches.get("key:a", running["id"])["status"] == "validating"
        assert batches.stored_lines() == 0
    finally:
        files.close()
        batches.close()


def test_waiting_lines_are_capped_in_bytes_and_answered_lines_drop_their_bodies(target):
    """Issue 60: 1,000 batches of one 64 MiB file no longer make 64 GB. The bytes of a key's
    unanswered lines are capped (the batch past it is refused as it starts, nothing stored), an
    answered line keeps no body, and a finished batch's lines keep neither body nor result."""
    from kvserve.server.stores.quota import QuotaExceeded, QuotaLimits

    store = BatchStore(target, QuotaLimits(max_bytes=1000))
    try:
        body = json.dumps({"x": "y" * 290})            # ~300 bytes
        first = store.create("key:a", "/v1/chat/completions", "file-1", "24h", 86400.0, None)
        assert store.start(first["id"], [(f"r{i}", body) for i in range(3)])
        second = store.create("key:a", "/v1/chat/completions", "file-1", "24h", 86400.0, None)
        with pytest.raises(QuotaExceeded) as e:
            store.start(second["id"], [("r0", body)])
        assert e.value.code == "lines_quota_exceeded" and store.counts(second["id"])["total"] == 0
        line = store.claim(first["id"], "runner-1", 1)[0]
        assert store.finish_line(first["id"], line["line"], "runner-1", True, {"ok": 1})
        assert store.start(second["id"], [("r0", body)])   # one answered: room for one more
        with store.db.connection() as conn:
            held = conn.execute("SELECT body, result FROM batch_lines WHERE batch_id = ? AND line = ?",
                                (first["id"], line["line"])).fetchone()
        assert held["body"] == "" and held["result"]
        store.set_status(first["id"], "cancelling")
        store.set_status(first["id"], "cancelled", when=("cancelling",))
        with store.db.connection() as conn:
            kept = conn.execute("SELECT body, result FROM batch_lines WHERE batch_id = ?", (first["id"],)).fetchall()
        assert kept and all(r["body"] == "" and r["result"] is None for r in kept)
        assert store.get("key:a", first["id"])["request_counts"]["completed"] == 1
    finally:
        store.close()
